"""The numpy twins of the CUDA kernels: what each kernel in stage3_optimized/cuda/ computes.

Changed from stage 2, lesson by lesson (docs/lessons/stage3):
  * qk_norm_rope_store: q/k RMSNorm, RoPE and the KV store of a token in one pass over the
    fused QKV GEMM's output. `rmsnorm`, `rope` and `store_kvcache` stay as the plain
    definitions it is tested against.
  * swiglu: silu_mul on the two halves of the fused gate/up GEMM's output.
  * The KV pages are bf16, held as their 16 bits in uint16 arrays (`bf16_bits`, `f32`): half
    the bytes of stage 2's fp32.
  * The weights are bf16 too, and `linear` is the GEMM's twin: bf16 inputs, fp32 products
    and sums. Each twin widens its bf16 inputs, computes in fp32 and rounds what it stores
    in bf16 once (round to nearest even), as the kernels do. The residual stream stays fp32
    (`embedding` writes fp32 rows).
  * `rmsnorm_bf16`: the norm in front of a GEMM rounds its output to bf16; the norm weights
    are bf16.
  * Attention and `swiglu` round their outputs to bf16 too (a GEMM's input).
  * Every activation between kernels is bf16 (`linear` rounds its output too).
  * decode_attention_splits and merge_attention: flash-decoding's two parts.
  * sample: greedy, temperature, top-k and top-p from one uniform number per row;
    degenerate_rows, which it answers with -1.
  * rmsnorm_linear: a block's first GEMM with its RMSNorm in front (gemv.cu's prologue).

stage3_optimized/kernels.py launches the CUDA kernel for cupy arrays and calls the twin
here for numpy arrays (device="cpu").
"""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

BF16 = np.uint16        # the storage type of a bf16 array: its 16 bits


def bf16_bits(x) -> np.ndarray:
    """float32 -> bf16 bits [same shape] uint16, rounded to nearest even (ml_dtypes)."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).view(BF16)


def f32(bits) -> np.ndarray:
    """bf16 bits uint16 -> float32 (exact: bf16 is the top half of a float32)."""
    bits = np.asarray(bits)
    assert bits.dtype == BF16, f"expected bf16 bits (uint16), got {bits.dtype}"
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_bf16(x) -> np.ndarray:
    """float32 -> the nearest bf16 value, as float32 (what a bf16 store keeps)."""
    return f32(bf16_bits(x))


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """ids [N] -> rows of table [V, C] bf16, widened -> [N, C] float32:
    the residual stream's start."""
    return f32(table[ids])


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., C], w [C] bf16 -> [..., C]: x / rms(x) * w over the last axis.
    Used on the residual stream ([T, C]) and on each q/k head ([T, H, D], w [D])."""
    var = np.mean(x * x, axis=-1, keepdims=True)          # [..., 1]
    return (x / np.sqrt(var + np.float32(eps))).astype(np.float32) * f32(w)


def rmsnorm_bf16(residual: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The RMSNorm that opens each block (rmsnorm.cu): residual [N, C] float32, w [C] bf16
    -> h [N, C] bf16, the input of the GEMM that follows (rounded once)."""
    return bf16_bits(rmsnorm(residual, w, eps))


def rope_tables(max_pos: int, head_dim: int,
                theta: float, scaling=None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_pos, D/2]: the rotation angle of pair i at position p is p * theta^(-2i/D).
    scaling (config.RopeScaling, Llama 3's) changes the frequencies, see llama3_inv_freq.
    Computed once per model; positions index rows."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # [D/2]
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    # transformers forms the angles in float32; doing the same keeps long positions bit-close
    angles = np.arange(max_pos, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def llama3_inv_freq(inv_freq: np.ndarray, scaling) -> np.ndarray:
    """Llama 3's RoPE scaling: inv_freq [D/2] -> [D/2]. A pair whose wavelength 2 pi / f is
    longer than the pretraining context / low_freq_factor never turned a full circle in
    pretraining: slow it down by `factor` so longer contexts stay within the angles it saw.
    A wavelength shorter than the context / high_freq_factor is kept (it turned many times,
    local order depends on it). Between the two, blend: s = 0 at the long end, 1 at the
    short end, f' = (1 - s) f / factor + s f."""
    L, lo, hi, factor = (scaling.original_max_position_embeddings, scaling.low_freq_factor,
                         scaling.high_freq_factor, scaling.factor)
    wavelen = 2 * np.pi / inv_freq                         # [D/2] positions per full turn
    # [D/2] blend weight, in [0, 1] in the band
    s = (L / wavelen - lo) / (hi - lo)
    blended = (1 - s) * inv_freq / factor + s * inv_freq
    return np.where(wavelen > L / lo, inv_freq / factor,   # long wavelengths: slowed by factor
                    np.where(wavelen < L / hi, inv_freq, blended))   # short ones: kept


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, H, D], cos/sin [T, D/2] -> [T, H, D].
    Rotate-half RoPE (the HF layout): dimension i pairs with i + D/2, not with i + 1."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]                  # [T, H, D/2] each
    c, s = cos[:, None, :], sin[:, None, :]                # [T, 1, D/2] broadcast over heads
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def store_kvcache(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                  slot_mapping: np.ndarray) -> None:
    """Write k, v [N, Hkv, D] into the pages k_cache, v_cache [NB, P, Hkv, D], in place.
    Token n goes to slot slot_mapping[n] = page * P + offset; slot -1 is skipped."""
    NB, P, Hkv, D = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.reshape(NB * P, Hkv, D)[slots] = k[keep]       # [NB*P, Hkv, D] view of the pool
    v_cache.reshape(NB * P, Hkv, D)[slots] = v[keep]


@dataclass
class LayerHeads:
    """What one layer's qk_norm_rope_store needs besides its qkv rows: fixed for the model's
    life, so model.py builds one per layer and passes it whole."""
    q_norm: object | None      # [D] bf16, Qwen3's per-head norms (None: no q/k norm)
    k_norm: object | None      # [D] bf16
    cos: object                # [T_max, D/2] float32, the model's RoPE tables: a row per position
    sin: object
    k_cache: object            # [NB, P, Hkv, D] bf16: this layer's pages
    v_cache: object
    H: int                     # query heads
    Hkv: int                   # kv heads
    eps: float


def qk_norm_rope_store(qkv: np.ndarray, heads: LayerHeads, positions: np.ndarray,
                       slot_mapping: np.ndarray) -> np.ndarray:
    """Everything between the fused QKV GEMM and attention, in one pass per token:
        q, k, v = split(qkv)                       [N, H, D], [N, Hkv, D], [N, Hkv, D]
        q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm   (per head; qwen3 only: norms None skip it)
        q, k = rope(q), rope(k)                    (each token at its own position's cos/sin row)
        k, v -> their slots in the bf16 page pool  (in place)
    qkv [N, (H + 2 Hkv) * D] bf16, positions [N], slot_mapping [N] -> q [N, H, D] bf16.
    Stage 2 runs rmsnorm, rmsnorm, rope, rope and store: five kernels and five round
    trips of q/k through memory."""
    H, Hkv, eps = heads.H, heads.Hkv, heads.eps
    N = qkv.shape[0]
    D = qkv.shape[1] // (H + 2 * Hkv)
    x = f32(qkv).reshape(N, H + 2 * Hkv, D)
    q, k, v = x[:, :H], x[:, H:H + Hkv], x[:, H + Hkv:]
    if heads.q_norm is not None:
        q, k = rmsnorm(q, heads.q_norm, eps), rmsnorm(k, heads.k_norm, eps)
    c, s = heads.cos[positions], heads.sin[positions]      # [N, D/2] each token's angles
    q, k = rope(q, c, s), rope(k, c, s)
    store_kvcache(bf16_bits(k), bf16_bits(v), heads.k_cache, heads.v_cache, slot_mapping)
    return bf16_bits(q)


def _gather_pages(cache: np.ndarray, table: np.ndarray, length: int) -> np.ndarray:
    """Positions 0..length-1 of one sequence, out of the pages its block table lists.
    cache [NB, P, Hkv, D], table [max_blocks] -> [Hkv, length, D] (stage 1's cache layout)."""
    P = cache.shape[1]
    pages = table[:(length + P - 1) // P]                  # the pages that hold those positions
    rows = cache[pages].reshape(-1, *cache.shape[2:])[:length]   # [length, Hkv, D]
    return rows.transpose(1, 0, 2)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Stage 1's causal GQA attention, with explicit positions: q [T, H, D] at positions [T];
    k, v [Hkv, end, D]; query t sees cache positions 0..positions[t]. -> [T, H, D]"""
    T, H, D = q.shape
    Hkv, end = k.shape[0], k.shape[1]
    group = H // Hkv                                       # query heads sharing one kv head
    qg = q.reshape(T, Hkv, group, D).transpose(1, 2, 0, 3)  # [Hkv, group, T, D]
    scores = qg @ k[:, None].transpose(0, 1, 3, 2) / np.float32(np.sqrt(D))  # [Hkv, group, T, end]
    # causal mask: query t may not see positions after its own
    future = np.arange(end)[None, :] > positions[:, None]  # [T, end]
    scores = np.where(future, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v[:, None]                                   # [Hkv, group, T, D]
    return out.transpose(2, 0, 1, 3).reshape(T, H, D).astype(np.float32)


def paged_decode_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                           block_tables: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
    """One new query per sequence over its paged context.
    q [S, H, D] bf16; k_cache, v_cache [NB, P, Hkv, D] bf16; block_tables [S, max_blocks];
    context_lens [S] (the query is the newest position, context_lens[s] - 1). -> [S, H, D] bf16"""
    out = np.empty(q.shape, np.float32)
    for s in range(q.shape[0]):
        n = int(context_lens[s])
        k = f32(_gather_pages(k_cache, block_tables[s], n))     # [Hkv, n, D]
        v = f32(_gather_pages(v_cache, block_tables[s], n))
        out[s:s + 1] = _attend(f32(q[s:s + 1]), k, v, np.array([n - 1]))
    return bf16_bits(out)


def decode_attention_splits(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                            block_tables: np.ndarray, context_lens: np.ndarray,
                            split_len: int, splits: int) -> tuple[np.ndarray, np.ndarray]:
    """Flash-decoding, part 1: each sequence's context cut into pieces of split_len positions;
    per query head and piece j, the unnormalised softmax of that piece alone:
        m = max score, l = sum exp(score - m), acc = sum exp(score - m) * v
    q [S, H, D] bf16, pages bf16 -> part_out [S, H, splits, D] float32, part_ml [S, H, splits, 2]
    ((m, l); a piece past the context has m = -inf, l = 0, acc = 0)."""
    S, H, D = q.shape
    Hkv = k_cache.shape[2]
    part_out = np.zeros((S, H, splits, D), np.float32)
    part_ml = np.zeros((S, H, splits, 2), np.float32)
    part_ml[..., 0] = -np.inf
    for s in range(S):
        n = int(context_lens[s])
        k = f32(_gather_pages(k_cache, block_tables[s], n))     # [Hkv, n, D]
        v = f32(_gather_pages(v_cache, block_tables[s], n))
        qs = f32(q[s]) * np.float32(1 / np.sqrt(D))            # [H, D]
        # [H, n, D] kv head of each query head
        kh = np.repeat(k, H // Hkv, axis=0)
        vh = np.repeat(v, H // Hkv, axis=0)
        for j in range(min(splits, (n + split_len - 1) // split_len)):
            a, b = j * split_len, min(n, (j + 1) * split_len)
            score = np.einsum("hd,htd->ht", qs, kh[:, a:b])     # [H, b - a]
            m = score.max(axis=-1)                             # [H]
            p = np.exp(score - m[:, None])
            part_ml[s, :, j, 0], part_ml[s, :, j, 1] = m, p.sum(axis=-1)
            part_out[s, :, j] = np.einsum("ht,htd->hd", p, vh[:, a:b])
    return part_out, part_ml


def merge_attention(part_out: np.ndarray, part_ml: np.ndarray) -> np.ndarray:
    """Flash-decoding, part 2: rescale each piece to the common max M and normalise once:
        out = sum_j acc_j exp(m_j - M) / sum_j l_j exp(m_j - M)
    part_out [S, H, splits, D], part_ml [S, H, splits, 2] -> [S, H, D] bf16"""
    m, l = part_ml[..., 0], part_ml[..., 1]                    # [S, H, splits]
    M = m.max(axis=-1, keepdims=True)
    w = np.where(np.isneginf(m), 0.0, np.exp(m - M)).astype(np.float32)   # empty pieces weigh 0
    out = (part_out * w[..., None]).sum(axis=2) / (l * w).sum(axis=-1)[..., None]
    return bf16_bits(out)


def prefill_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      block_tables: np.ndarray, token_seq: np.ndarray,
                      positions: np.ndarray) -> np.ndarray:
    """Causal attention of a packed batch of prefill chunks over the paged cache.
    q [N, H, D] bf16; token n belongs to the sequence whose block table row is token_seq[n]
    and sits at positions[n]; it sees positions 0..positions[n] of that sequence (its
    own chunk was stored in the cache first, earlier chunks are already there). -> [N, H, D] bf16"""
    out = np.empty(q.shape, np.float32)
    N = q.shape[0]
    # the packed batch is one contiguous run of tokens per sequence
    cuts = [0, *(np.flatnonzero(np.diff(token_seq)) + 1).tolist(), N]
    for start, stop in zip(cuts[:-1], cuts[1:]):
        if start == stop:
            continue
        s = token_seq[start]
        pos = positions[start:stop]
        end = int(pos.max()) + 1
        k = f32(_gather_pages(k_cache, block_tables[s], end))   # [Hkv, end, D]
        v = f32(_gather_pages(v_cache, block_tables[s], end))
        out[start:stop] = _attend(f32(q[start:stop]), k, v, pos)
    return bf16_bits(out)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU's gate: silu(gate) * up.  [T, F], [T, F] -> [T, F]"""
    return (gate / (np.float32(1) + np.exp(-gate)) * up).astype(np.float32)


def swiglu(gate_up: np.ndarray) -> np.ndarray:
    """The fused gate/up GEMM's output [N, 2F] bf16 (gate in the first F columns, up in
    the last F) -> silu(gate) * up [N, F] bf16."""
    F = gate_up.shape[1] // 2
    x = f32(gate_up)
    return bf16_bits(silu_mul(x[:, :F], x[:, F:]))


def residual_add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The residual connection x + y.  [N, C], [N, C] -> [N, C]"""
    return x + y


def linear(x: np.ndarray, w: np.ndarray, out_f32: bool = False) -> np.ndarray:
    """The GEMM's twin: x [N, K] bf16 @ w [M, K] bf16 .T with fp32 products and sums,
    rounded to bf16 once -> [N, M] bf16, or kept float32 with out_f32 (the logits): what
    cuBLAS gemmEx does with CUBLAS_COMPUTE_32F. The order of the fp32 sums differs from
    cuBLAS's, so the two agree to about one bf16 rounding."""
    y = f32(x) @ f32(w).T
    return y.astype(np.float32) if out_f32 else bf16_bits(y)


def rmsnorm_linear(residual: np.ndarray, norm_w: np.ndarray, eps: float, w: np.ndarray,
                   bias: np.ndarray | None = None, out_f32: bool = False) -> np.ndarray:
    """A block's first GEMM with its RMSNorm in front: h = rmsnorm_bf16(residual) [N, K] bf16,
    then h @ w.T -> [N, M] bf16, with Qwen2's fp32 bias added before the one rounding, or
    float32 with out_f32 (the logits). gemv.cu does both in one launch for a decode batch."""
    y = linear(rmsnorm_bf16(residual, norm_w, eps), w, out_f32=True)
    if bias is not None:
        y = y + bias
    return y if out_f32 else bf16_bits(y)


def sample(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
           u: np.ndarray) -> np.ndarray:
    """The next token of each row of logits [S, V] float32, from uniform numbers u [S] in [0, 1):
      temperature[s] <= 0: the first argmax (greedy);
      otherwise w = exp((l - max l) / temperature), and the kept tokens are
        top-k (0 < top_k[s] < V): the logits >= the top_k-th largest (its ties too),
        top-p (top_p[s] < 1): of those, the largest logits whose w sum to >= top_p of the
                              kept mass (the threshold's ties too);
      the token is the first kept index whose running sum of kept w passes u[s] * (kept mass).
    A degenerate row (degenerate_rows) gets -1: no token, an error for its request.
    -> tokens [S] int32. The kernel finds the same thresholds by a search on the logits'
    bits instead of a sort; sums differ in order, so the two agree whenever u is not within
    rounding of a boundary between two tokens (the test draws u away from them)."""
    S, V = logits.shape
    out = np.empty(S, np.int32)
    bad = degenerate_rows(logits)
    for s in range(S):
        if bad[s]:
            out[s] = -1
            continue
        if temperature[s] <= 0:
            out[s] = int(np.argmax(logits[s]))
            continue
        keep, w = sampling_set(logits[s], temperature[s], top_k[s], top_p[s])
        run = np.cumsum(np.where(keep, w, 0), dtype=np.float64)
        hit = np.flatnonzero(keep & (run > u[s] * run[-1]))
        out[s] = hit[0] if len(hit) else np.flatnonzero(keep)[-1]
    return out


def degenerate_rows(logits: np.ndarray) -> np.ndarray:
    """logits [S, V] -> [S] bool: the rows with no distribution to sample (a NaN or +inf
    logit, or every logit -inf), which sample() and sample.cu answer with -1."""
    logits = np.asarray(logits)
    return (np.isnan(logits) | np.isposinf(logits)).any(axis=-1) | np.isneginf(logits).all(axis=-1)


def sampling_set(l: np.ndarray, temperature: float,
                 top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """One row's kept tokens and weights for sample(): l [V] -> (keep [V] bool, w [V] float32)."""
    V = l.shape[0]
    l = l.astype(np.float32)
    w = np.exp((l - l.max()) / np.float32(temperature)).astype(np.float32)
    keep = np.ones(V, bool)
    if 0 < top_k < V:
        keep &= l >= np.sort(l)[-int(top_k)]
    if top_p < 1:
        order = np.argsort(-l[keep], kind="stable")
        mass = np.cumsum(w[keep][order], dtype=np.float64)
        n = int(np.searchsorted(mass, top_p * mass[-1]))          # first prefix with enough mass
        keep &= l >= l[keep][order][min(n, len(order) - 1)]
    return keep, w


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in float32 (the MoE router)."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def route(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """The MoE router's choice. logits [T, E] -> top [T, k] the k experts each token goes
    to, best first (ties: the lower id), and weight [T, k] their softmax probabilities
    over all E experts, renormalised to sum to 1 over the k when norm (norm_topk_prob)."""
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :k]             # [T, k]
    weight = np.take_along_axis(softmax(logits), top, axis=-1)           # [T, k]
    if norm:
        weight = weight / weight.sum(axis=-1, keepdims=True)
    return top, weight.astype(np.float32)
