// qk_norm_rope_store.cu — from the fused QKV GEMM's output to attention's inputs, one pass.
//
// Computes:    for token n, with q, k, v = the H, Hkv, Hkv heads of D values in qkv[n]:
//                q head h:   x = q[h] (fp32);  if has_norm: x = x / rms(x) * q_norm
//                            q_out[n, h] = bf16(rope(x, cos[p], sin[p])),  p = positions[n]
//                k head g:   the same with k_norm, then k_cache[slot] [g] = bf16(rope(x))
//                            and v_cache[slot][g] = v[g]   (bits copied), slot = slot_mapping[n] >= 0
//              rope is rotate-half: pair (i, i + D/2) turns by the angle of position n's row.
// Numpy twin:  stage3_optimized/ops.py qk_norm_rope_store()
// Launch:      grid (N, H + Hkv), block 32: one warp per head. Lane j holds the pairs
//              (i, i + D/2) for i = j, j + 32, ... < D/2, so the per-head RMS is one warp
//              sum and each rotation pair sits in one lane's registers.
// Shapes:      qkv: [N, (H + 2 Hkv) * D] bf16 (uint16 bits); q_norm, k_norm: [D] bf16;
//              cos, sin: [T_max, D/2] float32 (the model's tables; token n reads row positions[n]);
//              positions: [N] int32; k_cache, v_cache: [NB, P, Hkv, D]
//              bf16 (one layer, [NB * P] slots); slot_mapping: [N] int32; q_out: [N, H, D] bf16; D <= 256
//
// Launches: stage 2 ran rmsnorm(q), rmsnorm(k), rope(q), rope(k), store_kvcache: five kernels,
// and q, k crossed memory five times. Here: one kernel, qkv read once, q and k/v written once.
//
// Version history
//   stage 2: rmsnorm.cu, rope.cu, store_kvcache.cu, fp32.
//   v1 (stage 3): fused, one warp per head, fp32.
//   v2: k and v stored in bf16 pages (half the bytes a decode step reads back).
//   v3: the norm weights in bf16, like every weight.
//   v4: qkv in and q out in bf16, fp32 arithmetic, one rounding.
//   v5: the kernel reads each token's cos/sin row from the whole tables by its position,
//       instead of rows gathered on the host side's behalf (two gathers and two arrays
//       fewer per step).

#define MAX_PAIRS 4                      // (D / 2) / 32 pairs per lane for D <= 256

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

extern "C" __global__ void qk_norm_rope_store(const unsigned short* __restrict__ qkv,     // [N, (H+2Hkv)*D]
                                              const unsigned short* __restrict__ q_norm,  // [D]
                                              const unsigned short* __restrict__ k_norm,  // [D]
                                              const float* __restrict__ cos,              // [T_max, D/2]
                                              const float* __restrict__ sin,              // [T_max, D/2]
                                              const int* __restrict__ positions,          // [N]
                                              unsigned short* __restrict__ k_cache,       // [NB, P, Hkv, D]
                                              unsigned short* __restrict__ v_cache,       // [NB, P, Hkv, D]
                                              const int* __restrict__ slot_mapping,       // [N]
                                              unsigned short* __restrict__ q_out,         // [N, H, D]
                                              int H, int Hkv, int D, float eps, int has_norm)
{
    const int n = blockIdx.x, head = blockIdx.y, lane = threadIdx.x;
    const int half = D / 2;
    const bool is_q = head < H;                          // heads 0..H-1 are q, then the Hkv k heads
    const unsigned short* x = qkv + ((size_t)n * (H + 2 * Hkv) + head) * D;
    const unsigned short* w = is_q ? q_norm : k_norm;

    // this lane's pairs, in fp32 registers
    float x1[MAX_PAIRS], x2[MAX_PAIRS];
    float ss = 0.0f;
#pragma unroll
    for (int r = 0; r < MAX_PAIRS; r++) {
        const int i = lane + 32 * r;
        x1[r] = i < half ? bf16_to_f32(x[i]) : 0.0f;
        x2[r] = i < half ? bf16_to_f32(x[i + half]) : 0.0f;
        ss += x1[r] * x1[r] + x2[r] * x2[r];
    }
    // Qwen3: RMSNorm over the head's D values (a warp sum), before RoPE
    float inv_rms = 1.0f;
    if (has_norm) inv_rms = rsqrtf(warp_sum(ss) / (float)D + eps);

    const long long slot = is_q ? 0 : slot_mapping[n];
    if (slot < 0) return;                                // a padding token owns no slot
    unsigned short* dst = is_q ? q_out + ((size_t)n * H + head) * D
                               : k_cache + ((size_t)slot * Hkv + (head - H)) * D;
    const float* c = cos + (size_t)positions[n] * half;   // this token's angles
    const float* s = sin + (size_t)positions[n] * half;
#pragma unroll
    for (int r = 0; r < MAX_PAIRS; r++) {
        const int i = lane + 32 * r;
        if (i >= half) break;
        float a = x1[r], b = x2[r];
        if (has_norm) {
            a = a * inv_rms * bf16_to_f32(w[i]);
            b = b * inv_rms * bf16_to_f32(w[i + half]);
        }
        // rotate the pair (i, i + D/2) by this position's angle
        dst[i] = f32_to_bf16(a * c[i] - b * s[i]);
        dst[i + half] = f32_to_bf16(b * c[i] + a * s[i]);
    }
    if (!is_q) {
        // the matching v head goes to the same slot, untouched
        const unsigned short* v = qkv + ((size_t)n * (H + 2 * Hkv) + H + Hkv + (head - H)) * D;
        unsigned short* vd = v_cache + ((size_t)slot * Hkv + (head - H)) * D;
        for (int i = lane; i < D; i += 32) vd[i] = v[i];
    }
}
