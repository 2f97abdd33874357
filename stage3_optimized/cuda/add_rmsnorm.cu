// add_rmsnorm.cu — the residual add and the RMSNorm that opens each block, in one pass.
//
// Computes:    r = residual[n, :] + x[n, :]     (r = x[n, :] when has_residual = 0: the first block)
//              residual[n, :] = r               (fp32, in place)
//              h[n, :] = bf16(r / sqrt(mean(r^2) + eps) * w)
// Numpy twin:  stage3_optimized/ops.py add_rmsnorm()
// Launch:      grid (N), block 256; one block per row. Pass 1 adds, stores the new
//              residual and sums its squares (warp shuffles, then one value per warp in
//              shared memory); pass 2 re-reads the thread's own residual values (L1 hits:
//              the same thread wrote them) and writes h.
// Shapes:      x: [N, C] bf16 (uint16 bits); residual: [N, C] float32; w: [C] bf16; h: [N, C] bf16
//
// Bytes: stage 2 ran residual_add (read 2, write 1 fp32 row) and rmsnorm (read 1, write 1):
// 5 * 4C bytes per token. This reads x (2C) and the residual (4C), writes both (4C + 2C).
//
// Version history
//   stage 2: residual_add.cu + rmsnorm.cu, fp32, a shared-memory tree reduction.
//   v1 (stage 3): fused, bf16 input/output, fp32 residual, warp-shuffle reduction.

#define BLOCK 256

__device__ __forceinline__ float bf16_to_f32(unsigned short b) { return __int_as_float((int)(((unsigned)b) << 16)); }
__device__ __forceinline__ unsigned short f32_to_bf16(float f)
{
    const unsigned u = (unsigned)__float_as_int(f);                      // round to nearest even
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float warp_sum(float x)
{
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;   // every lane holds the total
}

extern "C" __global__ void add_rmsnorm(const unsigned short* __restrict__ x,  // [N, C] bf16
                                       float* residual,                       // [N, C] fp32, in place
                                       const unsigned short* __restrict__ w,  // [C] bf16
                                       unsigned short* __restrict__ h,        // [N, C] bf16
                                       int C, float eps, int has_residual)
{
    // exercise 3.4 begin
    __shared__ float warp_sums[BLOCK / 32];
    const size_t base = (size_t)blockIdx.x * C;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    // pass 1: the new residual, and the sum of its squares
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += BLOCK) {
        const float r = (has_residual ? residual[base + c] : 0.0f) + bf16_to_f32(x[base + c]);
        residual[base + c] = r;
        ss += r * r;
    }
    ss = warp_sum(ss);
    if (lane == 0) warp_sums[warp] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < BLOCK / 32; i++) total += warp_sums[i];   // every thread, same order
    const float inv_rms = rsqrtf(total / (float)C + eps);

    // pass 2: normalise, scale by the learned weight, round once to bf16
    for (int c = threadIdx.x; c < C; c += BLOCK) {
        h[base + c] = f32_to_bf16(residual[base + c] * inv_rms * bf16_to_f32(w[c]));
    }
    // exercise 3.4 end
}
