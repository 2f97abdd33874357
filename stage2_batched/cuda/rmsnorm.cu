// rmsnorm.cu — RMSNorm over the last axis of a batch of rows.
//
// Computes:    out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w
// Numpy twin:  stage2_batched/ops.py rmsnorm()
// Launch:      grid (R), block 256; one block per row, a shared-memory tree sum of squares.
// Shapes:      x: [R, C] float32; w: [C]; out: [R, C]
//   The residual stream is R = N tokens of C = hidden size. Qwen3's per-head q/k norm is
//   the same kernel: q [N, H, D] viewed as R = N*H rows of C = D, w [D].
//
// Version history
//   v1: one block per row; two passes over the row (sum of squares, then scale).

#define BLOCK 256

extern "C" __global__ void rmsnorm(const float* __restrict__ x,   // [R, C]
                                   const float* __restrict__ w,   // [C]
                                   float* __restrict__ out,       // [R, C]
                                   int C, float eps)
{
    __shared__ float partial[BLOCK];
    const size_t r = blockIdx.x;
    const float* row = x + r * C;

    // pass 1: each thread sums the squares of its strided elements ...
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += BLOCK) {
        ss += row[c] * row[c];
    }
    partial[threadIdx.x] = ss;
    __syncthreads();
    // ... and a tree reduction in shared memory adds the BLOCK partial sums
    for (int stride = BLOCK / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
        __syncthreads();
    }
    const float inv_rms = rsqrtf(partial[0] / (float)C + eps);

    // pass 2: scale the row and multiply by the learned weight
    for (int c = threadIdx.x; c < C; c += BLOCK) {
        out[r * C + c] = row[c] * inv_rms * w[c];
    }
}
