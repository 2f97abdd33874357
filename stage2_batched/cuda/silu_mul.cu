// silu_mul.cu — SwiGLU's gate: silu(gate) * up, elementwise.
//
// Computes:    out[i] = gate[i] / (1 + exp(-gate[i])) * up[i]
// Numpy twin:  stage2_batched/ops.py silu_mul()
// Launch:      grid (ceil(n / 256)), block 256; one thread per element.
// Shapes:      gate, up, out: [N, F] float32 (flattened to n = N * F)
//
// Version history
//   v1: one thread per element.

extern "C" __global__ void silu_mul(const float* __restrict__ gate,   // [N, F]
                                    const float* __restrict__ up,     // [N, F]
                                    float* __restrict__ out,          // [N, F]
                                    long long n)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = gate[i];
    out[i] = g / (1.0f + expf(-g)) * up[i];
}
