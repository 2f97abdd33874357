// embedding.cu — gather one bf16 row of the embedding table per token.
//
// Computes:    out[n, :] = table[ids[n], :]          (the 16 bits of each value, copied)
// Numpy twin:  stage3_optimized/ops.py embedding()  (table[ids])
// Launch:      grid (N), block 128; each block copies one row. A row of C bf16 values is
//              moved as C/2 32-bit words when C is even (every Qwen3 / Llama width is),
//              else one value per thread.
// Shapes:      ids: [N] int32; table: [V, C] bf16 (uint16 bits); out: [N, C] bf16
//
// Version history
//   stage 2 v1: float32 rows, one value per thread.
//   v2 (stage 3): bf16 rows (half the bytes), two values per 32-bit load.

extern "C" __global__ void embedding(const int* __restrict__ ids,               // [N]
                                     const unsigned short* __restrict__ table,  // [V, C] bf16
                                     unsigned short* __restrict__ out,          // [N, C] bf16
                                     int C)
{
    const int n = blockIdx.x;
    const unsigned short* row = table + (size_t)ids[n] * C;
    unsigned short* dst = out + (size_t)n * C;
    if (C % 2 == 0) {
        // row starts at an even element, so 4-byte aligned: copy pairs as one word
        const unsigned* src2 = (const unsigned*)row;
        unsigned* dst2 = (unsigned*)dst;
        for (int c = threadIdx.x; c < C / 2; c += blockDim.x) dst2[c] = src2[c];
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) dst[c] = row[c];
    }
}
