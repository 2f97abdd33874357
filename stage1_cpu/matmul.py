"""The matmul kernels behind stage1_cpu/quant.py: each weight format read as stored and
converted to fp32 in registers, one fused dequantize-and-multiply per format, each exactly
what `Weight.matmul_ref` (quant.py) computes (tests/test_stage1_kernels.py). Decode is a
matrix-vector product, limited by memory bandwidth: prange gives each thread a contiguous
slice of rows. Prefill does not come here: quant.py hands a dequantized tile (dequant_rows_*)
to BLAS (docs/stage1.md, section 7). As in kernels.py, the numba helpers a kernel calls (the
bit casts) live in its file: numba notices an edit to a kernel's own file only.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .norms import FAST, _inline


# Bit casts. numba has no float16 or bfloat16 type, so weights and scales are
# stored as uint16 bit patterns and turned into float32 with one instruction.
@intrinsic
def _u32_as_f32(typingctx, bits):
    """Reinterpret the 32 bits of an integer as a float32."""
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)) if args[0].type.width > 32
                               else args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always", error_model="numpy")
def bf16_to_f32(bits):
    """uint16 bfloat16 bits -> float32: bf16 is the top half of an fp32, so
    shift left by 16 and reinterpret the bits (no rounding, exact)."""
    return _u32_as_f32(np.uint32(bits) << np.uint32(16))


@njit(inline="always", error_model="numpy")
def f16_to_f32(h):
    """uint16 IEEE half bits -> float32, exact for every finite value (subnormals too): move
    sign, exponent and mantissa to their float32 places (the value scaled by 2^-112), then
    multiply by 2^112. (LLVM's `fpext half` is one instruction, but this LLVM build hits an
    assertion when it vectorises it.) Once per group of weights, so its cost is nothing."""
    b = np.int64(h)
    bits = ((b & 0x8000) << 16) | ((b & 0x7FFF) << 13)
    return _u32_as_f32(bits) * np.float32(5.192296858534828e33)  # 2^112


# Quantized matmul, decode path: out[t, r] = sum_k x[t, k] * W[r, k].
# x: [T, Kp] f32 (Kp = in_features padded to whole groups), out: [T, O] f32.
# For T < quant.PREFILL_MIN_T: each row is read once, reused from L1 for all T tokens.
# Converting in registers costs bf16 a shift, int4 most: int4 can be compute-bound
# (docs/stage1.md, napkin maths).
@_inline
def row_f32(x, t, w, r):
    """x[t] . w[r]: x [T, K] f32, w [O, K] f32."""
    acc = np.float32(0.0)
    for k in range(x.shape[1]):
        acc += w[r, k] * x[t, k]
    return acc


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_f32(x, w, out):
    """x: [T, K] f32, w: [O, K] f32 -> out: [T, O]. Decode only, and not BLAS: OpenBLAS's
    spinning threads starve the numba kernels that follow (docs/stage1.md, section 7)."""
    T, O = x.shape[0], w.shape[0]
    for r in prange(O):
        for t in range(T):
            out[t, r] = row_f32(x, t, w, r)


@_inline
def row_bf16(x, t, w, r):
    """x[t] . w[r]: w [O, K] uint16 bf16 bits, each converted by a shift (bf16_to_f32).
    (stage1_cpu/fast/blocks.py reads four rows per pass, in whole blocks of rows.)"""
    acc = np.float32(0.0)
    for k in range(x.shape[1]):
        acc += bf16_to_f32(w[r, k]) * x[t, k]
    return acc


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_bf16(x, w, out):
    """x: [T, K] f32, w: [O, K] uint16 bf16 bits -> out: [T, O]."""
    T, O = x.shape[0], w.shape[0]
    for r in prange(O):
        for t in range(T):
            out[t, r] = row_bf16(x, t, w, r)


# Indexing style, for all kernels below: plain a[r, g, j] with every index a loop counter,
# so numba knows each is >= 0 (no wrap-around select) and makes no array views (each costs
# two atomic reference counts, which threads sharing x bounce between their cores). The
# group size stays a runtime value (docs/stage1.md, section 7, "What did not help").
@_inline
def row_int8(x3, t, q, s, r):
    """x3[t] . row r of (q, s): x3 [T, G, gs] f32, q [O, G, gs] int8, s [O, G] fp16 bits."""
    G, gs = x3.shape[1], x3.shape[2]
    acc = np.float32(0.0)
    # exercise 1.9 begin
    for g in range(G):
        # integer weights times fp32 activations, scaled once per group
        part = np.float32(0.0)
        for j in range(gs):
            part += np.float32(q[r, g, j]) * x3[t, g, j]
        acc += part * f16_to_f32(s[r, g])
    # exercise 1.9 end
    return acc


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_int8(x3, q, s, out):
    """x3: [T, G, gs] f32 (x split into groups, a view); q: [O, G, gs] int8;
    s: [O, G] fp16 bits -> out: [T, O].  W[r, g, j] = q[r, g, j] * s[r, g]."""
    T, O = x3.shape[0], q.shape[0]
    for r in prange(O):
        for t in range(T):
            out[t, r] = row_int8(x3, t, q, s, r)


@_inline
def group_sums(x4, t, xsum):
    """xsum[t, p, h] = sum of group 2p+h of token t: x4 [T, G/2, 2, gs], xsum [T, G/2, 2]."""
    for p in range(x4.shape[1]):
        a = np.float32(0.0)
        b = np.float32(0.0)
        for j in range(x4.shape[3]):
            a += x4[t, p, 0, j]
            b += x4[t, p, 1, j]
        xsum[t, p, 0] = a
        xsum[t, p, 1] = b


@_inline
def row_int4(x4, xsum, t, q, s, m, r):
    """x4[t] . row r of (q, s, m), matmul_int4's layout; xsum from group_sums."""
    P, gs = x4.shape[1], x4.shape[3]
    acc = np.float32(0.0)
    # exercise 1.11 begin
    for p in range(P):
        lo_part = np.float32(0.0)
        hi_part = np.float32(0.0)
        for j in range(gs):
            # unpack in float: byte = 16 hi + lo. (b & 15 and b >> 4 would be
            # int64 in numba: a quarter of the lanes per vector, measured slower.)
            byte = np.float32(q[r, p, j])
            hi = np.floor(byte * np.float32(0.0625))
            lo_part += (byte - np.float32(16.0) * hi) * x4[t, p, 0, j]
            hi_part += hi * x4[t, p, 1, j]
        acc += (lo_part * f16_to_f32(s[r, 2 * p]) + f16_to_f32(m[r, 2 * p]) * xsum[t, p, 0]
                + hi_part * f16_to_f32(s[r, 2 * p + 1])
                + f16_to_f32(m[r, 2 * p + 1]) * xsum[t, p, 1])
    # exercise 1.11 end
    return acc


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_int4(x4, q, s, m, out):
    """x4: [T, G/2, 2, gs] f32 (x split into pairs of groups, a view);
    q: [O, G/2, gs] uint8; s, m: [O, G] fp16 bits, scale and minimum per group.
    Byte j of pair p holds weight j of group 2p (low nibble) and of group 2p+1 (high):
    both nibbles multiply contiguous activations over a whole group. W = nibble * s + m,
    so a group's dot product is s * sum(nibble * x) + m * sum(x), sum(x) once per call."""
    T, O = x4.shape[0], q.shape[0]
    xsum = np.empty((T, x4.shape[1], 2), dtype=np.float32)   # [T, G/2, 2] sum of each group of x
    for t in range(T):
        group_sums(x4, t, xsum)
    for r in prange(O):
        for t in range(T):
            out[t, r] = row_int4(x4, xsum, t, q, s, m, r)


# Dequantize selected rows to fp32: the embedding lookup, and the fp32 tile that the
# prefill path hands to BLAS. ids: [R] int64; out: [R, Kp] f32, in the weight's group
# layout. Serial on purpose: numba threads would fight OpenBLAS's spinning workers for the cores.
@njit(cache=True, fastmath=FAST, error_model="numpy")
def dequant_rows_bf16(ids, w, out):
    """w: [O, K] bf16 bits -> out: [R, K]."""
    for i in range(ids.shape[0]):
        r = ids[i]
        for k in range(w.shape[1]):
            out[i, k] = bf16_to_f32(w[r, k])


@njit(cache=True, fastmath=FAST, error_model="numpy")
def dequant_rows_int8(ids, q, s, out):
    """q: [O, G, gs] int8 -> out: [R, G, gs]."""
    _, G, gs = q.shape
    for i in range(ids.shape[0]):
        r = ids[i]
        for g in range(G):
            sc = f16_to_f32(s[r, g])
            for j in range(gs):
                out[i, g, j] = np.float32(q[r, g, j]) * sc


@njit(cache=True, fastmath=FAST, error_model="numpy")
def dequant_rows_int4(ids, q, s, m, out):
    """q: [O, G/2, gs] uint8 -> out: [R, G/2, 2, gs] (group 2p, then group 2p+1)."""
    _, P, gs = q.shape
    for i in range(ids.shape[0]):
        r = ids[i]
        for p in range(P):
            s0 = f16_to_f32(s[r, 2 * p])
            m0 = f16_to_f32(m[r, 2 * p])
            s1 = f16_to_f32(s[r, 2 * p + 1])
            m1 = f16_to_f32(m[r, 2 * p + 1])
            # two loops with one output stream each: LLVM's vector loop writing
            # both halves at once ran 5x slower (measured)
            for j in range(gs):
                byte = np.float32(q[r, p, j])
                out[i, p, 0, j] = ((byte - np.float32(16.0) * np.floor(byte * np.float32(0.0625)))
                                   * s0 + m0)
            for j in range(gs):
                byte = np.float32(q[r, p, j])
                out[i, p, 1, j] = np.floor(byte * np.float32(0.0625)) * s1 + m1

