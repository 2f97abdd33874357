// sample.cu — choose each sequence's next token on the device: greedy, temperature, top-k, top-p.
//
// Computes:    for row s of logits [S, V] (l = logits[s], m = max l):
//                temperature[s] <= 0:  token = the first index of m (greedy)
//                otherwise:            w_i = exp((l_i - m) / temperature[s])
//                  top-k (0 < top_k[s] < V): keep l_i >= the top_k-th largest logit
//                  top-p (top_p[s] < 1):     keep the largest logits whose w sum to at least
//                                            top_p of the kept mass (the threshold's ties too)
//                  token = the first kept i whose running sum of kept w (in index order)
//                          exceeds u[s] * (sum of kept w)   (inverse CDF)
//              u [S] are uniform numbers in [0, 1) drawn on the host, so the kernel and its
//              twin see the same randomness and must choose the same token.
//              A degenerate row (a NaN or +inf logit, or every logit -inf: a broken model or
//              an overflow) has no distribution to draw from: its token is -1, which the
//              engine reports as an error on that request (never a token id to embed).
// Numpy twin:  stage3_optimized/ops.py sample()
// Launch:      grid (S), block 256: one block per row. The top-k and top-p thresholds are
//              found without sorting the vocabulary: a logit's float bits map to an unsigned
//              key in the same order, and the threshold is built bit by bit from the top
//              (32 block-wide counts for top-k, 32 block-wide sums for top-p). The draw gives
//              each thread a contiguous chunk of the row; a scan of the chunk sums tells the
//              thread that holds the target, which walks its chunk.
// Shapes:      logits: [S, V] float32; temperature, top_p, u: [S] float32; top_k: [S] int32;
//              tokens: [S] int32
//
// Saves: stage 2 copies a row of V = 151,936 logits (608 KB) to the host per sampled token;
// here 4 bytes come back.
//
// Version history
//   v1: threshold search on the keys, one block per row.
//   v2: degenerate rows give -1 (v1 gave V, out of range, for an all-NaN row); the owning
//       thread walks its chunk with the very sums that made `local`, so it always finds its
//       token (v1 restarted from chunk_start and could miss it by a few ulps, then fell back
//       to the last kept token of the whole row).

#define BLOCK 256
#define NEG_INF __int_as_float(0xff800000)
#define POS_INF __int_as_float(0x7f800000)

__device__ __forceinline__ unsigned order_key(float f)
{
    // float -> unsigned with the same order: flip all bits of negatives, the sign bit of positives
    const unsigned u = (unsigned)__float_as_int(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// block-wide reductions through shared memory (a fixed tree: the same order every time)
__device__ float block_sum(float v, float* sh)
{
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int stride = BLOCK / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) sh[threadIdx.x] += sh[threadIdx.x + stride];
        __syncthreads();
    }
    const float total = sh[0];
    __syncthreads();                                     // sh is reused by the next call
    return total;
}

__device__ float block_max(float v, float* sh)
{
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int stride = BLOCK / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + stride]);
        __syncthreads();
    }
    const float result = sh[0];
    __syncthreads();
    return result;
}

extern "C" __global__ void sample(const float* __restrict__ logits,       // [S, V]
                                  const float* __restrict__ temperature,  // [S]
                                  const int* __restrict__ top_k,          // [S]
                                  const float* __restrict__ top_p,        // [S]
                                  const float* __restrict__ u,            // [S] uniform in [0, 1)
                                  int* __restrict__ tokens,               // [S]
                                  int V)
{
    __shared__ float sh[BLOCK];
    __shared__ float chunk_start[BLOCK];
    __shared__ float kept_mass;
    __shared__ int chosen;
    const int s = blockIdx.x, t = threadIdx.x;
    const float* row = logits + (size_t)s * V;

    // the max, and whether the row is degenerate (a NaN or +inf anywhere: fmaxf skips NaN)
    float m = NEG_INF, bad = 0.0f;
    for (int i = t; i < V; i += BLOCK) {
        const float x = row[i];
        m = fmaxf(m, x);
        if (x != x || x == POS_INF) bad = 1.0f;
    }
    m = block_max(m, sh);
    bad = block_max(bad, sh);
    if (bad > 0.0f || m == NEG_INF) {                     // the same for every thread: uniform exit
        if (t == 0) tokens[s] = -1;
        return;
    }

    if (temperature[s] <= 0.0f) {
        // greedy: the first index holding the max (a min-reduction over indices, as floats:
        // exact for V < 2^24); m is one of the row's values, so some index holds it
        float first = (float)V;
        for (int i = t; i < V; i += BLOCK) if (row[i] == m) { first = (float)i; break; }
        first = -block_max(-first, sh);
        if (t == 0) tokens[s] = min((int)first, V - 1);
        return;
    }
    const float inv_t = 1.0f / temperature[s];

    // top-k: the largest key t_k with at least k logits >= it, built from the top bit down
    unsigned threshold = 0;
    const int k = top_k[s];
    if (k > 0 && k < V) {
        for (int bit = 31; bit >= 0; bit--) {
            const unsigned cand = threshold | (1u << bit);
            float count = 0.0f;
            for (int i = t; i < V; i += BLOCK) count += order_key(row[i]) >= cand ? 1.0f : 0.0f;
            if (block_sum(count, sh) >= (float)k) threshold = cand;
        }
    }

    // top-p: the largest key (>= the top-k one) whose logits above it hold >= p of the kept mass
    const float p = top_p[s];
    if (p < 1.0f) {
        float mass = 0.0f;
        for (int i = t; i < V; i += BLOCK)
            if (order_key(row[i]) >= threshold) mass += expf((row[i] - m) * inv_t);
        const float need = p * block_sum(mass, sh);
        unsigned tp = 0;                                 // the mass above a key only falls as it rises
        for (int bit = 31; bit >= 0; bit--) {
            const unsigned cand = max(tp | (1u << bit), threshold);
            float part = 0.0f;
            for (int i = t; i < V; i += BLOCK)
                if (order_key(row[i]) >= cand) part += expf((row[i] - m) * inv_t);
            if (block_sum(part, sh) >= need) tp = tp | (1u << bit);
        }
        threshold = max(tp, threshold);
    }

    // the draw: thread t owns the contiguous chunk [t * chunk, (t + 1) * chunk)
    const int chunk = (V + BLOCK - 1) / BLOCK;
    const int lo = min(V, t * chunk), hi = min(V, lo + chunk);
    float local = 0.0f;
    int last_kept = -1;
    for (int i = lo; i < hi; i++) {
        if (order_key(row[i]) >= threshold) { local += expf((row[i] - m) * inv_t); last_kept = i; }
    }
    chunk_start[t] = local;
    if (t == 0) chosen = -1;
    __syncthreads();
    if (t == 0) {                                        // exclusive scan of the BLOCK chunk sums
        float run = 0.0f;
        for (int j = 0; j < BLOCK; j++) { const float c = chunk_start[j]; chunk_start[j] = run; run += c; }
        kept_mass = run;
    }
    __syncthreads();
    const float target = u[s] * kept_mass;
    // the scan made chunk_start[t + 1] = chunk_start[t] + local, so the chunks tile
    // [0, kept_mass) exactly and one thread owns any target below kept_mass
    if (chunk_start[t] <= target && target < chunk_start[t] + local) {
        // the walk repeats local's sums in local's order: at the chunk's last kept token,
        // chunk_start[t] + run is chunk_start[t] + local > target, so the walk stops in the chunk
        float run = 0.0f;
        for (int i = lo; i < hi; i++) {
            if (order_key(row[i]) < threshold) continue;
            run += expf((row[i] - m) * inv_t);
            if (chunk_start[t] + run > target) { chosen = i; break; }
        }
    }
    // the last kept token, for a target that rounding put at or past kept_mass (u close to 1)
    const float last = block_max((float)last_kept, sh);
    __syncthreads();
    if (t == 0) tokens[s] = chosen >= 0 ? chosen : max((int)last, 0);
}
