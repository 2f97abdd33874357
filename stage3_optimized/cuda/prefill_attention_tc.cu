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
//                                            row l / 2 and 8 columns of every 16-column slice, col())
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
//   v2: K/V staged with 16-byte loads; `scores` and `probs` rows 24 apart and each lane's columns
//       in two runs of four, so the softmax's reads and P's writes are free of bank conflicts.

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
    const unsigned u = (unsigned)__float_as_int(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)     // NaN -> a quiet bf16 NaN (rounding the GPU's NaN,
        return (unsigned short)(((u >> 16) & 0x8000u) | 0x7FC0u);   // 0x7FFFFFFF, carries into -0)
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);   // round to nearest even
}

#define T16 16                      // the WMMA tile: 16 queries x 16 keys x 16 dims
#define WARPS 4                     // query heads per block (a larger GQA group takes several blocks)
#define MAX_D 128
#define SLD 24                      // row stride of `scores` (floats) and `probs` (bf16), see below
#define NEG_INF __int_as_float(0xff800000)

// Lane l of a warp owns row l / 2 of the 16x16 score tile and, of its 16 columns, the two runs
// of four col(j), j = 0..7: half = l % 2 takes columns 4 half .. 4 half + 3 and 8 + 4 half ..
// 8 + 4 half + 3. With rows SLD = 24 apart, the lanes' 16-byte reads of `scores` fall in 8
// different bank groups per quarter warp (row * 6 + half + 2 r, mod 8: all distinct for rows
// 4a .. 4a + 3), and their 8-byte writes of `probs` in 16 different bank pairs per half warp
// (row * 6 + half + 2 r, mod 16, rows 8a .. 8a + 7): no bank conflict (a stride of 16 with
// eight contiguous columns per lane was 8-way on the reads and 4-way on the writes).
// wmma takes a stride that is a multiple of 16 bytes and a 32-byte aligned tile: 24 floats
// (96 bytes) and 24 bf16 (48 bytes) rows, tiles of 1,536 and 768 bytes, satisfy both.
__device__ __forceinline__ int col(int j, int half) { return (j / 4) * 8 + half * 4 + (j % 4); }

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi)
{
    return (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);   // lo at the lower address
}

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
    __shared__ __align__(32) float scores[WARPS][T16][SLD];           // S, then P V slices
    __shared__ __align__(32) unsigned short probs[WARPS][T16][SLD];   // P (and Q slices on the way in)

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

    // Q's D/16 fragments, loaded once through the warp's 16x16 staging tile (rows past count are 0);
    // each lane copies its two runs of 4 bf16 with 8-byte loads (D is a multiple of 16: aligned)
    const int row = lane / 2, half = lane % 2;        // the softmax and O layout: two lanes per row
    FragA q_frag[MAX_D / T16];
#pragma unroll
    for (int kk = 0; kk < MAX_D / T16; kk++) {
        if (kk >= kd) break;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            uint2 bits = make_uint2(0u, 0u);
            if (active && row < count)
                bits = *reinterpret_cast<const uint2*>(q + ((size_t)(n0 + row) * H + h) * D + kk * T16 + col(4 * r, half));
            *reinterpret_cast<uint2*>(&probs[warp][row][col(4 * r, half)]) = bits;
        }
        __syncwarp();
        load_a_row(q_frag[kk], &probs[warp][0][0], SLD);
        __syncwarp();
    }

    float o[MAX_D / T16][8];                           // O: row `row`, columns kk*16 + col(j)
#pragma unroll
    for (int kk = 0; kk < MAX_D / T16; kk++)
#pragma unroll
        for (int j = 0; j < 8; j++) o[kk][j] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    const int my_pos = first_pos + row;                // causal: this row sees keys 0..my_pos
    const int vecs = D / 8;                            // 16-byte pieces of a K or V row

    for (int t0 = 0; t0 <= last_pos; t0 += T16) {
        // the block copies 16 K and V rows from their pages with 16-byte loads (a pool row starts
        // at a multiple of D elements, D a multiple of 16, in a 256-byte aligned CuPy allocation),
        // zeros past the tile's last position: a masked key must still be a number, 0 * NaN
        // would poison the product
        __syncthreads();
        for (int e = threadIdx.x; e < T16 * vecs; e += blockDim.x) {
            const int i = e / vecs, c = e - i * vecs, t = t0 + i;
            uint4 kb = make_uint4(0u, 0u, 0u, 0u), vb = kb;
            if (t <= last_pos) {
                const size_t at = (((size_t)table[t / P] * P + t % P) * Hkv + g) * D;
                kb = reinterpret_cast<const uint4*>(k_cache + at)[c];
                vb = reinterpret_cast<const uint4*>(v_cache + at)[c];
            }
            reinterpret_cast<uint4*>(&k_tile[i][0])[c] = kb;
            reinterpret_cast<uint4*>(&v_tile[i][0])[c] = vb;
        }
        __syncthreads();
        if (!active) continue;

        // exercise 3.3 begin
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
        store_c_row(&scores[warp][0][0], s_frag, SLD);
        __syncwarp();

        // online softmax on this lane's 8 scores of its row (the partner lane has the other 8),
        // read as two 16-byte float4 loads
        const float4 s_lo = *reinterpret_cast<const float4*>(&scores[warp][row][col(0, half)]);
        const float4 s_hi = *reinterpret_cast<const float4*>(&scores[warp][row][col(4, half)]);
        const float raw[8] = {s_lo.x, s_lo.y, s_lo.z, s_lo.w, s_hi.x, s_hi.y, s_hi.z, s_hi.w};
        float sc[8], tile_max = NEG_INF;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int t = t0 + col(j, half);
            sc[j] = (row < count && t <= my_pos) ? raw[j] * scale : NEG_INF;
            tile_max = fmaxf(tile_max, sc[j]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        const float m_new = fmaxf(m, tile_max);
        // a row with nothing visible yet (or past count) keeps m = -inf: use 0 as its base
        const float base = m_new == NEG_INF ? 0.0f : m_new;
        const float correction = expf(m - base);
        float pr[8], sum = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            pr[j] = expf(sc[j] - base);                // 0 for a masked key
            sum += pr[j];
        }
        // P as bf16, four columns per 8-byte store
        *reinterpret_cast<uint2*>(&probs[warp][row][col(0, half)]) =
            make_uint2(pack_bf16(pr[0], pr[1]), pack_bf16(pr[2], pr[3]));
        *reinterpret_cast<uint2*>(&probs[warp][row][col(4, half)]) =
            make_uint2(pack_bf16(pr[4], pr[5]), pack_bf16(pr[6], pr[7]));
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * correction + sum;
        m = m_new;
        __syncwarp();

        // O = O * correction + P V, one 16-column slice of V at a time
        FragA p_frag;
        load_a_row(p_frag, &probs[warp][0][0], SLD);
#pragma unroll
        for (int kk = 0; kk < MAX_D / T16; kk++) {
            if (kk >= kd) break;
            FragB v_frag;
            FragC pv;
            fill_zero(pv);
            load_b<false>(v_frag, &v_tile[0][kk * T16], MAX_D);
            mma<false>(pv, p_frag, v_frag);
            store_c_row(&scores[warp][0][0], pv, SLD);
            __syncwarp();
            const float4 lo = *reinterpret_cast<const float4*>(&scores[warp][row][col(0, half)]);
            const float4 hi = *reinterpret_cast<const float4*>(&scores[warp][row][col(4, half)]);
            const float slice[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int j = 0; j < 8; j++) o[kk][j] = o[kk][j] * correction + slice[j];
            __syncwarp();
        }
        // exercise 3.3 end
    }

    if (!active || row >= count) return;
    unsigned short* dst = out + ((size_t)(n0 + row) * H + h) * D;
#pragma unroll
    for (int kk = 0; kk < MAX_D / T16; kk++) {
        if (kk >= kd) break;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float* v = &o[kk][4 * r];
            *reinterpret_cast<uint2*>(dst + kk * T16 + col(4 * r, half)) =
                make_uint2(pack_bf16(v[0] / l, v[1] / l), pack_bf16(v[2] / l, v[3] / l));
        }
    }
}
