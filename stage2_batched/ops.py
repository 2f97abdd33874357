"""The numpy twins of the CUDA kernels: what each kernel in stage2_batched/cuda/ computes.

Changed from stage 1: the tokens of many sequences are packed into one batch
[N, ...], and the KV cache is a pool of pages [NB, P, Hkv, D] shared by all
sequences, so `attention` becomes `paged_decode_attention` (one query per sequence)
and `prefill_attention` (packed chunks of many sequences), both finding each
position through a block table; `store_kvcache` writes through a slot mapping.
New small twins for kernels that stage 1 left to numpy: `embedding`, `residual_add`.

stage2_batched/kernels.py launches the CUDA kernel for cupy arrays and calls the
twin here for numpy arrays (device="cpu"); tests/test_stage2_gpu.py checks that
each kernel equals its twin. Everything is float32.
"""
from __future__ import annotations

import numpy as np


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """ids [N] -> rows of table [V, C] -> [N, C]."""
    return table[ids]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., C], w [C] -> [..., C]: x / rms(x) * w over the last axis.
    Used on the residual stream ([T, C]) and on each q/k head ([T, H, D], w [D])."""
    var = np.mean(x * x, axis=-1, keepdims=True)          # [..., 1]
    return (x / np.sqrt(var + np.float32(eps))).astype(np.float32) * w


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
    q [S, H, D]; k_cache, v_cache [NB, P, Hkv, D]; block_tables [S, max_blocks];
    context_lens [S] (the query is the newest position, context_lens[s] - 1). -> [S, H, D]"""
    out = np.empty_like(q)
    for s in range(q.shape[0]):
        n = int(context_lens[s])
        k = _gather_pages(k_cache, block_tables[s], n)     # [Hkv, n, D]
        v = _gather_pages(v_cache, block_tables[s], n)
        out[s:s + 1] = _attend(q[s:s + 1], k, v, np.array([n - 1]))
    return out


def prefill_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      block_tables: np.ndarray, token_seq: np.ndarray,
                      positions: np.ndarray) -> np.ndarray:
    """Causal attention of a packed batch of prefill chunks over the paged cache.
    q [N, H, D]; token n belongs to the sequence whose block table row is token_seq[n]
    and sits at positions[n]; it sees positions 0..positions[n] of that sequence (its
    own chunk was stored in the cache first, earlier chunks are already there). -> [N, H, D]"""
    out = np.empty_like(q)
    N = q.shape[0]
    # the packed batch is one contiguous run of tokens per sequence
    cuts = [0, *(np.flatnonzero(np.diff(token_seq)) + 1).tolist(), N]
    for start, stop in zip(cuts[:-1], cuts[1:]):
        if start == stop:
            continue
        s = token_seq[start]
        pos = positions[start:stop]
        end = int(pos.max()) + 1
        k = _gather_pages(k_cache, block_tables[s], end)   # [Hkv, end, D]
        v = _gather_pages(v_cache, block_tables[s], end)
        out[start:stop] = _attend(q[start:stop], k, v, pos)
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU's gate: silu(gate) * up.  [T, F], [T, F] -> [T, F]"""
    return (gate / (np.float32(1) + np.exp(-gate)) * up).astype(np.float32)


def residual_add(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The residual connection x + y.  [N, C], [N, C] -> [N, C]"""
    return x + y


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
