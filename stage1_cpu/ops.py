"""The numpy reference for every op of the forward pass: the definition.

stage1_cpu/kernels.py has numba twins with the same names and arguments;
tests/test_stage1_kernels.py checks that each twin equals its definition here.
Everything is float32 (the dtype transformers computes its activations in).
"""
from __future__ import annotations

import numpy as np


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [..., C], w [C] -> [..., C]: x / rms(x) * w over the last axis.
    Used on the residual stream ([T, C]) and on each q/k head ([T, H, D], w [D])."""
    var = np.mean(x * x, axis=-1, keepdims=True)          # [..., 1]
    return (x / np.sqrt(var + np.float32(eps))).astype(np.float32) * w


def rope_tables(max_pos: int, head_dim: int, theta: float,
                scaling=None) -> tuple[np.ndarray, np.ndarray]:
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
    s = (L / wavelen - lo) / (hi - lo)                     # [D/2] blend weight: [0, 1] in the band
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


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
              start_pos: int) -> np.ndarray:
    """Causal GQA attention of T new queries over the cache.
    q [T, H, D]; k_cache, v_cache [Hkv, Tmax, D] already hold positions 0..start_pos+T-1.
    Query t sits at position start_pos + t and sees cache positions 0..start_pos + t.
    -> [T, H, D]"""
    T, H, D = q.shape
    Hkv = k_cache.shape[0]
    group = H // Hkv                                       # query heads sharing one kv head
    end = start_pos + T
    k = k_cache[:, :end]                                   # [Hkv, end, D]
    v = v_cache[:, :end]
    qg = q.reshape(T, Hkv, group, D).transpose(1, 2, 0, 3)  # [Hkv, group, T, D]
    scores = qg @ k[:, None].transpose(0, 1, 3, 2) / np.float32(np.sqrt(D))  # [Hkv, group, T, end]
    # causal mask: query t may not see positions after start_pos + t
    future = np.arange(end)[None, :] > (start_pos + np.arange(T))[:, None]   # [T, end]
    scores = np.where(future, -np.inf, scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ v[:, None]                                   # [Hkv, group, T, D]
    return out.transpose(2, 0, 1, 3).reshape(T, H, D).astype(np.float32)


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """SwiGLU's gate: silu(gate) * up, on the fused projection's output
    [T, 2F] = [gate | up] -> [T, F]"""
    F = gate_up.shape[1] // 2
    gate, up = gate_up[:, :F], gate_up[:, F:]
    return (gate / (np.float32(1) + np.exp(-gate)) * up).astype(np.float32)


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


def mix(y: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The routed experts' outputs, weighted: y [T*k, C] (token t's k outputs in rows
    t*k .. t*k+k-1, in route()'s order), weight [T, k] -> sum_j weight[t, j] y[t*k+j] [T, C]."""
    T, k = weight.shape
    return np.einsum("tk,tkc->tc", weight, y.reshape(T, k, -1)).astype(np.float32)


def gated_add(out: np.ndarray, y: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """out + sigmoid(gate) * y: out, y [T, C], gate [T, 1] (qwen2_moe's shared expert)."""
    return (out + y / (np.float32(1) + np.exp(-gate))).astype(np.float32)
