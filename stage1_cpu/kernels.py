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
  contiguous memory, which LLVM turns into the CPU's vector code. `fastmath` is limited
  to {"reassoc", "contract"}: reassociation lets LLVM split a sum into vector
  lanes, contraction gives fused multiply-adds. We never assume "no NaN / no
  inf", so a NaN or inf in the activations propagates as it does in numpy.
- Work is split over output rows with `prange` (one chunk per thread, so each
  thread streams one contiguous slice of the matrix).
- A parallel region costs tens of microseconds to start when idle threads sleep
  (OMP_WAIT_POLICY=PASSIVE; about a microsecond when they spin): far more than a one-token
  norm takes, so the small element-wise ops have serial variants that the
  wrappers pick for few tokens.
- Prefill matmuls and attention hand the heavy lifting to BLAS (numpy's
  OpenBLAS): for T tokens at once that is compute-bound work, and BLAS's GEMM
  is 3x faster than anything these loops turn into.
- numba's np.exp is a scalar libm call; softmax and SiLU use exp_f32, a
  polynomial that vectorises (7x faster).
- `cache=True` stores the machine code on disk, so only the first run ever
  compiles (stage1_cpu/__init__.py keys that cache on the sources of the whole
  package, since numba itself notices edits to a kernel's own file only).

Nothing here names a CPU instruction: LLVM picks the vector instructions of
whatever CPU runs it (SSE2, AVX2, AVX-512, NEON). The row bodies are `_inline`
helpers so that stage1_cpu/fast/ can run the same bodies in its one-region
decode step (and get the same bits); its int8-activation and bf16 kernels,
which do name instructions, live there too.
"""

import math
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

# reassoc: let LLVM split reductions over vector lanes; contract: allow FMA.
# Every kernel also sets error_model="numpy": x / 0 gives inf instead of raising,
# which removes a branch per division (with it, silu_mul did not vectorise: 6x).
FAST = {"reassoc", "contract"}

# Each kernel's body for one row (one output row of a matmul, one token of a norm)
# is an _inline helper: the prange kernels below loop over it, and so does
# fast/decode_step.py, which runs a whole decode step in one parallel region. One
# body, two callers: both compute bit for bit the same. Serial and parallel loops must be
# separate Python functions: numba's on-disk cache tells functions apart by their
# code, not by parallel=True.
_inline = njit(inline="always", fastmath=FAST, error_model="numpy")
_serial = njit(cache=True, fastmath=FAST, error_model="numpy")
_parallel = njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")


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


@njit(inline="always", fastmath=FAST, error_model="numpy")
def exp_f32(x):
    """exp(x) in float32 to ~2 ulp (measured max rel. error 2.3e-7), in plain
    arithmetic that LLVM vectorises: 7x faster here than np.exp, which numba
    turns into one libm call per element. Inputs are clamped to [-87, 88], so
    exp(-inf) gives 1.6e-38 rather than 0 (no caller relies on exact 0).
        exp(x) = 2^n * exp(r),  n = round(x / ln2),  r = x - n ln2 in [-ln2/2, ln2/2]
    """
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


# ---------------------------------------------------------------------------
# Quantized matmul, decode path: out[t, r] = sum_k x[t, k] * W[r, k].
# x: [T, Kp] f32 (Kp = in_features padded to whole groups), out: [T, O] f32.
# Used for T up to a few tokens (quant.PREFILL_MIN_T): each weight row is read
# from memory once and reused from L1 for all T tokens.
# Per core, converting the weights in registers costs bf16 least (a shift), int8
# more (widen, convert) and int4 most (two nibbles, a floor): a core converts
# 10-20 G weights/s of int8 / int4. With a few cores per memory channel, bf16 and
# int8 are then memory-bound and int4 (0.56 byte/weight) compute-bound
# (docs/benchmarks.md, log: Figures moved out of the stage-1 docstrings).
# ---------------------------------------------------------------------------


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
    default model in the chat became about ten times slower when the two alternated;
    docs/benchmarks.md, log: Figures moved out of the stage-1 docstrings)."""
    T, O = x.shape[0], w.shape[0]
    for r in prange(O):
        for t in range(T):
            out[t, r] = row_f32(x, t, w, r)


# Decode matvecs give each thread whole blocks of rows, in order: long sequential
# streams for the hardware prefetcher, and few enough blocks that scheduling costs nothing.
DECODE_BLOCK_BYTES = 1 << 18   # weights per block of rows of the decode matvecs (~10 us)


@_inline
def decode_block(O, row_bytes):
    """Rows per block: ~DECODE_BLOCK_BYTES of weights, whole groups of 4 rows."""
    rows = min(O, max(1, DECODE_BLOCK_BYTES // row_bytes))
    return max(4, rows + (-rows) % 4)


@_inline
def rows4_bf16(x, t, w, r, m):
    """x[t] . w[r + i m] for i = 0..3, in one pass over x[t]: four rows m apart are
    four sequential streams (the prefetcher follows them, rows_int8_q8), and each
    activation is loaded once for the four (the hot loop: 2 bytes per weight,
    converted by a shift). Each row has its own sum, so a row's
    result does not depend on its company (m = 0: four times row r)."""
    a0, a1, a2, a3 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
    for k in range(x.shape[1]):
        xk = x[t, k]
        a0 += bf16_to_f32(w[r, k]) * xk
        a1 += bf16_to_f32(w[r + m, k]) * xk
        a2 += bf16_to_f32(w[r + 2 * m, k]) * xk
        a3 += bf16_to_f32(w[r + 3 * m, k]) * xk
    return a0, a1, a2, a3


@_inline
def rows_bf16(x, t, w, r0, r1, outf, ooff):
    """outf[ooff + r] = x[t] . w[r] for r0 <= r < r1: four rows per pass, a quarter of
    the range apart; the last (r1 - r0) % 4 rows one at a time, by the same body."""
    n4 = (r1 - r0) // 4
    for b in range(r0, r0 + n4):
        a0, a1, a2, a3 = rows4_bf16(x, t, w, b, n4)
        outf[ooff + b] = a0
        outf[ooff + b + n4] = a1
        outf[ooff + b + 2 * n4] = a2
        outf[ooff + b + 3 * n4] = a3
    for r in range(r0 + 4 * n4, r1):
        outf[ooff + r] = rows4_bf16(x, t, w, r, 0)[0]


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_bf16(x, w, out):
    """x: [T, K] f32, w: [O, K] uint16 bf16 bits -> out: [T, O] (contiguous)."""
    T, O = x.shape[0], w.shape[0]
    outf = out.reshape(-1)
    block = decode_block(O, 2 * w.shape[1])         # each thread takes whole blocks, in order
    for c in prange(-(-O // block)):
        for t in range(T):
            rows_bf16(x, t, w, c * block, min(O, (c + 1) * block), outf, t * O)


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
    for g in range(G):
        # integer weights times fp32 activations, scaled once per group
        part = np.float32(0.0)
        for j in range(gs):
            part += np.float32(q[r, g, j]) * x3[t, g, j]
        acc += part * f16_to_f32(s[r, g])
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
# Matvecs over segments of one matrix (the routed experts of a MoE layer at
# decode, stacked into one matrix per projection): out[s, i] = x[s] . W[starts[s] + i]
# for i < n. One parallel region serves all k chosen experts, instead of one per
# expert and projection (2k starts per layer), so both threads stream expert
# weights the whole time. Blocks of rows never cross a segment; each row is the
# same body as in the matmul kernels above, so a segment's result is, bit for bit,
# its expert's own matmul.
# ---------------------------------------------------------------------------


@_inline
def segment_block(n, row_bytes):
    """Rows per block of a segment, and blocks per segment."""
    block = decode_block(n, row_bytes)
    return block, -(-n // block)


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def segments_f32(x, w, starts, out):
    """x [S, K], w [O, K] f32, starts [S] -> out [S, n]."""
    S, n = out.shape
    for j in prange(S * n):
        s, i = j // n, j % n
        out[s, i] = row_f32(x, s, w, starts[s] + i)


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def segments_bf16(x, w, starts, out):
    """x [S, K] f32, w [O, K] bf16 bits, starts [S] -> out [S, n] (contiguous)."""
    S, n = out.shape
    outf = out.reshape(-1)
    block, per = segment_block(n, 2 * w.shape[1])
    for j in prange(S * per):
        s, b = j // per, j % per
        r0 = starts[s] + b * block
        rows_bf16(x, s, w, r0, min(starts[s] + n, r0 + block), outf, s * n - starts[s])


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def segments_int8(x3, q, sc, starts, out):
    """x3 [S, G, gs] f32, q [O, G, gs] int8, sc [O, G] fp16 bits, starts [S] -> out [S, n]."""
    S, n = out.shape
    for j in prange(S * n):
        s, i = j // n, j % n
        out[s, i] = row_int8(x3, s, q, sc, starts[s] + i)


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def segments_int4(x4, q, sc, m, starts, out):
    """x4 [S, G/2, 2, gs] f32, q [O, G/2, gs] uint8, sc, m [O, G] fp16 bits -> out [S, n]."""
    S, n = out.shape
    xsum = np.empty((S, x4.shape[1], 2), dtype=np.float32)   # [S, G/2, 2] sum of each group of x
    for s in range(S):
        group_sums(x4, s, xsum)
    for j in prange(S * n):
        s, i = j // n, j % n
        out[s, i] = row_int4(x4, xsum, s, q, sc, m, starts[s] + i)


# ---------------------------------------------------------------------------
# Dequantize selected rows to fp32: the embedding lookup, and the fp32 tile
# that the prefill path hands to BLAS (a block of rows, never the whole matrix).
# ids: [R] int64; out: [R, Kp] f32, viewed in the weight's group layout.
# Serial on purpose: in prefill the BLAS call that follows uses both cores, and
# OpenBLAS's worker keeps spinning between calls; numba threads started now
# would fight it for the cores.
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Element-wise and normalisation ops: numba twins of ops.py. Serial bodies,
# with a parallel variant used when there are many tokens (prefill).
# ---------------------------------------------------------------------------


# Each op is written once, for one row, as an inlined helper (_inline, top of
# the file); a serial and a parallel (prange) loop call it.


@_inline
def rmsnorm_row(x2, w, eps, out2, t):
    C = x2.shape[1]
    ss = np.float32(0.0)
    for c in range(C):
        ss += x2[t, c] * x2[t, c]
    rms = np.sqrt(ss / np.float32(C) + np.float32(eps))
    for c in range(C):
        out2[t, c] = x2[t, c] / rms * w[c]


@_serial
def _rmsnorm_serial(x2, w, eps, out2):
    for t in range(x2.shape[0]):
        rmsnorm_row(x2, w, eps, out2, t)


@_parallel
def _rmsnorm_parallel(x2, w, eps, out2):
    for t in prange(x2.shape[0]):
        rmsnorm_row(x2, w, eps, out2, t)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: [T, C] with w [C], or [T, H, D] with w [D]: normalise the last axis."""
    x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])  # [rows, last]
    out = np.empty_like(x2)
    (_rmsnorm_parallel if x2.shape[0] >= 64 else _rmsnorm_serial)(x2, w, eps, out)
    return out.reshape(x.shape)


@_inline
def silu_mul_row(gate_up, out, t):
    F = out.shape[1]
    for f in range(F):
        g = gate_up[t, f]
        out[t, f] = g / (np.float32(1.0) + exp_f32(-g)) * gate_up[t, F + f]


@_serial
def _silu_mul_serial(gate_up, out):
    for t in range(out.shape[0]):
        silu_mul_row(gate_up, out, t)


@_parallel
def _silu_mul_parallel(gate_up, out):
    for t in prange(out.shape[0]):
        silu_mul_row(gate_up, out, t)


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """[T, 2F] = [gate | up] (the fused projection's output) -> silu(gate) * up [T, F].
    Taking the fused array whole keeps it contiguous: given its two column halves
    (strided views), numba's loop did not vectorise and ran 20x slower (measured)."""
    gate_up = np.ascontiguousarray(gate_up)
    T, F = gate_up.shape[0], gate_up.shape[1] // 2
    out = np.empty((T, F), dtype=np.float32)
    (_silu_mul_parallel if T >= 16 else _silu_mul_serial)(gate_up, out)
    return out


# ---------------------------------------------------------------------------
# MoE: the router's choice, and the weighted sum of the chosen experts' outputs.
# Per token, serial: E and k are small (128 and 8 for Qwen3-30B-A3B).
# ---------------------------------------------------------------------------


@_inline
def route_row(logits, t, k, norm, top, weight):
    """ops.route for token t: logits [T, E] -> top [T, k] int64, weight [T, k] f32."""
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
    half = x.shape[2] // 2
    for i in range(half):
        x1 = x[t, h, i]
        x2 = x[t, h, half + i]
        out[t, h, i] = x1 * cos[t, i] - x2 * sin[t, i]
        out[t, h, half + i] = x2 * cos[t, i] + x1 * sin[t, i]


@_inline
def _rope_row(x, cos, sin, out, t):
    for h in range(x.shape[1]):
        rope_head(x, cos, sin, out, t, h)


@_serial
def _rope_serial(x, cos, sin, out):
    for t in range(x.shape[0]):
        _rope_row(x, cos, sin, out, t)


@_parallel
def _rope_parallel(x, cos, sin, out):
    for t in prange(x.shape[0]):
        _rope_row(x, cos, sin, out, t)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE. x: [T, H, D], cos/sin: [T, D/2]."""
    out = np.empty_like(x)
    (_rope_parallel if x.shape[0] >= 16 else _rope_serial)(x, cos, sin, out)
    return out


# ---------------------------------------------------------------------------
# Attention over the KV cache.
# ---------------------------------------------------------------------------


@_inline
def attention_item(q, k_cache, v_cache, start_pos, out, item):
    """One (KV head, query) pair: all `group` query heads of KV head kvh for query t."""
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


# one work item per (KV head, query): the item serves all `group` query heads
# of its KV head, so each key and value row is read once for the group (at
# decode the cache reads are the cost: this halves them for Qwen3's 16/8)
@_serial
def _attention_serial(q, k_cache, v_cache, start_pos, out):
    for item in range(k_cache.shape[0] * q.shape[0]):
        attention_item(q, k_cache, v_cache, start_pos, out, item)


@_parallel
def _attention_parallel(q, k_cache, v_cache, start_pos, out):
    for item in prange(k_cache.shape[0] * q.shape[0]):
        attention_item(q, k_cache, v_cache, start_pos, out, item)


@_serial
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


# Prefill attention is two matrix products per KV head, (queries x keys) then
# (probabilities x values): BLAS does those 3x faster than the numba loops.
# Query blocks of ATT_BLOCK skip most of the causally masked upper triangle.
ATT_BLOCK = 128
ATT_BLAS_MIN_T = 16


def _attention_blas(q, k_cache, v_cache, start_pos, out):
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


ATT_WORK_PER_START_US = 40_000   # decode attention goes parallel from 40k multiply-adds per us of start cost


@njit(parallel=True, cache=True)
def _empty_region(out):
    for i in prange(out.shape[0]):
        out[i] = i


_START_COST: list[float] = []


def parallel_start_cost() -> float:
    """Median seconds to start and join an empty parallel region, measured on first use
    (~100 calls): about a microsecond when idle threads spin (OpenMP's default), tens of
    microseconds with OMP_WAIT_POLICY=PASSIVE, where the sleeping thread must be woken
    (on a VM, its vCPU too; docs/benchmarks.md, log: Figures moved out of the stage-1
    docstrings)."""
    if not _START_COST:
        out = np.zeros(2)
        _empty_region(out)
        ts = []
        for _ in range(100):
            t0 = time.perf_counter()
            _empty_region(out)
            ts.append(time.perf_counter() - t0)
        _START_COST.append(float(np.median(ts)))
    return _START_COST[0]


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start_pos: int) -> np.ndarray:
    """q: [T, H, D]; k_cache, v_cache: [Hkv, Tmax, D]; query t sits at position
    start_pos + t and attends to cache positions 0 .. start_pos + t."""
    T, H, D = q.shape
    if H % k_cache.shape[0]:
        raise ValueError(f"{H} query heads cannot share {k_cache.shape[0]} KV heads evenly")
    out = np.empty_like(q)
    if T >= ATT_BLAS_MIN_T:
        _attention_blas(q, k_cache, v_cache, start_pos, out)
        return out
    # work ~ H * T * context * D multiply-adds; two threads halve it, but only pay once the
    # work outweighs starting them. With threads that spin (a start of about a microsecond)
    # that is almost always; with sleeping threads (tens of microseconds) only from about a
    # thousand positions at 16/8 heads, D=128
    # (docs/benchmarks.md, log: Figures moved out of the stage-1 docstrings),
    # so the threshold follows the start cost, measured once (parallel_start_cost).
    work = H * T * (start_pos + T) * D
    parallel = work >= ATT_WORK_PER_START_US * parallel_start_cost() * 1e6
    (_attention_parallel if parallel else _attention_serial)(q, k_cache, v_cache, start_pos, out)
    return out
