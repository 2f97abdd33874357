"""Prefill attention through BLAS, and the per-op kernels the fast path runs.

Changed from the core (stage1_cpu/kernels.py: attention): the core gives each
(KV head, query) pair to a thread, whose loops compute one query's scores, softmax
and sum of values. For T queries at once that is compute-bound work, and it is two
matrix products per KV head, (queries x keys) then (probabilities x values), which
BLAS (numpy's OpenBLAS) does about 3x faster than those loops (docs/benchmarks.md).
Query blocks of ATT_BLOCK skip most of the causally masked upper triangle. Fewer
than ATT_BLAS_MIN_T queries (decode, short prompts) keep the core's kernel.

KERNELS is the core's kernels module with that one op replaced: Model.forward
calls it where the core calls stage1_cpu/kernels.py (FastPath.kernels).
"""
import math
from types import SimpleNamespace

import numpy as np
from numba import njit

from .. import kernels
from ..kernels import FAST, exp_f32

ATT_BLOCK = 128             # queries per block: the masked part above the diagonal is skipped per block
ATT_BLAS_MIN_T = 16         # from 16 queries the two GEMMs beat the core's per-item loops


@njit(cache=True, fastmath=FAST, error_model="numpy")
def _causal_softmax(scores, scale, first_pos, group):
    """In place: scores [rows, n] with rows = (query, head in group) pairs ->
    softmax(scale * scores) over the positions row r may see, zeros after them.
    Row r is query first_pos + r // group, which sees positions 0 .. that."""
    rows, n = scores.shape
    for r in range(rows):
        last = min(n, first_pos + r // group + 1)  # visible positions: 0 .. last-1
        mx = scores[r, 0]
        for j in range(1, last):
            mx = max(mx, scores[r, j])
        a = np.float32(0.0)
        for j in range(last):
            e = exp_f32((scores[r, j] - mx) * scale)
            scores[r, j] = e
            a += e
        inv = np.float32(1.0) / a
        for j in range(last):
            scores[r, j] *= inv
        for j in range(last, n):
            scores[r, j] = 0.0


def attention_blas(q, k_cache, v_cache, start_pos, out):
    """kernels.attention's result into out [T, H, D], by two GEMMs per KV head and query block."""
    T, H, D = q.shape
    Hkv = k_cache.shape[0]
    group = H // Hkv
    scale = np.float32(1.0 / math.sqrt(D))
    for kvh in range(Hkv):
        heads = slice(kvh * group, (kvh + 1) * group)
        for t0 in range(0, T, ATT_BLOCK):
            t1 = min(T, t0 + ATT_BLOCK)
            n = start_pos + t1                                   # keys this block can see
            qb = q[t0:t1, heads].reshape(-1, D)                  # [(t, head), D]
            scores = qb @ k_cache[kvh, :n].T                     # [(t, head), n]
            _causal_softmax(scores, scale, start_pos + t0, group)
            out[t0:t1, heads] = (scores @ v_cache[kvh, :n]).reshape(t1 - t0, group, D)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start_pos: int) -> np.ndarray:
    """kernels.attention, through BLAS from ATT_BLAS_MIN_T queries."""
    if q.shape[0] < ATT_BLAS_MIN_T:
        return kernels.attention(q, k_cache, v_cache, start_pos)
    if q.shape[1] % k_cache.shape[0]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k_cache.shape[0]} KV heads evenly")
    out = np.empty_like(q)
    attention_blas(q, k_cache, v_cache, start_pos, out)
    return out


KERNELS = SimpleNamespace(**{name: getattr(kernels, name) for name in
                             ("rmsnorm", "rope", "silu_mul", "route", "mix", "gated_add")}, attention=attention)
