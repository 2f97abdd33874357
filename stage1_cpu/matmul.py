"""The matmul kernels behind stage1_cpu/quant.py: each weight format read as stored and
converted to fp32 in registers, one fused dequantize-and-multiply per format.

Every kernel computes exactly what `Weight.matmul_ref` (quant.py) computes;
tests/test_stage1_kernels.py checks each one at awkward shapes.

- Decode (one token) is a matrix-vector product: each weight byte is used once,
  so the speed limit is memory bandwidth, not arithmetic. The kernels read the
  weight rows in their stored format (bf16 / int8 / int4) and convert to fp32 in
  registers; a full-precision copy of a weight matrix is never made.
- Work is split over output rows with `prange` (one chunk per thread, so each
  thread streams one contiguous slice of the matrix).
- Prefill (many tokens) does not come here: quant.py dequantizes a tile of rows
  (dequant_rows_*, below) and hands it to BLAS, which is compute-bound work.

The row bodies are `_inline` helpers so that stage1_cpu/fast/ can run the same
bodies in its one-region decode step (and get the same bits). The numba helpers
each kernel calls (the bit casts) live in this file too: numba notices an edit
to a kernel's own file only, so a kernel and what it inlines are kept together.
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .norms import FAST

_inline = njit(inline="always", fastmath=FAST, error_model="numpy")

# ---------------------------------------------------------------------------
# Bit casts. numba has no float16 or bfloat16 type, so weights and scales are
# stored as uint16 bit patterns and turned into float32 with one instruction.


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
def _u32_as_f32(typingctx, bits):
    """Reinterpret the 32 bits of an integer as a float32."""
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.trunc(args[0], ir.IntType(32)) if args[0].type.width > 32
                               else args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always", error_model="numpy")
def f16_to_f32(h):
    """uint16 IEEE half bits -> float32, exact for every finite value.

    Move sign, exponent and mantissa to their float32 places (the 5-bit
    exponent lands in the low bits of float32's 8-bit one, i.e. the value is
    scaled by 2^-112), then multiply by 2^112. Half subnormals come out right
    too. (LLVM's own `fpext half` is one instruction, but this LLVM build hits
    an assertion when it vectorises it, so we avoid the half type entirely.)
    Scales are read once per group, so the few integer ops cost nothing."""
    b = np.int64(h)
    bits = ((b & 0x8000) << 16) | ((b & 0x7FFF) << 13)
    return _u32_as_f32(bits) * np.float32(5.192296858534828e33)  # 2^112


# ---------------------------------------------------------------------------
# Quantized matmul, decode path: out[t, r] = sum_k x[t, k] * W[r, k].
# x: [T, Kp] f32 (Kp = in_features padded to whole groups), out: [T, O] f32.
# Used for T up to a few tokens (quant.PREFILL_MIN_T): each weight row is read
# from memory once and reused from L1 for all T tokens.
# Per core, converting the weights in registers costs bf16 least (a shift), int8
# more (widen, convert) and int4 most (two nibbles, a floor): a core converts
# 10-20 G weights/s of int8 / int4. With a few cores per memory channel, bf16 and
# int8 are then memory-bound and int4 (0.56 byte/weight) compute-bound
# (docs/benchmarks.md has the figures).


@_inline
def row_f32(x, t, w, r):
    """x[t] . w[r]: x [T, K] f32, w [O, K] f32."""
    acc = np.float32(0.0)
    for k in range(x.shape[1]):
        acc += w[r, k] * x[t, k]
    return acc


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_f32(x, w, out):
    """x: [T, K] f32, w: [O, K] f32 -> out: [T, O]. Decode only: BLAS would do the
    same, but OpenBLAS's worker threads keep spinning after each call and starve
    the numba threads of the kernels that follow (measured: fp32 decode of the
    default model in the chat became about ten times slower when the two alternated)."""
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


# Indexing style, for all kernels below: plain a[r, g, j] with every index a
# loop counter. Numba then knows each index is >= 0 (no wrap-around select) and
# creates no array views (a view costs two atomic reference-count updates,
# which two threads sharing x would bounce between their cores). The group
# size stays a runtime value: a compile-time constant made LLVM fully unroll
# the group loop, which was not faster and tripped an assertion in this LLVM.


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
                + hi_part * f16_to_f32(s[r, 2 * p + 1]) + f16_to_f32(m[r, 2 * p + 1]) * xsum[t, p, 1])
    # exercise 1.11 end
    return acc


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_int4(x4, q, s, m, out):
    """x4: [T, G/2, 2, gs] f32 (x split into pairs of groups, a view);
    q: [O, G/2, gs] uint8; s, m: [O, G] fp16 bits, scale and minimum per group.

    Byte j of pair p holds weight j of group 2p in its low nibble and weight j
    of group 2p+1 in its high nibble (llama.cpp's Q4 layout with the two
    halves of its block given their own scales). Both nibbles of a byte
    multiply contiguous activations, and the inner loop runs over a whole
    group (64 bytes at gs=64), long enough for full-width vector code.
    W = nibble * s + m, hence a group's dot product is
        s * sum(nibble * x) + m * sum(x)
    where sum(x) is shared by every row, computed once per call.
    """
    T, O = x4.shape[0], q.shape[0]
    xsum = np.empty((T, x4.shape[1], 2), dtype=np.float32)   # [T, G/2, 2] sum of each group of x
    for t in range(T):
        group_sums(x4, t, xsum)
    for r in prange(O):
        for t in range(T):
            out[t, r] = row_int4(x4, xsum, t, q, s, m, r)


# ---------------------------------------------------------------------------
# Dequantize selected rows to fp32: the embedding lookup, and the fp32 tile
# that the prefill path hands to BLAS (a block of rows, never the whole matrix).
# ids: [R] int64; out: [R, Kp] f32, viewed in the weight's group layout.
# Serial on purpose: in prefill the BLAS call that follows uses both cores, and
# OpenBLAS's worker keeps spinning between calls; numba threads started now
# would fight it for the cores.


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
                out[i, p, 0, j] = (byte - np.float32(16.0) * np.floor(byte * np.float32(0.0625))) * s0 + m0
            for j in range(gs):
                byte = np.float32(q[r, p, j])
                out[i, p, 1, j] = np.floor(byte * np.float32(0.0625)) * s1 + m1

