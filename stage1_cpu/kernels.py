"""Numba kernels for stage 1: the twins of stage1_cpu/ops.py (RoPE, attention, SwiGLU's gate,
the MoE router's choice and mix; RMSNorm and the conventions every kernel file follows are in
norms.py, the matmuls in matmul.py). Each computes exactly what its numpy twin computes
(tests/test_stage1_kernels.py, at awkward shapes); what makes the loops fast, and why
element-wise ops run on one thread while attention uses prange: docs/stage1.md, section 7.
numba notices an edit to a kernel's own file only, so every numba helper a kernel here calls
(exp_f32, its bit cast) is defined in this file too.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .norms import FAST, _inline, _parallel, _serial, rmsnorm, rmsnorm_row  # noqa: F401 (K.rmsnorm)


# exp in float32, with the bit cast it needs (numba has no float reinterpret of its own)
@intrinsic
def _u32_as_f32(typingctx, bits):
    """Reinterpret the 32 bits of an integer as a float32."""
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)) if args[0].type.width > 32
                               else args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always", fastmath=FAST, error_model="numpy")
def exp_f32(x):
    """exp(x) in float32 to ~2 ulp (measured max rel. error 2.3e-7), in plain arithmetic that
    LLVM vectorises: 7x faster than np.exp, one libm call per element in numba. Inputs are
    clamped to [-87, 88], so exp(-inf) gives 1.6e-38, not 0 (no caller relies on exact 0).
        exp(x) = 2^n * exp(r),  n = round(x / ln2),  r = x - n ln2 in [-ln2/2, ln2/2]"""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    # r = x - n ln2, with ln2 split in two so that n * (high part) is exact
    r = x - n * np.float32(0.693359375)
    r = r + n * np.float32(2.12194440e-4)
    # exp(r) by its Taylor series to r^6 (|r| < 0.35: error below float32's)
    p = np.float32(1.0 / 720)
    p = p * r + np.float32(1.0 / 120)
    p = p * r + np.float32(1.0 / 24)
    p = p * r + np.float32(1.0 / 6)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    # 2^n: n + 127 written into float32's exponent bits
    return p * _u32_as_f32((np.int64(n) + 127) << 23)


# Element-wise ops: numba twins of ops.py, each written once for one row, as an
# inlined helper (_inline, norms.py), and a serial loop over the rows.
@_inline
def silu_mul_row(gate_up, out, t):
    F = out.shape[1]
    for f in range(F):
        g = gate_up[t, f]
        out[t, f] = g / (np.float32(1.0) + exp_f32(-g)) * gate_up[t, F + f]


@_serial
def _silu_mul(gate_up, out):
    for t in range(out.shape[0]):
        silu_mul_row(gate_up, out, t)


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """[T, 2F] = [gate | up] (the fused projection's output) -> silu(gate) * up [T, F]. Whole, so
    contiguous: given its two column halves (strided views) the loop did not vectorise (20x)."""
    gate_up = np.ascontiguousarray(gate_up)
    T, F = gate_up.shape[0], gate_up.shape[1] // 2
    out = np.empty((T, F), dtype=np.float32)
    _silu_mul(gate_up, out)
    return out


# MoE: the router's choice, and the weighted sum of the chosen experts' outputs.
# Per token, serial: E and k are small (128 and 8 for Qwen3-30B-A3B).
@_inline
def route_row(logits, t, k, norm, top, weight):
    """ops.route for token t: logits [T, E] -> top [T, k] int64, weight [T, k] f32."""
    # exercise 1.6 begin
    E = logits.shape[1]
    mx = logits[t, 0]
    for e in range(1, E):
        mx = max(mx, logits[t, e])
    total = np.float32(0.0)                      # softmax denominator over all E experts
    for e in range(E):
        total += exp_f32(logits[t, e] - mx)
    kept = np.float32(0.0)
    for j in range(k):                           # the j-th largest: first best not taken yet
        best = -1
        for e in range(E):
            taken = False
            for i in range(j):
                taken = taken or top[t, i] == e
            if not taken and (best < 0 or logits[t, e] > logits[t, best]):
                best = e
        top[t, j] = best
        weight[t, j] = exp_f32(logits[t, best] - mx) / total
        kept += weight[t, j]
    if norm:
        for j in range(k):
            weight[t, j] = weight[t, j] / kept
    # exercise 1.6 end


@_serial
def _route(logits, k, norm, top, weight):
    for t in range(logits.shape[0]):
        route_row(logits, t, k, norm, top, weight)


def route(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, E] -> top [T, k], weight [T, k] (ops.route)."""
    T = logits.shape[0]
    top, weight = np.empty((T, k), dtype=np.int64), np.empty((T, k), dtype=np.float32)
    _route(np.ascontiguousarray(logits, dtype=np.float32), k, norm, top, weight)
    return top, weight


@_inline
def mix_row(y, weight, out, t):
    """out[t] = sum_j weight[t, j] y[t*k + j], j in order: y [T*k, C], weight [T, k]."""
    k, C = weight.shape[1], y.shape[1]
    for c in range(C):
        out[t, c] = np.float32(0.0)
    for j in range(k):
        w = weight[t, j]
        for c in range(C):
            out[t, c] += w * y[t * k + j, c]


@_serial
def _mix(y, weight, out):
    for t in range(out.shape[0]):
        mix_row(y, weight, out, t)


def mix(y: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """y [T*k, C], weight [T, k] -> [T, C] (ops.mix)."""
    out = np.empty((weight.shape[0], y.shape[1]), dtype=np.float32)
    _mix(np.ascontiguousarray(y), np.ascontiguousarray(weight), out)
    return out


@_inline
def gated_add_row(out, y, gate, t):
    """out[t] += sigmoid(gate[t, 0]) * y[t]: out, y [T, C], gate [T, 1]."""
    g = np.float32(1.0) / (np.float32(1.0) + exp_f32(-gate[t, 0]))
    for c in range(y.shape[1]):
        out[t, c] = out[t, c] + g * y[t, c]


@_serial
def _gated_add(out, y, gate):
    for t in range(out.shape[0]):
        gated_add_row(out, y, gate, t)


def gated_add(out: np.ndarray, y: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """out + sigmoid(gate) * y, a new array: out, y [T, C], gate [T, 1] (ops.gated_add)."""
    res = np.array(out, dtype=np.float32)                # [T, C] a copy, added to in place
    _gated_add(res, np.ascontiguousarray(y), np.ascontiguousarray(gate))
    return res


@_inline
def rope_head(x, cos, sin, out, t, h):
    """Head h of token t (out may be x: each pair is read before it is written)."""
    # exercise 1.2 begin
    half = x.shape[2] // 2
    for i in range(half):
        x1 = x[t, h, i]
        x2 = x[t, h, half + i]
        out[t, h, i] = x1 * cos[t, i] - x2 * sin[t, i]
        out[t, h, half + i] = x2 * cos[t, i] + x1 * sin[t, i]
    # exercise 1.2 end


@_serial
def _rope(x, cos, sin, out):
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            rope_head(x, cos, sin, out, t, h)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE. x: [T, H, D], cos/sin: [T, D/2]."""
    out = np.empty_like(x)
    _rope(x, cos, sin, out)
    return out


# Attention over the KV cache.
@_inline
def attention_item(q, k_cache, v_cache, start_pos, out, item):
    """One (KV head, query) pair: all `group` query heads of KV head kvh for query t."""
    # exercise 1.4 begin
    T, H, D = q.shape
    Hkv = k_cache.shape[0]
    group = H // Hkv  # GQA: query heads kvh*group .. kvh*group+group-1 share KV head kvh
    scale = np.float32(1.0 / math.sqrt(D))
    kvh = item // T
    t = item % T
    n = start_pos + t + 1  # causal: positions 0 .. start_pos + t
    h0 = kvh * group
    scores = np.empty((group, n), dtype=np.float32)  # [group, n]
    # scores = q . k / sqrt(D)
    for j in range(n):
        for g in range(group):
            d = np.float32(0.0)
            for i in range(D):
                d += q[t, h0 + g, i] * k_cache[kvh, j, i]
            scores[g, j] = d * scale
    # softmax numerators exp(s - max), max subtracted for stability
    # exercise 1.3 begin
    ssum = np.empty(group, dtype=np.float32)
    for g in range(group):
        mx = scores[g, 0]
        for j in range(1, n):
            mx = max(mx, scores[g, j])
        a = np.float32(0.0)
        for j in range(n):
            e = exp_f32(scores[g, j] - mx)
            scores[g, j] = e
            a += e
        ssum[g] = a
    # exercise 1.3 end
    # out = sum_j p_j * v_j / sum_j p_j, accumulated along D (vectorises over D)
    acc = np.zeros((group, D), dtype=np.float32)  # [group, D]
    for j in range(n):
        for g in range(group):
            p = scores[g, j]
            for i in range(D):
                acc[g, i] += p * v_cache[kvh, j, i]
    for g in range(group):
        for i in range(D):
            out[t, h0 + g, i] = acc[g, i] / ssum[g]
    # exercise 1.4 end


# one work item per (KV head, query): the item serves all `group` query heads
# of its KV head, so each key and value row is read once for the group (at
# decode the cache reads are the cost: this halves them for Qwen3's 16/8)
@_parallel
def _attention(q, k_cache, v_cache, start_pos, out):
    for item in prange(k_cache.shape[0] * q.shape[0]):
        attention_item(q, k_cache, v_cache, start_pos, out, item)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
              start_pos: int) -> np.ndarray:
    """q: [T, H, D]; k_cache, v_cache: [Hkv, Tmax, D]; query t sits at position
    start_pos + t and attends to cache positions 0 .. start_pos + t."""
    H = q.shape[1]
    if H % k_cache.shape[0]:
        raise ValueError(f"{H} query heads cannot share {k_cache.shape[0]} KV heads evenly")
    out = np.empty_like(q)
    _attention(q, k_cache, v_cache, start_pos, out)
    return out
