// gemv.cu — a small decode batch's projection, with the step before it and the step after it
// fused in: one launch where the plain path takes two or three.
//
// Computes:    out[n, m] = sum_k in[n, k] * w[m, k]   for N <= 4 rows (a decode batch), fp32 sums
//              the input, by `prologue`:
//                0  in = x                               x: [N, K] bf16
//                1  in = bf16(r / sqrt(mean(r^2) + eps) * norm_w), r = norm_in[n, :]
//                                                        norm_in: [N, K] fp32 (the residual stream)
//                2  in = bf16(silu(g) * u), g = x[n, k], u = x[n, K + k]
//                                                        x: [N, 2K] bf16 (the gate/up GEMM's output)
//              the output, by `epilogue`:
//                0  out_bf16[n, m] = bf16(sum (+ bias[m]))         (bias: Qwen2's q/k/v, fp32)
//                1  out_f32[n, m]  = sum                           (the logits)
//                2  out_f32[n, m] += sum                           (into the residual stream)
// Numpy twins: stage3_optimized/ops.py linear(), rmsnorm_linear(), linear_add(), swiglu_linear_add()
//              (prologue 1 rounds `in` exactly as rmsnorm.cu does, prologue 2 as swiglu.cu: the
//              same bits go into the sums as on the unfused path)
// Launch:      grid (min(ceil(M / 8), MAX_BLOCKS)), block 256 (8 warps); dynamic shared memory
//              N * K * 2 bytes: the block's copy of the input rows, bf16. Each block first builds
//              that copy (the prologue), then each warp takes rows m = block * 8 + warp, striding
//              by the grid: its lanes read the weight row in 16-byte pieces (8 bf16), UNROLL
//              pieces in flight per lane, multiply them with every input row, and sum across
//              the warp with shuffles; lane 0 writes the N outputs of row m.
//              Requires K % 8 == 0 (16-byte rows) and N <= 4; kernels.py checks both, and raises the
//              kernel's max_dynamic_shared_size_bytes to 48 KB (its 32 static bytes would leave 48 KB - 32).
// Shapes:      w: [M, K] bf16 (uint16 bits, Hugging Face's [out, in]); norm_w: [K] bf16;
//              bias: [M] fp32; out_bf16: [N, M] bf16; out_f32: [N, M] fp32
//
// Why: at a decode batch of 1-4 rows a projection reads M * K * 2 bytes of weights and does
// 2 * N * M * K FLOPs, so it is a memory-bound matrix-vector product: cuBLAS's GEMM gains
// nothing from its tiles here, and every launch costs the host several microseconds. Fusing
// the RMSNorm in front (the block recomputes it from the fp32 residual: a few KB from L2)
// and the residual add behind (each output is written by one warp, so `+=` races with
// nothing) removes a kernel and a round trip through memory on each side.
//
// Version history
//   v1: bf16 weights, fp32 sums, RMSNorm / SwiGLU prologues, bias / fp32 / residual-add epilogues.

#define BLOCK 256
#define WARPS (BLOCK / 32)
#define MAX_N 4
#define UNROLL 4                          // 16-byte weight loads in flight per lane

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

// the 8 products of two 16-byte pieces (8 bf16 each: element 2i in the low half of word i)
__device__ __forceinline__ float dot8(uint4 a, uint4 b)
{
    float s = 0.0f;
    const unsigned av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        s += __int_as_float((int)(av[i] << 16)) * __int_as_float((int)(bv[i] << 16));
        s += __int_as_float((int)(av[i] & 0xffff0000u)) * __int_as_float((int)(bv[i] & 0xffff0000u));
    }
    return s;
}

extern "C" __global__ void gemv(const unsigned short* __restrict__ x,        // [N, K] or [N, 2K] bf16
                                const float* __restrict__ norm_in,           // [N, K] fp32 (prologue 1)
                                const unsigned short* __restrict__ norm_w,   // [K] bf16 (prologue 1)
                                const unsigned short* __restrict__ w,         // [M, K] bf16
                                const float* __restrict__ bias,              // [M] fp32 (has_bias)
                                unsigned short* __restrict__ out_bf16,       // [N, M] (epilogue 0)
                                float* __restrict__ out_f32,                 // [N, M] (epilogues 1, 2)
                                int N, int M, int K, float eps, int prologue, int epilogue, int has_bias)
{
    extern __shared__ __align__(16) unsigned short xs[];   // [N, K] bf16: this block's input rows (read as uint4)
    __shared__ float warp_sums[WARPS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

    // ---- prologue: the input rows, rounded to bf16 as the unfused kernel would store them ----
    for (int n = 0; n < N; n++) {
        unsigned short* dst = xs + (size_t)n * K;
        if (prologue == 1) {
            // RMSNorm of the fp32 residual row: rmsnorm.cu's loop and sum order, so the same bits
            const float* r = norm_in + (size_t)n * K;
            float ss = 0.0f;
            for (int c = threadIdx.x; c < K; c += BLOCK) ss += r[c] * r[c];
            ss = warp_sum(ss);
            if (lane == 0) warp_sums[warp] = ss;
            __syncthreads();
            float total = 0.0f;
            for (int i = 0; i < WARPS; i++) total += warp_sums[i];   // every thread, same order
            const float inv_rms = rsqrtf(total / (float)K + eps);
            for (int c = threadIdx.x; c < K; c += BLOCK) dst[c] = f32_to_bf16(r[c] * inv_rms * bf16_to_f32(norm_w[c]));
            __syncthreads();                               // warp_sums is reused by the next row
        } else if (prologue == 2) {
            // SwiGLU of the gate/up row: swiglu.cu's expression
            const unsigned short* gu = x + (size_t)n * 2 * K;
            for (int c = threadIdx.x; c < K; c += BLOCK) {
                const float g = bf16_to_f32(gu[c]), u = bf16_to_f32(gu[K + c]);
                dst[c] = f32_to_bf16(g / (1.0f + expf(-g)) * u);
            }
        } else {
            const uint4* src = (const uint4*)(x + (size_t)n * K);
            for (int c = threadIdx.x; c < K / 8; c += BLOCK) ((uint4*)dst)[c] = src[c];
        }
    }
    __syncthreads();

    // ---- one weight row per warp at a time: 16-byte pieces, UNROLL in flight per lane ----
    const int K8 = K / 8;
    const uint4* xs8 = (const uint4*)xs;
    for (int m = blockIdx.x * WARPS + warp; m < M; m += gridDim.x * WARPS) {
        const uint4* row = (const uint4*)(w + (size_t)m * K);
        float acc[MAX_N] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int base = lane; base < K8; base += 32 * UNROLL) {
            uint4 piece[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {             // issue every load before the first use
                const int k8 = base + 32 * u;
                piece[u] = k8 < K8 ? __ldg(row + k8) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                const int k8 = base + 32 * u;
                if (k8 >= K8) break;
#pragma unroll
                for (int n = 0; n < MAX_N; n++)
                    if (n < N) acc[n] += dot8(piece[u], xs8[n * K8 + k8]);
            }
        }
#pragma unroll
        for (int n = 0; n < MAX_N; n++) {
            if (n >= N) break;
            const float sum = warp_sum(acc[n]);
            if (lane != 0) continue;
            const size_t at = (size_t)n * M + m;
            if (epilogue == 0) out_bf16[at] = f32_to_bf16(has_bias ? sum + bias[m] : sum);
            else if (epilogue == 1) out_f32[at] = sum;
            else out_f32[at] += sum;                       // this warp alone owns (n, m)
        }
    }
}
