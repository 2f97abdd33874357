// store_kvcache.cu — write the new tokens' keys and values into the paged KV cache.
//
// Computes:    for each token n with slot = slot_mapping[n] >= 0:
//                k_cache[slot / P, slot % P, :, :] = k[n]   (the same for v)
//              The slot is page * P + offset, precomputed on the host from the
//              sequence's block table, so this kernel knows nothing about sequences.
// Numpy twin:  stage2_batched/ops.py store_kvcache()
// Launch:      grid (N), block 128; threads stride over the Hkv * D values of one token.
// Shapes:      k, v: [N, Hkv, D] float32; k_cache, v_cache: [NB, P, Hkv, D]
//              (one layer of the [L, NB, P, Hkv, D] pool, i.e. [NB * P] slots of Hkv*D);
//              slot_mapping: [N] int32 (-1 = skip)
//
// Version history
//   v1: one block per token, strided copy of K and V.

extern "C" __global__ void store_kvcache(const float* __restrict__ k,          // [N, Hkv, D]
                                         const float* __restrict__ v,          // [N, Hkv, D]
                                         float* __restrict__ k_cache,          // [NB, P, Hkv, D]
                                         float* __restrict__ v_cache,          // [NB, P, Hkv, D]
                                         const int* __restrict__ slot_mapping, // [N]
                                         int HkvD)
{
    // exercise 2.1 begin
    const int n = blockIdx.x;
    const long long slot = slot_mapping[n];
    if (slot < 0) return;                      // a padding token owns no slot
    const float* ks = k + (size_t)n * HkvD;
    const float* vs = v + (size_t)n * HkvD;
    float* kd = k_cache + (size_t)slot * HkvD;
    float* vd = v_cache + (size_t)slot * HkvD;
    for (int j = threadIdx.x; j < HkvD; j += blockDim.x) {
        kd[j] = ks[j];
        vd[j] = vs[j];
    }
    // exercise 2.1 end
}
