// embedding.cu — gather one row of the embedding table per token.
//
// Computes:    out[n, :] = table[ids[n], :]
// Numpy twin:  stage2_batched/ops.py embedding()  (table[ids])
// Launch:      grid (N), block 256; each block copies one row, threads stride over C.
// Shapes:      ids: [N] int32; table: [V, C] float32; out: [N, C] float32
//
// Version history
//   v1: one block per token, a strided copy (the row is contiguous, so reads coalesce).

extern "C" __global__ void embedding(const int* __restrict__ ids,      // [N]
                                     const float* __restrict__ table,  // [V, C]
                                     float* __restrict__ out,          // [N, C]
                                     int C)
{
    const int n = blockIdx.x;
    const float* row = table + (size_t)ids[n] * C;
    float* dst = out + (size_t)n * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        dst[c] = row[c];
    }
}
