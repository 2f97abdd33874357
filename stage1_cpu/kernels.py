"""Numba kernels for stage 1: the fast twins of stage1_cpu/ops.py and the fused
dequantize-and-multiply kernels behind stage1_cpu/quant.py.

Every function here computes exactly what its numpy twin computes (ops.py, or
`Weight.matmul_ref` in quant.py); tests/test_stage1_kernels.py checks each one
at awkward shapes. What makes them fast:

- Decode (one token) is a matrix-vector product: each weight byte is used once,
  so the speed limit is memory bandwidth, not arithmetic. The kernels read the
  weight rows in their stored format (bf16 / int8 / int4) and convert to fp32 in
  registers; a full-precision copy of a weight matrix is never made.
- The inner loops are plain `for j in range(n): acc += a[j] * b[j]` over
  contiguous memory, which LLVM turns into AVX-512 code. `fastmath` is limited
  to {"reassoc", "contract"}: reassociation lets LLVM split a sum into vector
  lanes, contraction gives fused multiply-adds. We never assume "no NaN / no
  inf" (attention's softmax relies on -inf behaving).
- Work is split over output rows with `prange` (one chunk per thread, so each
  thread streams one contiguous slice of the matrix).
- A parallel region costs ~8 us to start here (OpenMP with
  OMP_WAIT_POLICY=PASSIVE) — that is a lot next to a 20 us norm, so the small
  element-wise ops have serial variants that the wrappers pick for few tokens.
- `cache=True` stores the machine code on disk, so only the first run ever
  compiles. Each kernel is called with one fixed set of dtypes, so there is one
  specialisation each (two for rmsnorm: 2-D and 3-D input).
"""

import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# reassoc: let LLVM split reductions over vector lanes; contract: allow FMA.
FAST = {"reassoc", "contract"}


def set_threads(n: int | None) -> int:
    """Use n threads for the parallel kernels (None: all cores). Returns the count."""
    if n is None:
        n = numba.config.NUMBA_NUM_THREADS
    if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(
            f"threads={n} is not possible: this machine allows 1..{numba.config.NUMBA_NUM_THREADS} "
            f"(set NUMBA_NUM_THREADS before starting Python to allow more)"
        )
    numba.set_num_threads(n)
    return n


# ---------------------------------------------------------------------------
# Bit casts. numba has no float16 or bfloat16 type, so weights and scales are
# stored as uint16 bit patterns and turned into float32 with one instruction.
# ---------------------------------------------------------------------------


@intrinsic
def bf16_to_f32(typingctx, bits):
    """uint16 bfloat16 bits -> float32: bf16 is the top half of an fp32, so
    shift left by 16 and reinterpret the bits (no rounding, exact)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        shifted = builder.shl(wide, ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(shifted, ir.FloatType())

    return sig, codegen


@intrinsic
def f16_to_f32(typingctx, bits):
    """uint16 IEEE half bits -> float32 (one vcvtph2ps on this CPU, exact)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return sig, codegen


# ---------------------------------------------------------------------------
# Quantized matmul, decode path: out[t, r] = sum_k x[t, k] * W[r, k].
# x: [T, Kp] f32 (Kp = in_features padded to a whole number of groups),
# out: [T, O] f32. Used for T up to a few tokens: each weight row is read
# from memory once and reused from L1 for all T tokens.
# ---------------------------------------------------------------------------


@njit(parallel=True, cache=True, fastmath=FAST)
def matmul_bf16(x, w, out):
    """w: [O, K] uint16 bf16 bits."""
    T = x.shape[0]
    O, K = w.shape
    # prange hands each thread one contiguous block of rows: each streams its own slice
    for r in prange(O):
        wr = w[r]
        for t in range(T):
            xt = x[t]
            acc = np.float32(0.0)
            # the hot loop: 2 bytes per weight, converted by a shift
            for k in range(K):
                acc += bf16_to_f32(wr[k]) * xt[k]
            out[t, r] = acc


def _trip(group_size):
    """The group size as the kernels' inner-loop bound. 64 and 128 are baked in
    as constants: LLVM then emits straight vector code with no remainder loop
    (1.1-1.3x faster). 32 stays a runtime value: LLVM would fully unroll a
    constant 16/32-trip loop before vectorising it and then fail to vectorise
    the unrolled code (4x slower, measured)."""
    return group_size if group_size >= 64 else 0


def _make_matmul_int8(group_size):
    const_gs = _trip(group_size)

    @njit(parallel=True, cache=True, fastmath=FAST)
    def matmul_int8(x, q, s, out):
        """q: [O, Kp] int8, s: [O, G] uint16 fp16 scales; W[r, k] = q[r, k] * s[r, k // gs]."""
        T = x.shape[0]
        O = q.shape[0]
        G = s.shape[1]
        gs = const_gs if const_gs else x.shape[1] // G
        # prange hands each thread one contiguous block of rows: each streams its own slice
        for r in prange(O):
            qr = q[r]
            for t in range(T):
                xt = x[t]
                acc = np.float32(0.0)
                for g in range(G):
                    # slices, so the inner index starts at 0 and is provably
                    # non-negative: no wrap-around check, a clean vector loop
                    qg = qr[g * gs:(g + 1) * gs]
                    xg = xt[g * gs:(g + 1) * gs]
                    # integer weights times fp32 activations, scaled once per group
                    part = np.float32(0.0)
                    for j in range(gs):
                        part += np.float32(qg[j]) * xg[j]
                    acc += part * f16_to_f32(s[r, g])
                out[t, r] = acc

    return matmul_int8


def _make_matmul_int4(group_size):
    const_gs = _trip(group_size)

    @njit(parallel=True, cache=True, fastmath=FAST)
    def matmul_int4(x, q, s, m, out):
        """q: [O, Kp/2] uint8, s, m: [O, G] uint16 fp16 scale and minimum.

        Layout of one group of gs weights, gs/2 bytes: byte j holds weight j in its
        low nibble and weight j + gs/2 in its high nibble (llama.cpp's Q4 layout),
        so both halves unpack from contiguous bytes.
        W[r, k] = nibble * s[r, g] + m[r, g], hence a group's dot product is
            s * sum(nibble * x) + m * sum(x)
        and sum(x) per group is computed once per call for all rows.
        """
        T = x.shape[0]
        O = q.shape[0]
        G = s.shape[1]
        gs = const_gs if const_gs else x.shape[1] // G
        half = gs // 2
        xsum = _group_sums(x, G)  # [T, G], shared by every row
        for r in prange(O):
            qr = q[r]
            for t in range(T):
                xt = x[t]
                acc = np.float32(0.0)
                for g in range(G):
                    qg = qr[g * half:(g + 1) * half]
                    x1 = xt[g * gs:g * gs + half]          # weights j of the group: low nibbles
                    x2 = xt[g * gs + half:(g + 1) * gs]    # weights j + gs/2: high nibbles
                    part = np.float32(0.0)
                    for j in range(half):
                        # unpack in float: b = 16 hi + lo. (b & 15, b >> 4 would be
                        # computed in int64 by numba, half as many lanes per vector.)
                        b = np.float32(qg[j])
                        hi = np.floor(b * np.float32(0.0625))
                        lo = b - np.float32(16.0) * hi
                        part += lo * x1[j] + hi * x2[j]
                    acc += part * f16_to_f32(s[r, g]) + f16_to_f32(m[r, g]) * xsum[t, g]
                out[t, r] = acc

    return matmul_int4


# one compiled kernel per group size (each cached on disk after its first use)
MATMUL_INT8 = {gs: _make_matmul_int8(gs) for gs in (32, 64, 128)}
MATMUL_INT4 = {gs: _make_matmul_int4(gs) for gs in (32, 64, 128)}


@njit(cache=True, fastmath=FAST)
def _group_sums(x, G):
    """x [T, Kp] -> [T, G]: the sum of each group of activations."""
    T, Kp = x.shape
    gs = Kp // G
    xsum = np.empty((T, G), dtype=np.float32)
    for t in range(T):
        for g in range(G):
            xg = x[t, g * gs:(g + 1) * gs]
            a = np.float32(0.0)
            for j in range(gs):
                a += xg[j]
            xsum[t, g] = a
    return xsum


# ---------------------------------------------------------------------------
# Dequantize selected rows to fp32: the embedding lookup, and the fp32 tile
# that the prefill path hands to BLAS (a block of rows, never the whole matrix).
# ids: [R] int64, out: [R, Kp] f32.
# ---------------------------------------------------------------------------


@njit(parallel=True, cache=True, fastmath=FAST)
def dequant_rows_bf16(ids, w, out):
    for i in prange(ids.shape[0]):
        wr = w[ids[i]]
        o = out[i]
        for k in range(wr.shape[0]):
            o[k] = bf16_to_f32(wr[k])


@njit(parallel=True, cache=True, fastmath=FAST)
def dequant_rows_int8(ids, q, s, out):
    G = s.shape[1]
    gs = q.shape[1] // G
    for i in prange(ids.shape[0]):
        r = ids[i]
        for g in range(G):
            sc = f16_to_f32(s[r, g])
            qg = q[r, g * gs:(g + 1) * gs]
            o = out[i, g * gs:(g + 1) * gs]
            for j in range(gs):
                o[j] = np.float32(qg[j]) * sc


@njit(parallel=True, cache=True, fastmath=FAST)
def dequant_rows_int4(ids, q, s, m, out):
    G = s.shape[1]
    half = q.shape[1] // G
    gs = 2 * half
    for i in prange(ids.shape[0]):
        r = ids[i]
        for g in range(G):
            sc = f16_to_f32(s[r, g])
            mn = f16_to_f32(m[r, g])
            qg = q[r, g * half:(g + 1) * half]
            o1 = out[i, g * gs:g * gs + half]
            o2 = out[i, g * gs + half:(g + 1) * gs]
            for j in range(half):
                b = np.float32(qg[j])
                hi = np.floor(b * np.float32(0.0625))
                o1[j] = (b - np.float32(16.0) * hi) * sc + mn
                o2[j] = hi * sc + mn


# ---------------------------------------------------------------------------
# Element-wise and normalisation ops: numba twins of ops.py. Serial bodies,
# with a parallel variant used when there are many tokens (prefill).
# ---------------------------------------------------------------------------


def _rmsnorm_body(x2, w, eps, out2):
    C = x2.shape[1]
    for t in prange(x2.shape[0]):
        ss = np.float32(0.0)
        for c in range(C):
            ss += x2[t, c] * x2[t, c]
        rms = np.sqrt(ss / np.float32(C) + np.float32(eps))
        for c in range(C):
            out2[t, c] = x2[t, c] / rms * w[c]


_rmsnorm_serial = njit(cache=True, fastmath=FAST)(_rmsnorm_body)
_rmsnorm_parallel = njit(parallel=True, cache=True, fastmath=FAST)(_rmsnorm_body)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: [T, C] with w [C], or [T, H, D] with w [D]: normalise the last axis."""
    x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])  # [rows, last]
    out = np.empty_like(x2)
    (_rmsnorm_parallel if x2.shape[0] >= 64 else _rmsnorm_serial)(x2, w, eps, out)
    return out.reshape(x.shape)


def _silu_mul_body(gate, up, out):
    F = gate.shape[1]
    for t in prange(gate.shape[0]):
        for f in range(F):
            g = gate[t, f]
            out[t, f] = g / (np.float32(1.0) + np.exp(-g)) * up[t, f]


_silu_mul_serial = njit(cache=True, fastmath=FAST)(_silu_mul_body)
_silu_mul_parallel = njit(parallel=True, cache=True, fastmath=FAST)(_silu_mul_body)


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up, gate and up [T, F]."""
    out = np.empty_like(gate)
    (_silu_mul_parallel if gate.shape[0] >= 16 else _silu_mul_serial)(gate, up, out)
    return out


def _rope_body(x, cos, sin, out):
    T, H, D = x.shape
    half = D // 2
    for t in prange(T):
        for h in range(H):
            for i in range(half):
                x1 = x[t, h, i]
                x2 = x[t, h, half + i]
                out[t, h, i] = x1 * cos[t, i] - x2 * sin[t, i]
                out[t, h, half + i] = x2 * cos[t, i] + x1 * sin[t, i]


_rope_serial = njit(cache=True)(_rope_body)
_rope_parallel = njit(parallel=True, cache=True)(_rope_body)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE. x: [T, H, D], cos/sin: [T, D/2]."""
    out = np.empty_like(x)
    (_rope_parallel if x.shape[0] >= 16 else _rope_serial)(x, cos, sin, out)
    return out


# ---------------------------------------------------------------------------
# Attention over the KV cache.
# ---------------------------------------------------------------------------


def _attention_body(q, k_cache, v_cache, start_pos, out):
    T, H, D = q.shape
    Hkv = k_cache.shape[0]
    group = H // Hkv
    scale = np.float32(1.0 / math.sqrt(D))
    # one work item per (head, query): balanced over threads for any head count
    for item in prange(H * T):
        h = item // T
        t = item % T
        kvh = h // group  # GQA: this query head reads KV head h // (H / Hkv)
        n = start_pos + t + 1  # causal: positions 0 .. start_pos + t
        scores = np.empty(n, dtype=np.float32)  # [n]
        # scores = q . k / sqrt(D), and their max for a stable softmax
        mx = np.float32(-np.inf)
        for j in range(n):
            d = np.float32(0.0)
            for i in range(D):
                d += q[t, h, i] * k_cache[kvh, j, i]
            d *= scale
            scores[j] = d
            mx = max(mx, d)
        ssum = np.float32(0.0)
        for j in range(n):
            e = np.exp(scores[j] - mx)
            scores[j] = e
            ssum += e
        # out = sum_j p_j * v_j, accumulated along D (vectorises over D)
        acc = np.zeros(D, dtype=np.float32)  # [D]
        for j in range(n):
            p = scores[j]
            for i in range(D):
                acc[i] += p * v_cache[kvh, j, i]
        for i in range(D):
            out[t, h, i] = acc[i] / ssum


_attention_serial = njit(cache=True, fastmath=FAST)(_attention_body)
_attention_parallel = njit(parallel=True, cache=True, fastmath=FAST)(_attention_body)


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start_pos: int) -> np.ndarray:
    """q: [T, H, D]; k_cache, v_cache: [Hkv, Tmax, D]; query t sits at position
    start_pos + t and attends to cache positions 0 .. start_pos + t."""
    T, H, D = q.shape
    if H % k_cache.shape[0]:
        raise ValueError(f"{H} query heads cannot share {k_cache.shape[0]} KV heads evenly")
    out = np.empty_like(q)
    # work ~ H * T * context * D: below ~1M multiply-adds a parallel start costs more than it saves
    work = H * T * (start_pos + T) * D
    (_attention_parallel if work >= 1 << 20 else _attention_serial)(q, k_cache, v_cache, start_pos, out)
    return out
