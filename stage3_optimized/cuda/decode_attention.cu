// decode_attention.cu — paged decode attention shared by a GQA group, split over the context
// (flash-decoding), and the merge of the splits.
//
// Computes:    for sequence s, kv head g and its query heads h = g * G .. g * G + G - 1
//              (G = H / Hkv), with ctx = context_lens[s]:
//                out[s, h] = softmax(q[s, h] . K[s, g, 0:ctx] * scale) @ V[s, g, 0:ctx]
//              Kernel 1 (paged_decode_attention), for split j of SPLIT positions
//              [j * SPLIT, min(ctx, (j + 1) * SPLIT)):
//                m   = max of the split's scores,  l = sum exp(score - m),
//                acc = sum exp(score - m) * V      (unnormalised, fp32)
//                part_out[s, h, j] = acc;  part_ml[s, h, j] = (m, l)   (m = -inf, l = 0: empty split)
//              Kernel 2 (merge_attention): M = max_j m_j;
//                out[s, h] = bf16( sum_j acc_j e^(m_j - M) / sum_j l_j e^(m_j - M) )
// Numpy twins: stage3_optimized/ops.py decode_attention_splits(), merge_attention(), and
//              paged_decode_attention() for the two together.
// Launch:      kernel 1: grid (S * Hkv, splits), block G * 32 (one warp per query head of the
//              group). The block walks its split in tiles of TILE positions: all its threads
//              copy the tile's K and V rows (bf16, of kv head g) from the pages into shared
//              memory once, then each warp scores them against its own query (lane j owns
//              dims j, j + 32, ...) with an online softmax. Each K/V row leaves HBM once per
//              group instead of once per query head (stage 2): G = 2 for Qwen3-0.6B, 4 for 8B.
//              Shared memory: 2 * TILE * D bf16, dynamic (kernels.py passes 4 * TILE * D bytes):
//              8 KB at D = 64, 16 KB at D = 128, 32 KB only for D = 256, so a small head
//              dim keeps more blocks per SM than one static size for D = 256 would.
//              A split that starts past its sequence's context returns at once (the graphs'
//              grid is sized for max_ctx: most of a short context's splits are empty); the
//              merge reads only the splits that saw positions, never the empty ones' partials.
//              kernel 2: grid (S * H), block 32.
//              splits = ceil(max ctx / SPLIT): a long context fills the GPU with S * Hkv * splits
//              blocks even when S is 1.
// Shapes:      q: [S, H, D] bf16 (uint16 bits); k_cache, v_cache: [NB, P, Hkv, D] bf16;
//              block_tables: [S, max_blocks] int32; context_lens: [S] int32;
//              part_out: [S, H, splits, D] float32; part_ml: [S, H, splits, 2] float32;
//              out: [S, H, D] bf16; D <= 256, G <= 16
//
// Version history
//   stage 2 v1: one block per (sequence, query head), fp32, the group's heads re-read K/V.
//   v2 (stage 3): K/V pages in bf16.  v3: the output in bf16.  v4: q in bf16 too.
//   v5: one block per (sequence, kv head, split), K/V tiles shared by the group through
//       shared memory, partial softmaxes merged by a second kernel; empty splits return
//       before loading q; shared memory sized by D (dynamic); K/V rows staged with 16-byte
//       loads (8 bf16 at a time) when D is a multiple of 8.

#define TILE 32
#define MAX_D 256
#define PER_LANE (MAX_D / 32)
// -inf without <math.h> (NVRTC, which cupy.RawModule uses, does not include it)
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(unsigned short b) { return __int_as_float((int)(((unsigned)b) << 16)); }
__device__ __forceinline__ unsigned short f32_to_bf16(float f)
{
    const unsigned u = (unsigned)__float_as_int(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)     // NaN -> a quiet bf16 NaN (rounding the GPU's NaN,
        return (unsigned short)(((u >> 16) & 0x8000u) | 0x7FC0u);   // 0x7FFFFFFF, carries into -0)
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);   // round to nearest even
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;   // every lane holds the total
}

extern "C" __global__ void paged_decode_attention(const unsigned short* __restrict__ q,       // [S, H, D]
                                                  const unsigned short* __restrict__ k_cache, // [NB, P, Hkv, D]
                                                  const unsigned short* __restrict__ v_cache, // [NB, P, Hkv, D]
                                                  const int* __restrict__ block_tables,       // [S, max_blocks]
                                                  const int* __restrict__ context_lens,       // [S]
                                                  float* __restrict__ part_out,               // [S, H, splits, D]
                                                  float* __restrict__ part_ml,                // [S, H, splits, 2]
                                                  int H, int Hkv, int D, int P, int max_blocks,
                                                  int split_len, int splits, float scale)
{
    extern __shared__ __align__(16) unsigned short kv_tiles[];   // [2, TILE, D]: K rows, then V rows
    unsigned short* k_tile = kv_tiles;                   // k_tile[i * D + d]: position t0 + i, dim d
    unsigned short* v_tile = kv_tiles + TILE * D;
    const int s = blockIdx.x / Hkv, g = blockIdx.x % Hkv, split = blockIdx.y;
    const int G = H / Hkv;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = g * G + warp;                          // this warp's query head
    const int ctx = context_lens[s];
    const int start = split * split_len;
    if (start >= ctx) return;                            // an empty split: the merge never reads it
                                                         // (the whole block leaves: no barrier waits)
    const int stop = min(ctx, start + split_len);
    const int* table = block_tables + (size_t)s * max_blocks;

    // the query, pre-scaled by 1/sqrt(D), in registers: lane owns dims lane + 32 r
    const unsigned short* qs = q + ((size_t)s * H + h) * D;
    float qr[PER_LANE], acc[PER_LANE];
#pragma unroll
    for (int r = 0; r < PER_LANE; r++) {
        const int d = lane + 32 * r;
        qr[r] = d < D ? bf16_to_f32(qs[d]) * scale : 0.0f;
        acc[r] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;

    for (int t0 = start; t0 < stop; t0 += TILE) {
        const int rows = min(TILE, stop - t0);
        // all G warps copy the tile's K and V rows from their pages, once for the group
        __syncthreads();                                 // the previous tile is consumed
        if (D % 8 == 0) {
            // 16-byte loads, 8 bf16 each. Aligned: a pool row starts at element
            // ((page * P + t % P) * Hkv + g) * D, a multiple of D and so of 8 elements (16 bytes);
            // the pool itself is a CuPy allocation (256-byte aligned); a tile row is i * D
            // elements into the 16-byte aligned kv_tiles
            const int vecs = D / 8;
            for (int e = threadIdx.x; e < rows * vecs; e += blockDim.x) {
                const int i = e / vecs, c = e - i * vecs, t = t0 + i;
                const size_t row = (((size_t)table[t / P] * P + t % P) * Hkv + g) * D;
                reinterpret_cast<uint4*>(k_tile + i * D)[c] = reinterpret_cast<const uint4*>(k_cache + row)[c];
                reinterpret_cast<uint4*>(v_tile + i * D)[c] = reinterpret_cast<const uint4*>(v_cache + row)[c];
            }
        } else {
            for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
                const int i = e / D, d = e - i * D, t = t0 + i;
                const size_t row = (((size_t)table[t / P] * P + t % P) * Hkv + g) * D;
                k_tile[i * D + d] = k_cache[row + d];
                v_tile[i * D + d] = v_cache[row + d];
            }
        }
        __syncthreads();
        for (int i = 0; i < rows; i++) {
            float dot = 0.0f;
#pragma unroll
            for (int r = 0; r < PER_LANE; r++) {
                const int d = lane + 32 * r;
                if (d < D) dot += qr[r] * bf16_to_f32(k_tile[i * D + d]);
            }
            const float score = warp_sum(dot);
            // online softmax: rescale what we have by exp(m_old - m_new), add the new term
            const float m_new = fmaxf(m, score);
            const float correction = expf(m - m_new);    // 0 on the first position (m = -inf)
            const float p = expf(score - m_new);
            l = l * correction + p;
#pragma unroll
            for (int r = 0; r < PER_LANE; r++) {
                const int d = lane + 32 * r;
                if (d < D) acc[r] = acc[r] * correction + p * bf16_to_f32(v_tile[i * D + d]);
            }
            m = m_new;
        }
    }

    // this split's partial result (m, l and the unnormalised acc)
    const size_t part = ((size_t)s * H + h) * splits + split;
#pragma unroll
    for (int r = 0; r < PER_LANE; r++) {
        const int d = lane + 32 * r;
        if (d < D) part_out[part * D + d] = acc[r];
    }
    if (lane == 0) {
        part_ml[part * 2] = m;
        part_ml[part * 2 + 1] = l;
    }
}

extern "C" __global__ void merge_attention(const float* __restrict__ part_out,   // [S, H, splits, D]
                                           const float* __restrict__ part_ml,    // [S, H, splits, 2]
                                           const int* __restrict__ context_lens, // [S]
                                           unsigned short* __restrict__ out,     // [S, H, D] bf16
                                           int H, int D, int split_len, int splits)
{
    // exercise 3.2 begin
    const int sh = blockIdx.x, s = sh / H, lane = threadIdx.x;
    const int used = (context_lens[s] + split_len - 1) / split_len;   // splits that saw positions
    const float* ml = part_ml + (size_t)sh * splits * 2;
    float m_all = NEG_INF;
    for (int j = 0; j < used; j++) m_all = fmaxf(m_all, ml[2 * j]);
    float l_all = 0.0f;
    for (int j = 0; j < used; j++) l_all += ml[2 * j + 1] * expf(ml[2 * j] - m_all);
    for (int d = lane; d < D; d += 32) {
        float sum = 0.0f;
        for (int j = 0; j < used; j++) sum += part_out[((size_t)sh * splits + j) * D + d] * expf(ml[2 * j] - m_all);
        out[(size_t)sh * D + d] = f32_to_bf16(sum / l_all);
    }
    // exercise 3.2 end
}
