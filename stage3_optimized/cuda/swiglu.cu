// swiglu.cu — SwiGLU's gate on the output of the fused gate/up GEMM.
//
// Computes:    out[n, f] = bf16(silu(g) * u),  g = gate_up[n, f], u = gate_up[n, F + f],
//              silu(g) = g / (1 + exp(-g))
// Numpy twin:  stage3_optimized/ops.py swiglu()
// Launch:      grid (ceil(F / 256), min(N, 65535)), block 256; one thread per output value
//              of a row, the rows strided by gridDim.y (grid.y is at most 65,535: a long
//              prefill batch has more tokens).
// Shapes:      gate_up: [N, 2F] bf16 (gate in columns 0..F-1, up in F..2F-1); out: [N, F] bf16
//
// Version history
//   stage 2 silu_mul.cu: fp32, gate and up from two GEMMs (two arrays).
//   v1 (stage 3): the two halves of one row of the fused GEMM, fp32; rows strided over grid.y,
//       so N > 65,535 launches.
//   v2: the output in bf16 (the next GEMM's input), rounded once.
//   v3: the input in bf16 too.

__device__ __forceinline__ float bf16_to_f32(unsigned short b) { return __int_as_float((int)(((unsigned)b) << 16)); }
__device__ __forceinline__ unsigned short f32_to_bf16(float f)
{
    const unsigned u = (unsigned)__float_as_int(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)     // NaN -> a quiet bf16 NaN (rounding the GPU's NaN,
        return (unsigned short)(((u >> 16) & 0x8000u) | 0x7FC0u);   // 0x7FFFFFFF, carries into -0)
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);   // round to nearest even
}

extern "C" __global__ void swiglu(const unsigned short* __restrict__ gate_up,  // [N, 2F] bf16
                                  unsigned short* __restrict__ out,            // [N, F] bf16
                                  int N, int F)
{
    const int f = blockIdx.x * blockDim.x + threadIdx.x;
    if (f >= F) return;
    for (size_t n = blockIdx.y; n < (size_t)N; n += gridDim.y) {
        const float g = bf16_to_f32(gate_up[n * 2 * F + f]);
        const float u = bf16_to_f32(gate_up[n * 2 * F + F + f]);
        out[n * F + f] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
    }
}
