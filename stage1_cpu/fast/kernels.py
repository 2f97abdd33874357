"""The fast path's kernels: int8 / int16 activations at decode, the bf16 GEMM at prefill.

Changed from the core (stage1_cpu/matmul.py): the core's matvecs turn every
weight into a float32 and multiply it by a float32 activation. Here the
activations are rounded once per matvec (to int8, or int16 for the lm_head),
and each group's dot product is integer multiply-adds done by the CPU's own
dot-product instructions (simd.py), in register tiles over weights stored 8 rows
side by side (tiles.py): `diff` matmul.matmul_int8 against matmul_tiled below
shows the loops' side of the change. bf16 weights' prefill can round its
activations to bf16 and run a vdpbf16ps GEMM instead of fp32 tiles through BLAS.

These kernels call simd.py's intrinsics, so they are compiled only on a CPU that
has those instructions: stage1_cpu/fast/__init__.py decides, in Python, before
anything here is compiled, and the core imports this package only for --kernels fast / auto.
Each has a numpy twin: fast/weight.py (FastWeight.matmul_ref, quantize_activations).
"""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import simd, tiles
from ..kernels import FAST
from ..matmul import _inline, _u32_as_f32
from .blocks import DECODE_BLOCK_BYTES
from .tiles import ROWS


# ---------------------------------------------------------------------------
# Decode with rounded activations (where the CPU has an integer dot product:
# AVX-512 VNNI / AVX-VNNI, AVX2's pair of multiply-adds, ARM's sdot; simd.py):
# each token's activations are rounded per group once per matvec, to int8 (or
# int16, for the lm_head), and the weights, stored in 8-row tiles (tiles.py),
# meet them in integer multiply-adds. llama.cpp does the same for its Q8_0 /
# Q4_0 weights.
# ---------------------------------------------------------------------------


@intrinsic
def f32_bits(typingctx, x):
    """The 32 bits of a float32, as an int32."""
    return (types.int32(types.float32),
            lambda context, builder, sig, args: builder.bitcast(args[0], ir.IntType(32)))


@_inline
def group_amax(x3, t, g):
    """max |x| over token t's group g, and the group's poison: NaN where it holds a NaN or an inf,
    else 0. From the values' bits, |x| being the bits without the sign: an integer max vectorises,
    where a float max that has to mind NaNs does not, and the largest bits past inf's say NaN or
    inf."""
    bits = np.int32(0)
    for j in range(x3.shape[2]):
        bits = max(bits, f32_bits(x3[t, g, j]) & np.int32(0x7FFFFFFF))
    return _u32_as_f32(bits), np.float32(np.nan) if bits >= 0x7F800000 else np.float32(0.0)


@_inline
def quantize_token(x3, t, xq, xcorr, xs, xsum):
    """Token t of quantize_activations, into the given arrays."""
    for g in range(x3.shape[1]):
        amax, poison = group_amax(x3, t, g)
        scale = amax / np.float32(127.0)
        inv = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
        total = np.int32(0)                     # |sum| <= 127 gs: int32 lanes
        for j in range(x3.shape[2]):
            v = np.int32(np.rint(x3[t, g, j] * inv))
            xq[t, g, j] = v
            total += v
        xcorr[t, g] = -tiles.BIAS * total       # the VNNI tiles' sums start from it
        xs[t, g] = scale + poison               # a NaN / inf in x makes its group's output NaN
        xsum[t, g] = np.float32(total) * scale + poison


@njit(cache=True, fastmath=FAST, error_model="numpy")
def quantize_activations(x3):
    """x3 [T, G, gs] f32 -> xq [T, G, gs] int8, xcorr [T, G] int32, xs [T, G] f32, xsum [T, G] f32.
    x ~ xq * xs, with xs = max |x| / 127 per group (round to nearest even); xsum = xs * sum(xq),
    the group's sum of the rounded x (the int4 minimum multiplies it); xcorr = -128 sum(xq) on
    VNNI (tiles.BIAS), else 0. A NaN or inf in a group sets its xs and xsum to NaN, so it reaches
    the output as in the float kernels. The numpy twin: fast/weight.py's quantize_activations."""
    T, G, gs = x3.shape
    xq = np.empty((T, G, gs), dtype=np.int8)
    xcorr = np.empty((T, G), dtype=np.int32)
    xs = np.empty((T, G), dtype=np.float32)
    xsum = np.empty((T, G), dtype=np.float32)
    for t in range(T):
        quantize_token(x3, t, xq, xcorr, xs, xsum)
    return xq, xcorr, xs, xsum


@_inline
def quantize_token16(x3, t, x16, xs, xsum):
    """Token t of quantize_activations16, into the given arrays."""
    for g in range(x3.shape[1]):
        amax, poison = group_amax(x3, t, g)
        scale = amax / np.float32(32767.0)
        inv = np.float32(1.0) / scale if scale > 0 else np.float32(0.0)
        total = np.int32(0)                     # |sum| <= 32767 gs
        for j in range(x3.shape[2]):
            v = np.int32(np.rint(x3[t, g, j] * inv))
            x16[t, g, j] = v
            total += v
        xs[t, g] = scale + poison
        xsum[t, g] = np.float32(total) * scale + poison     # exact: |total| < 2^24


@njit(cache=True, fastmath=FAST, error_model="numpy")
def quantize_activations16(x3):
    """x3 [T, G, gs] f32 -> x16 [T, G, gs] int16, xs [T, G] f32, xsum [T, G] f32: x ~ x16 * xs with
    xs = max |x| / 32767 per group (round to nearest even), xsum = xs sum(x16); NaN / inf as in
    quantize_activations. The numpy twin: fast/weight.py's quantize_activations(..., 32767)."""
    T, G, gs = x3.shape
    x16 = np.empty((T, G, gs), dtype=np.int16)
    xs = np.empty((T, G), dtype=np.float32)
    xsum = np.empty((T, G), dtype=np.float32)
    for t in range(T):
        quantize_token16(x3, t, x16, xs, xsum)
    return x16, xs, xsum


@_inline
def tile_rows(x, xoff, xs, xcorr, xsum, xsoff, w, wblock, s, m, G, gs, out, ooff, ostride, v0, v1,
              T, k8_8, k8_16, k4_8, k4_16):
    """Blocks v0..v1 (8 rows each) of a tiled matrix (w, s, m flat: wblock bytes a block) by T
    tokens' rounded activations (flat, from xoff and xsoff)
    -> out[ooff + t ostride + 8 (v - v0) + l].
    k*: the one kind this matrix is (weights . activations: int8 . int8, int8 . int16, int4 . int8,
    int4 . int16) True, the others None (compiled out)."""
    Kp = G * gs
    if k8_8 is not None:
        tiles.blocks_int8_q8(w, wblock, x, xoff, Kp, s, xs, xcorr, xsum, xsoff, m, G, gs, out,
                             ooff, ostride, v0, v1, T)
    elif k8_16 is not None:
        tiles.blocks_int8_q16(w, wblock, x, xoff, Kp, s, xs, xcorr, xsum, xsoff, m, G, gs, out,
                              ooff, ostride, v0, v1, T)
    elif k4_8 is not None:
        tiles.blocks_int4_q8(w, wblock, x, xoff, Kp, s, xs, xcorr, xsum, xsoff, m, G, gs, out,
                             ooff, ostride, v0, v1, T)
    elif k4_16 is not None:
        tiles.blocks_int4_q16(w, wblock, x, xoff, Kp, s, xs, xcorr, xsum, xsoff, m, G, gs, out,
                              ooff, ostride, v0, v1, T)


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_tiled(x, xs, xcorr, xsum, data, scales, mins, out, workers, k8_8, k8_16, k4_8, k4_16):
    """x [T, Kp] rounded activations (int8 or int16), xs, xcorr, xsum [T, G]; data [V, ...] the
    tiled weights, scales, mins [V, G, 8] -> out [T, 8 V]: every block of 8 rows by every token,
    the blocks shared out between the threads in runs of ~DECODE_BLOCK_BYTES (each thread reads
    long sequential streams)."""
    T, Kp = x.shape
    V, G = scales.shape[0], scales.shape[1]
    gs = Kp // G
    wblock = data.size // V
    per = min(-(-V // (4 * workers)), max(1, DECODE_BLOCK_BYTES // wblock))
    per = -(-per // 8) * 8                          # whole tiles of every shape (RB divides 8)
    xf, xsf, xcf, xsumf, of = (x.reshape(-1), xs.reshape(-1), xcorr.reshape(-1),
                               xsum.reshape(-1), out.reshape(-1))
    w, s, m = data.reshape(-1), scales.reshape(-1), mins.reshape(-1)
    for c in prange(-(-V // per)):
        v0 = c * per
        tile_rows(xf, 0, xsf, xcf, xsumf, 0, w, wblock, s, m, G, gs, of, ROWS * v0, out.shape[1],
                  v0, min(V, v0 + per), T, k8_8, k8_16, k4_8, k4_16)


# ---------------------------------------------------------------------------
# bf16 prefill GEMM (where the CPU has AVX-512 BF16; see simd.py): x rounded to
# bf16 pairs once, then each thread takes 16-row panels of W, packs a panel
# (32 KB at K=1024, it stays in L1/L2) and runs simd.dot_bf16_panel over the
# tokens, 8 at a time: at T=512 about twice OpenBLAS sgemm's FLOP/s (docs/benchmarks.md).
# ---------------------------------------------------------------------------


@njit(cache=True, error_model="numpy")
def bf16_pairs(x, tokens):
    """x [T, K] f32 (K even) -> [Tp, K/2] uint32: bf16(x[t, 2k2]) in the low half,
    bf16(x[t, 2k2+1]) in the high half, rounded to nearest even; Tp = T rounded
    up to a multiple of `tokens`, the extra rows zero."""
    T, K = x.shape
    Tp = -(-T // tokens) * tokens
    out = np.zeros((Tp, K // 2), dtype=np.uint32)
    u = x.view(np.uint32)
    for t in range(T):
        for k2 in range(K // 2):
            out[t, k2] = _bf16_bits(u[t, 2 * k2]) | (_bf16_bits(u[t, 2 * k2 + 1]) << np.uint32(16))
    return out


@njit(inline="always", error_model="numpy")
def _bf16_bits(u):
    """float32 bits -> bf16 bits, round half to even; NaN stays NaN (as quant.f32_to_bf16_bits)."""
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return (u >> np.uint32(16)) | np.uint32(0x40)
    return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@intrinsic
def _f32_bits(typingctx, x):
    """float32 -> its 32 bits as uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(parallel=True, cache=True, error_model="numpy")
def matmul_bf16_prefill(xb, w2, out):
    """xb [Tp, K2] uint32 from bf16_pairs; w2 [O, K2] uint32 (the bf16 weight
    [O, K] viewed as pairs) -> out [T, O] f32, T <= Tp."""
    Tp, K2 = xb.shape
    O = w2.shape[0]
    T = out.shape[0]
    xf = xb.reshape(-1)
    for p in prange(-(-O // simd.PANEL)):
        o0 = p * simd.PANEL
        rows = min(simd.PANEL, O - o0)
        # [K2, 16]: the panel transposed, so one load gives 16 rows at one k2 (zeros past O)
        panel = np.zeros((K2, simd.PANEL), dtype=np.uint32)
        for i in range(rows):
            for k2 in range(K2):
                panel[k2, i] = w2[o0 + i, k2]
        pf = panel.reshape(-1)
        res = np.empty(simd.TOKENS * simd.PANEL, dtype=np.float32)   # [TOKENS, 16]
        for t0 in range(0, Tp, simd.TOKENS):
            simd.dot_bf16_panel(pf, xf, t0 * K2, K2, res)
            for t in range(min(simd.TOKENS, T - t0)):
                for i in range(rows):
                    out[t0 + t, o0 + i] = res[t * simd.PANEL + i]

