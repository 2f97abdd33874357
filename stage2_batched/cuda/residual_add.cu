// residual_add.cu — the residual connection, out = x + y, elementwise.
//
// Computes:    out[i] = x[i] + y[i]
// Numpy twin:  stage2_batched/ops.py residual_add()
// Launch:      grid (ceil(n / 256)), block 256; one thread per element.
// Shapes:      x, y, out: [N, C] float32 (flattened to n = N * C)
//
// Version history
//   v1: one thread per element (stage 3 fuses it into RMSNorm).

extern "C" __global__ void residual_add(const float* __restrict__ x,   // [N, C]
                                        const float* __restrict__ y,   // [N, C]
                                        float* __restrict__ out,       // [N, C]
                                        long long n)
{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = x[i] + y[i];
}
