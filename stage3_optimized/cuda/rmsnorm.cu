// rmsnorm.cu — the RMSNorm that opens each block, read from the fp32 residual stream.
//
// Computes:    h[n, :] = bf16(r / sqrt(mean(r^2) + eps) * w),   r = residual[n, :]
// Numpy twin:  stage3_optimized/ops.py rmsnorm_bf16()
// Launch:      grid (N), block 256; one block per row. Pass 1 sums the squares (warp
//              shuffles, then one value per warp in shared memory); pass 2 re-reads the
//              thread's own values (L1 hits) and writes h.
// Shapes:      residual: [N, C] float32; w: [C] bf16 (uint16 bits); h: [N, C] bf16
//
// The residual add is not here: each block's last GEMM adds its output into the fp32
// residual stream itself (cuBLAS with beta = 1, or gemv.cu's epilogue), so the stream is
// read once here and written once there. A small decode batch does not launch this
// kernel at all: gemv.cu recomputes it in front of the GEMM (prologue 1), with this
// kernel's loop and sum order, so the same bits come out.
//
// Version history
//   stage 2 v1: fp32 in and out, one block per row, a shared-memory tree sum of squares.
//   v2 (stage 3): the fp32 residual stream in, bf16 weights, bf16 out (the GEMM's input).
//   v3: a warp-shuffle sum, in an order gemv.cu's fused prologue repeats bit for bit.

#define BLOCK 256

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

extern "C" __global__ void rmsnorm(const float* __restrict__ residual,      // [N, C] fp32
                                   const unsigned short* __restrict__ w,    // [C] bf16
                                   unsigned short* __restrict__ h,          // [N, C] bf16
                                   int C, float eps)
{
    // exercise 3.4 begin
    __shared__ float warp_sums[BLOCK / 32];
    const float* r = residual + (size_t)blockIdx.x * C;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    // pass 1: the sum of squares of the row
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += BLOCK) ss += r[c] * r[c];
    ss = warp_sum(ss);
    if (lane == 0) warp_sums[warp] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < BLOCK / 32; i++) total += warp_sums[i];   // every thread, same order
    const float inv_rms = rsqrtf(total / (float)C + eps);

    // pass 2: normalise, scale by the learned weight, round once to bf16
    for (int c = threadIdx.x; c < C; c += BLOCK) {
        h[(size_t)blockIdx.x * C + c] = f32_to_bf16(r[c] * inv_rms * bf16_to_f32(w[c]));
    }
    // exercise 3.4 end
}
