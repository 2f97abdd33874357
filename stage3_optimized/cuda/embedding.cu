// embedding.cu — the residual stream starts as one embedding row per token.
//
// Computes:    residual[n, :] = float(table[ids[n], :])    (bf16 -> fp32: exact)
// Numpy twin:  stage3_optimized/ops.py embedding()
// Launch:      grid (N), block 128; each block copies one row. A row of C bf16 values is
//              read as C/2 32-bit words when C is even (every Qwen3 / Llama width is),
//              else one value per thread.
// Shapes:      ids: [N] int32; table: [V, C] bf16 (uint16 bits); residual: [N, C] float32
//
// Version history
//   stage 2 v1: float32 rows, one value per thread.
//   v2 (stage 3): bf16 rows (half the bytes), two values per 32-bit load, written as fp32
//       straight into the residual stream, which stays fp32 (the first RMSNorm reads it).

__device__ __forceinline__ float bf16_to_f32(unsigned short b) { return __int_as_float((int)(((unsigned)b) << 16)); }

extern "C" __global__ void embedding(const int* __restrict__ ids,               // [N]
                                     const unsigned short* __restrict__ table,  // [V, C] bf16
                                     float* __restrict__ residual,              // [N, C] fp32
                                     int C)
{
    const int n = blockIdx.x;
    const unsigned short* row = table + (size_t)ids[n] * C;
    float* dst = residual + (size_t)n * C;
    if (C % 2 == 0) {
        // the row starts at an even element, so 4-byte aligned: read pairs as one word
        const unsigned* src2 = (const unsigned*)row;
        for (int c = threadIdx.x; c < C / 2; c += blockDim.x) {
            const unsigned pair = src2[c];                 // element 2c in the low half
            dst[2 * c] = __int_as_float((int)(pair << 16));
            dst[2 * c + 1] = __int_as_float((int)(pair & 0xffff0000u));
        }
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) dst[c] = bf16_to_f32(row[c]);
    }
}
