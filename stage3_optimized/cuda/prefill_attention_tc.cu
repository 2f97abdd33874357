// prefill_attention_tc.cu — FlashAttention-2-style causal prefill on tensor cores (PTX wmma, bf16),
// reading every key and value (earlier chunks, cached prefix pages) from the paged pool.
//
// Computes:    the same as prefill_attention.cu: for packed query token n of sequence
//              s = token_seq[n] at position p = positions[n], query head h, kv head g = h / G:
//                out[n, h] = softmax(q[n, h] . K[s, g, 0:p+1] * scale) @ V[s, g, 0:p+1]
//              except that the probabilities are rounded to bf16 before the P @ V product
//              (the tensor cores take bf16), as FlashAttention-2 does.
// Numpy twin:  stage3_optimized/ops.py prefill_attention()  (fp32 probabilities: see the test's tolerance)
// Launch:      grid (num_tiles, Hkv * ceil(G / WARPS)), block 32 * min(G, WARPS).
//              A tile is up to 16 consecutive query tokens of one sequence (the host cuts the
//              packed batch into tiles: tile_start, tile_count). A block takes one tile and up
//              to WARPS query heads of one GQA group, one warp per head. It walks the keys in
//              tiles of 16 positions up to the tile's last position: all its threads copy the
//              K and V rows (bf16) from the pages into shared memory once for the group, then
//              each warp, on tensor cores (16x16x16 bf16 -> fp32 fragments):
//                S = Q K^T            (D/16 mma steps; Q's fragments stay in registers)
//                online softmax on S's rows in fp32 (two lanes per row), causal mask,
//                O = O * correction + P V   (P rounded to bf16; O in registers, lane l owns
//                                            row l / 2 and 8 columns of every 16-column slice)
//              and finally writes O / l.
// Shapes:      q, out: [N, H, D] bf16 (uint16 bits); k_cache, v_cache: [NB, P, Hkv, D] bf16;
//              block_tables: [S, max_blocks] int32; token_seq, positions: [N] int32;
//              tile_start, tile_count: [num_tiles] int32; D a multiple of 16, <= 128
//
// Emulator: unsupported (tensor-core wmma PTX; tests/test_stage3_cuda_emulated.py runs it with a fragment shim)
// FLOPs: 4 * N * p * D per head (two GEMMs), on tensor cores at up to ~990 TFLOP/s (H200, bf16)
// instead of the CUDA cores' ~67 (fp32) that prefill_attention.cu uses.
//
// Version history
//   v1: wmma 16x16x16 tiles (PTX, no header), one warp per query head, K/V tiles shared by up to 4 heads of a
//       GQA group, online softmax between shared-memory score tiles, O in registers.

// The tensor-core instructions, as PTX `wmma` (what <mma.h>'s nvcuda::wmma compiles to), so
// this file needs no header: NVRTC, which cupy.RawModule uses, has none of its own. A fragment is a
// 16x16 tile spread over the 32 lanes of a warp in an unspecified layout: 4 registers of bf16 pairs
// for A and B, 8 floats for the fp32 accumulator. The load / mma / store calls are warp-collective.
// The CPU emulator supplies its own versions of these five functions (tests/test_stage3_cuda_emulated.py).
#ifdef __CUDA_ARCH__
struct FragA { unsigned r[4]; };         // A [16 rows, 16 k] bf16, row-major in memory
struct FragB { unsigned r[4]; };         // B [16 k, 16 cols] bf16
struct FragC { float r[8]; };            // C [16, 16] fp32

__device__ __forceinline__ void fill_zero(FragC& c)
{
#pragma unroll
    for (int i = 0; i < 8; i++) c.r[i] = 0.0f;
}
__device__ __forceinline__ void load_a_row(FragA& a, const unsigned short* p, unsigned ld)
{
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.bf16 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(a.r[0]), "=r"(a.r[1]), "=r"(a.r[2]), "=r"(a.r[3]) : "l"(p), "r"(ld) : "memory");
}
template <bool COL>                       // B read column-major (K^T from a row-major K) or row-major (V)
__device__ __forceinline__ void load_b(FragB& b, const unsigned short* p, unsigned ld)
{
    if (COL)
        asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.bf16 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(b.r[0]), "=r"(b.r[1]), "=r"(b.r[2]), "=r"(b.r[3]) : "l"(p), "r"(ld) : "memory");
    else
        asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.bf16 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(b.r[0]), "=r"(b.r[1]), "=r"(b.r[2]), "=r"(b.r[3]) : "l"(p), "r"(ld) : "memory");
}
template <bool COL>                       // c += a . b, fp32 accumulation
__device__ __forceinline__ void mma(FragC& c, const FragA& a, const FragB& b)
{
    if (COL)
        asm volatile("wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, {%12, %13, %14, %15}, "
                     "{%0, %1, %2, %3, %4, %5, %6, %7};"
                     : "+f"(c.r[0]), "+f"(c.r[1]), "+f"(c.r[2]), "+f"(c.r[3]),
                       "+f"(c.r[4]), "+f"(c.r[5]), "+f"(c.r[6]), "+f"(c.r[7])
                     : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]),
                       "r"(b.r[0]), "r"(b.r[1]), "r"(b.r[2]), "r"(b.r[3]));
    else
        asm volatile("wmma.mma.sync.aligned.row.row.m16n16k16.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, {%12, %13, %14, %15}, "
                     "{%0, %1, %2, %3, %4, %5, %6, %7};"
                     : "+f"(c.r[0]), "+f"(c.r[1]), "+f"(c.r[2]), "+f"(c.r[3]),
                       "+f"(c.r[4]), "+f"(c.r[5]), "+f"(c.r[6]), "+f"(c.r[7])
                     : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]),
                       "r"(b.r[0]), "r"(b.r[1]), "r"(b.r[2]), "r"(b.r[3]));
}
__device__ __forceinline__ void store_c_row(float* p, const FragC& c, unsigned ld)
{
    asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.f32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8}, %9;"
                 :: "l"(p), "f"(c.r[0]), "f"(c.r[1]), "f"(c.r[2]), "f"(c.r[3]),
                    "f"(c.r[4]), "f"(c.r[5]), "f"(c.r[6]), "f"(c.r[7]), "r"(ld) : "memory");
}
#endif

__device__ __forceinline__ unsigned short f32_to_bf16(float f)
{
    const unsigned u = (unsigned)__float_as_int(f);             // round to nearest even
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#define T16 16                      // the WMMA tile: 16 queries x 16 keys x 16 dims
#define WARPS 4                     // query heads per block (a larger GQA group takes several blocks)
#define MAX_D 128
#define NEG_INF __int_as_float(0xff800000)

extern "C" __global__ void prefill_attention_tc(const unsigned short* __restrict__ q,       // [N, H, D]
                                                const unsigned short* __restrict__ k_cache, // [NB, P, Hkv, D]
                                                const unsigned short* __restrict__ v_cache, // [NB, P, Hkv, D]
                                                const int* __restrict__ block_tables,       // [S, max_blocks]
                                                const int* __restrict__ token_seq,          // [N]
                                                const int* __restrict__ positions,          // [N]
                                                const int* __restrict__ tile_start,         // [num_tiles]
                                                const int* __restrict__ tile_count,         // [num_tiles]
                                                unsigned short* __restrict__ out,           // [N, H, D]
                                                int H, int Hkv, int D, int P, int max_blocks, float scale)
{
    __shared__ __align__(32) unsigned short k_tile[T16][MAX_D];       // 16 keys of kv head g (bf16)
    __shared__ __align__(32) unsigned short v_tile[T16][MAX_D];
    __shared__ __align__(32) float scores[WARPS][T16][T16];           // S, then P V slices
    __shared__ __align__(32) unsigned short probs[WARPS][T16][T16];   // P (and Q slices on the way in)

    const int G = H / Hkv;
    const int blocks_per_group = (G + WARPS - 1) / WARPS;
    const int g = blockIdx.y / blocks_per_group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = g * G + (blockIdx.y % blocks_per_group) * WARPS + warp;   // this warp's query head
    const bool active = warp < G - (blockIdx.y % blocks_per_group) * WARPS;  // the group's last block may be short
    const int n0 = tile_start[blockIdx.x], count = tile_count[blockIdx.x];
    const int* table = block_tables + (size_t)token_seq[n0] * max_blocks;
    const int last_pos = positions[n0 + count - 1];   // the tile's tokens are consecutive positions
    const int first_pos = positions[n0];
    const int kd = D / T16;

    // Q's D/16 fragments, loaded once through the warp's 16x16 staging tile (rows past count are 0)
    const int row = lane / 2, half = lane % 2;        // the softmax and O layout: two lanes per row
    FragA q_frag[MAX_D / T16];
#pragma unroll
    for (int kk = 0; kk < MAX_D / T16; kk++) {
        if (kk >= kd) break;
        for (int c = half * 8; c < half * 8 + 8; c++) {
            const unsigned short bits = (active && row < count) ? q[((size_t)(n0 + row) * H + h) * D + kk * T16 + c] : 0;
            probs[warp][row][c] = bits;
        }
        __syncwarp();
        load_a_row(q_frag[kk], &probs[warp][0][0], T16);
        __syncwarp();
    }

    float o[MAX_D / T16][8];                           // O: row `row`, columns kk*16 + half*8 + j
#pragma unroll
    for (int kk = 0; kk < MAX_D / T16; kk++)
#pragma unroll
        for (int j = 0; j < 8; j++) o[kk][j] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    const int my_pos = first_pos + row;                // causal: this row sees keys 0..my_pos

    for (int t0 = 0; t0 <= last_pos; t0 += T16) {
        // the block copies 16 K and V rows from their pages (zeros past the tile's last position:
        // a masked key must still be a number, 0 * NaN would poison the product)
        __syncthreads();
        for (int e = threadIdx.x; e < T16 * D; e += blockDim.x) {
            const int i = e / D, d = e % D, t = t0 + i;
            unsigned short kb = 0, vb = 0;
            if (t <= last_pos) {
                const size_t at = (((size_t)table[t / P] * P + t % P) * Hkv + g) * D + d;
                kb = k_cache[at];
                vb = v_cache[at];
            }
            k_tile[i][d] = kb;
            v_tile[i][d] = vb;
        }
        __syncthreads();
        if (!active) continue;

        // S = Q K^T on tensor cores: K's row-major tile read as a col-major B is K^T
        FragC s_frag;
        fill_zero(s_frag);
#pragma unroll
        for (int kk = 0; kk < MAX_D / T16; kk++) {
            if (kk >= kd) break;
            FragB k_frag;
            load_b<true>(k_frag, &k_tile[0][kk * T16], MAX_D);
            mma<true>(s_frag, q_frag[kk], k_frag);
        }
        store_c_row(&scores[warp][0][0], s_frag, T16);
        __syncwarp();

        // online softmax on this lane's 8 scores of its row (the partner lane has the other 8)
        float sc[8], tile_max = NEG_INF;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int t = t0 + half * 8 + j;
            sc[j] = (row < count && t <= my_pos) ? scores[warp][row][half * 8 + j] * scale : NEG_INF;
            tile_max = fmaxf(tile_max, sc[j]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        const float m_new = fmaxf(m, tile_max);
        // a row with nothing visible yet (or past count) keeps m = -inf: use 0 as its base
        const float base = m_new == NEG_INF ? 0.0f : m_new;
        const float correction = expf(m - base);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float p = expf(sc[j] - base);       // 0 for a masked key
            sum += p;
            probs[warp][row][half * 8 + j] = f32_to_bf16(p);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * correction + sum;
        m = m_new;
        __syncwarp();

        // O = O * correction + P V, one 16-column slice of V at a time
        FragA p_frag;
        load_a_row(p_frag, &probs[warp][0][0], T16);
#pragma unroll
        for (int kk = 0; kk < MAX_D / T16; kk++) {
            if (kk >= kd) break;
            FragB v_frag;
            FragC pv;
            fill_zero(pv);
            load_b<false>(v_frag, &v_tile[0][kk * T16], MAX_D);
            mma<false>(pv, p_frag, v_frag);
            store_c_row(&scores[warp][0][0], pv, T16);
            __syncwarp();
#pragma unroll
            for (int j = 0; j < 8; j++) o[kk][j] = o[kk][j] * correction + scores[warp][row][half * 8 + j];
            __syncwarp();
        }
    }

    if (!active || row >= count) return;
    unsigned short* dst = out + ((size_t)(n0 + row) * H + h) * D;
#pragma unroll
    for (int kk = 0; kk < MAX_D / T16; kk++) {
        if (kk >= kd) break;
#pragma unroll
        for (int j = 0; j < 8; j++) dst[kk * T16 + half * 8 + j] = f32_to_bf16(o[kk][j] / l);
    }
}
