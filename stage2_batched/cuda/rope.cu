// rope.cu — rotary position embedding, rotate-half layout (the Hugging Face one).
//
// Computes:    for each token n, head h, pair i < D/2:
//                out[n,h,i]     = x[n,h,i]     * cos[n,i] - x[n,h,i+D/2] * sin[n,i]
//                out[n,h,i+D/2] = x[n,h,i+D/2] * cos[n,i] + x[n,h,i]     * sin[n,i]
//              cos, sin hold one row per token: the host gathers the table rows at each
//              token's own position (a decode token at 900 next to a prefill chunk at
//              0..63 in the same packed batch).
// Numpy twin:  stage2_batched/ops.py rope()
// Launch:      grid (N), block 128; threads stride over the H * D/2 pairs of one token.
// Shapes:      x, out: [N, H, D] float32; cos, sin: [N, D/2]
//
// Version history
//   v1: one block per token, cos/sin read from global memory.

extern "C" __global__ void rope(const float* __restrict__ x,    // [N, H, D]
                                float* __restrict__ out,        // [N, H, D]
                                const float* __restrict__ cos,  // [N, D/2]
                                const float* __restrict__ sin,  // [N, D/2]
                                int H, int D)
{
    const int n = blockIdx.x;
    const int half = D / 2;
    const float* c = cos + (size_t)n * half;
    const float* s = sin + (size_t)n * half;
    const size_t base = (size_t)n * H * D;
    for (int j = threadIdx.x; j < H * half; j += blockDim.x) {
        const int h = j / half, i = j % half;
        const size_t at = base + (size_t)h * D + i;
        const float x1 = x[at], x2 = x[at + half];
        out[at] = x1 * c[i] - x2 * s[i];
        out[at + half] = x2 * c[i] + x1 * s[i];
    }
}
