// decode_attention.cu — paged attention for decode: one new query token per sequence.
//
// Computes:    for sequence s and query head h (kv head g = h / (H / Hkv), GQA):
//                out[s, h] = softmax(q[s, h] . K[s, g, 0:ctx] * scale) @ V[s, g, 0:ctx]
//              where ctx = context_lens[s] and position t of sequence s lives in
//              page block_tables[s, t / P] at offset t % P of the paged cache.
//              The query is the newest token, so it sees every cached position (no mask).
// Numpy twin:  stage2_batched/ops.py paged_decode_attention()
// Launch:      grid (S, H), block WARPS * 32 = 128.
//              The four warps of a block split the context (warp w takes positions
//              w, w + 4, w + 8, ...); each keeps an online softmax (running max m,
//              running sum l, running output acc) and they merge through shared memory.
//              Inside a warp, lane j owns dims j, j + 32, ... of q, k, v and acc, so
//              every K/V row read is one coalesced 4*D-byte load.
// Shapes:      q, out: [S, H, D] float32; k_cache, v_cache: [NB, P, Hkv, D];
//              block_tables: [S, max_blocks] int32; context_lens: [S] int32; D <= 256
//
// Version history
//   v1: one block per (sequence, head), KV split over 4 warps, online softmax.
//       Query heads of one GQA group re-read the same K/V (stage 3 shares them).

#define WARPS 4
#define MAX_D 256
#define PER_LANE (MAX_D / 32)
// -inf without <math.h> (NVRTC, which cupy.RawModule uses, does not include it)
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float x)
{
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;   // every lane holds the total
}

extern "C" __global__ void paged_decode_attention(const float* __restrict__ q,          // [S, H, D]
                                                  const float* __restrict__ k_cache,    // [NB, P, Hkv, D]
                                                  const float* __restrict__ v_cache,    // [NB, P, Hkv, D]
                                                  const int* __restrict__ block_tables, // [S, max_blocks]
                                                  const int* __restrict__ context_lens, // [S]
                                                  float* __restrict__ out,              // [S, H, D]
                                                  int H, int Hkv, int D, int P, int max_blocks, float scale)
{
    // exercise 2.5 begin
    const int s = blockIdx.x, h = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = h / (H / Hkv);                         // the kv head this query head reads
    const int ctx = context_lens[s];
    const int* table = block_tables + (size_t)s * max_blocks;

    // the query, pre-scaled by 1/sqrt(D), in registers: lane owns dims lane + 32*r
    const float* qs = q + ((size_t)s * H + h) * D;
    float qr[PER_LANE], acc[PER_LANE];
#pragma unroll
    for (int r = 0; r < PER_LANE; r++) {
        const int d = lane + 32 * r;
        qr[r] = d < D ? qs[d] * scale : 0.0f;
        acc[r] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;

    for (int t = warp; t < ctx; t += WARPS) {
        // find position t in the pages: page number from the block table, then the row
        const size_t row = (((size_t)table[t / P] * P + t % P) * Hkv + g) * D;
        float dot = 0.0f;
#pragma unroll
        for (int r = 0; r < PER_LANE; r++) {
            const int d = lane + 32 * r;
            if (d < D) dot += qr[r] * k_cache[row + d];
        }
        const float score = warp_sum(dot);
        // online softmax: rescale what we have by exp(m_old - m_new), add the new term
        const float m_new = fmaxf(m, score);
        const float correction = expf(m - m_new);      // 0 on the first position (m = -inf)
        const float p = expf(score - m_new);
        l = l * correction + p;
#pragma unroll
        for (int r = 0; r < PER_LANE; r++) {
            const int d = lane + 32 * r;
            if (d < D) acc[r] = acc[r] * correction + p * v_cache[row + d];
        }
        m = m_new;
    }

    // merge the four warps' partial softmaxes: rescale each to the common max
    __shared__ float sm_m[WARPS], sm_l[WARPS];
    __shared__ float sm_acc[WARPS][MAX_D];
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
    for (int r = 0; r < PER_LANE; r++) {
        const int d = lane + 32 * r;
        if (d < D) sm_acc[warp][d] = acc[r];
    }
    __syncthreads();
    if (warp != 0) return;
    float m_all = NEG_INF;
    for (int w = 0; w < WARPS; w++) m_all = fmaxf(m_all, sm_m[w]);
    float l_all = 0.0f, factor[WARPS];
    for (int w = 0; w < WARPS; w++) {
        // a warp that saw no position (ctx < WARPS) has m = -inf and contributes nothing
        factor[w] = sm_m[w] == NEG_INF ? 0.0f : expf(sm_m[w] - m_all);
        l_all += sm_l[w] * factor[w];
    }
    float* o = out + ((size_t)s * H + h) * D;
    for (int d = lane; d < D; d += 32) {
        float sum = 0.0f;
        for (int w = 0; w < WARPS; w++) sum += sm_acc[w][d] * factor[w];
        o[d] = sum / l_all;
    }
    // exercise 2.5 end
}
