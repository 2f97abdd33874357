// prefill_attention.cu — causal attention for a packed, variable-length batch of
// prefill chunks, reading every key and value (earlier chunks too) from the pages.
//
// Computes:    for packed query token n of sequence s = token_seq[n] at position
//              p = positions[n], and query head h (kv head g = h / (H / Hkv)):
//                out[n, h] = softmax(q[n, h] . K[s, g, 0:p+1] * scale) @ V[s, g, 0:p+1]
//              Causality is "see positions 0..p": the chunk's own keys were stored in
//              the cache before this kernel runs, so a chunk that starts at position
//              512 attends to the 512 earlier positions exactly like to its own.
// Numpy twin:  stage3_optimized/ops.py prefill_attention()
// Launch:      grid (ceil(N / WARPS), H), block WARPS * 32 = 128.
//              One warp per (query token, head): it walks positions 0..p with an
//              online softmax; lane j owns dims j, j + 32, ... The four warps of a block
//              are four neighbouring tokens (usually of the same sequence), so they read
//              the same K/V rows and share them through L1/L2.
// Shapes:      q, out: [N, H, D] bf16 (uint16 bits); k_cache, v_cache: [NB, P, Hkv, D] bf16;
//              block_tables: [S, max_blocks] int32; token_seq, positions: [N] int32; D <= 256
//
// Version history
//   stage 2 v1: one warp per query token and head, no tiling, fp32.
//   v2 (stage 3): K/V pages in bf16; the cached prefix of a prefix-cache hit is read from
//       the pages like any earlier chunk.
//   v3: the output in bf16 (the next GEMM's input), rounded once.
//   v4: q in bf16 too.
//   The tensor-core kernel (prefill_attention_tc.cu, FlashAttention-2 tiles on WMMA) does the
//   same with tiles; this loop stays as the plain version it is tested against.

#define WARPS 4
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

extern "C" __global__ void prefill_attention(const unsigned short* __restrict__ q,       // [N, H, D]
                                             const unsigned short* __restrict__ k_cache, // [NB, P, Hkv, D]
                                             const unsigned short* __restrict__ v_cache, // [NB, P, Hkv, D]
                                             const int* __restrict__ block_tables, // [S, max_blocks]
                                             const int* __restrict__ token_seq,    // [N]
                                             const int* __restrict__ positions,    // [N]
                                             unsigned short* __restrict__ out,     // [N, H, D]
                                             int N, int H, int Hkv, int D, int P, int max_blocks, float scale)
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = blockIdx.x * WARPS + warp;
    const int h = blockIdx.y;
    if (n >= N) return;                                  // the last block may be partly empty
    const int g = h / (H / Hkv);
    const int visible = positions[n] + 1;                // causal: positions 0..p
    const int* table = block_tables + (size_t)token_seq[n] * max_blocks;

    const unsigned short* qn = q + ((size_t)n * H + h) * D;
    float qr[PER_LANE], acc[PER_LANE];
#pragma unroll
    for (int r = 0; r < PER_LANE; r++) {
        const int d = lane + 32 * r;
        qr[r] = d < D ? bf16_to_f32(qn[d]) * scale : 0.0f;
        acc[r] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;

    for (int t = 0; t < visible; t++) {
        const size_t row = (((size_t)table[t / P] * P + t % P) * Hkv + g) * D;
        float dot = 0.0f;
#pragma unroll
        for (int r = 0; r < PER_LANE; r++) {
            const int d = lane + 32 * r;
            if (d < D) dot += qr[r] * bf16_to_f32(k_cache[row + d]);
        }
        const float score = warp_sum(dot);
        const float m_new = fmaxf(m, score);
        const float correction = expf(m - m_new);
        const float p = expf(score - m_new);
        l = l * correction + p;
#pragma unroll
        for (int r = 0; r < PER_LANE; r++) {
            const int d = lane + 32 * r;
            if (d < D) acc[r] = acc[r] * correction + p * bf16_to_f32(v_cache[row + d]);
        }
        m = m_new;
    }

    unsigned short* o = out + ((size_t)n * H + h) * D;
#pragma unroll
    for (int r = 0; r < PER_LANE; r++) {
        const int d = lane + 32 * r;
        if (d < D) o[d] = f32_to_bf16(acc[r] / l);
    }
}
