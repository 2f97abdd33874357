"""Prefill on integers: an integer-activation GEMM with register tiles on repacked weights.

Why (docs/stage1.md, "Prefill on integers"): the core's prefill dequantizes
ROW_BLOCK rows to an fp32 tile and hands it to BLAS sgemm, one fp32
multiply-add per weight and token, 8 per FMA instruction. Here the
activations are rounded per token and group to int16 (--activations auto,
kernels.quantize_activations16) or to int8, exactly as decode does
(--activations int8, kernels.quantize_activations), and each group's dot
product is integer multiply-adds: 16 per vpmaddwd (int8 or int4 weights as
int16 pairs x int16 or int8 activations) or 32 per vpmaddubsw (int4 weights
on int8 activations only: unsigned nibbles x int8).

The repacked layout. Eight rows sit side by side: for each group and each step
of k, one 16- or 32-byte vector holds that step's weights of the 8 rows,

    "pairs"  [8 rows / 8, G, gs/2, 8, 2] int8    8 rows x 2 values: vpmovsxbw -> vpmaddwd
                                                 (int8 weights, or int4 ones as bytes 0..15)
    "quads"  [8 rows / 8, G, gs/4, 8, 4] uint8   8 rows x 4 nibble values: vpmaddubsw

so one vector instruction multiplies 8 rows by the same 2 (or 4) activations of
one token, broadcast to all lanes (vpbroadcastd). Lane i of the accumulator then
*is* row i: no horizontal sums, the per-group scale multiply runs on 8 rows at
once (s [.., G, 8] f32 times the token's xs[t, g] broadcast), and 8 outputs of
a token are stored as one vector. Each thread repacks BLOCK_RB x 8 rows at a
time from the stored [O, G, gs] layout into a scratch buffer of its own
(repack_int8 / repack_int4), then runs every token through them: no copy of
the weights is kept, and the repack moves each byte once per T multiply-adds.
int4's two groups in the same bytes (low and high nibbles) come out of one
transpose; the scales stay fp16 (one vcvtph2ps per 8 rows in the tile's
epilogue). The threads claim the blocks one at a time from a shared counter
(sync.claim), each its next one ahead, whose rows are prefetched while the
current one multiplies: a thread that runs slower (a VM's busy neighbour, a
core with other work) takes fewer blocks instead of holding the others up.

The micro-kernel (_tile) keeps RB x 8 rows x TT tokens (RB8 x TT8, RB4 x TT4) of accumulators in
registers (AVX2 has 16 ymm registers, AVX-512 32: RB x TT int32 accumulators, RB x TT float
ones, RB weight vectors and the broadcasts): each weight vector loaded serves TT
tokens, each broadcast serves RB x 8 rows. With 32 registers the pairs tile is 32 rows x 4
tokens: 16 independent int32 accumulators, where 16 x 4 has 8 (the instruction's measured peak needs
12 a thread); the float ones, touched once per group, may wait in memory. Per group the int32 lanes (a whole
group's, gs <= 256: |sum| <= 128 x 2 x 127 x 32767 < 2^31) are converted to float
and multiply-added with the group's scale product:

    out[t, r] = sum_g s[r, g] xs[t, g] (q[r, g] . xq[t, g])          int8
              + sum_g m[r, g] xsum[t, g]                             int4 (its minimum)

    tile_int8     pairs x int16 (or int8 activations widened)        int8 weights
    tile_int4_16  pairs x int16, plus the minimum                    int4 weights, act int16
    tile_int4     quads x int8, plus the minimum                     int4 weights, act int8
    tile_int8_q8  quads (q + 128) x int8, from -128 sum(xq)          int8 weights, act int8, VNNI / sdot

quads on AVX2: nibble x int8 pair sums (<= 2 x 15 x 127) add up in int16 over one chunk
of 32 values (8 steps), then one vpmaddwd by ones widens them into the group's int32.

Instructions (cpu.INT8): on AVX2 vpmaddwd + vpaddd (pairs) and vpmaddubsw (quads);
on VNNI vpdpwssd (pairs: the same 16 multiply-adds, the accumulate fused) and
vpdpbusd (quads: 32 multiply-adds straight into int32). vpdpbusd multiplies
unsigned bytes by signed ones: nibbles are unsigned already, and int8 weights
become q + 128 in the repack, their group's sums starting from -128 sum(xq)
(tile_int8_q8): (q + 128) . xq - 128 sum(xq) = q . xq, exactly. On AVX2 int8
weights meet int8 activations widened to int16 (vpmaddubsw's pair sums would
saturate at 255 x 127 x 2), so there int8 activations gain nothing over int16.
On ARM64 (cpu.INT8 "sdot") the quads run on sdot, signed bytes by signed bytes: int8
weights go in as they are (BIAS 0: no flip, the sums start from 0). ARM has no int16 dot
product, so --activations auto keeps prefill on sgemm there (cpu.INT16_GEMM), and only
--activations int8 reaches this GEMM.
None of it is compiled where cpu.INT8 is None: weight.py never calls it there.
The numpy twin: gemm_ref below.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..kernels import FAST
from . import cpu, simd
from . import kernels as fk
from .sync import SLOT, claim

VNNI = simd.VNNI              # vpdpwssd / vpdpbusd: the multiply-add and its accumulate in one instruction
SDOT = simd.SDOT              # ARM: sdot for the quads (signed x signed: int8 weights stay q, no correction)
BIAS = 0 if SDOT else 128     # tile_int8_q8's weights are q + BIAS, its sums start from -BIAS sum(xq)
REGISTERS = 32 if "avx512vl" in cpu.FEATURES else 16    # ymm registers (AVX-512VL adds ymm16..31)
RB8, TT8 = (4, 4) if REGISTERS == 32 else (2, 4)       # pairs: 8-row vectors x tokens per tile
RB4, TT4 = (2, 4) if VNNI or SDOT else (2, 2)   # quads: on AVX2 their int16 accumulators need registers too
BLOCK_RB = 8                  # 8-row vectors a thread takes at a time (64 rows x Kp bytes: in L2)
TOKEN_BLOCK = 48              # tokens per pass over a row block (48 x Kp activations: in L2 beside it)
CHUNK = 32                    # values per unrolled run of steps (quads: the int16 accumulators' limit)

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
BYTES32 = ir.VectorType(I8, 32)
BYTES16 = ir.VectorType(I8, 16)
SHORTS8 = ir.VectorType(I16, 8)
SHORTS16 = ir.VectorType(I16, 16)
INTS8 = ir.VectorType(I32, 8)
FLOATS8 = ir.VectorType(F32, 8)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _ptr(context, builder, aty, ary, elem, offset):
    """Pointer to element `offset` of a 1-D numba array, as elem*."""
    base = builder.bitcast(context.make_array(aty)(context, builder, ary).data, elem.as_pointer())
    return builder.gep(base, [offset])


def _splat(builder, v, vty):
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), v, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined), ir.Constant(INTS8, [0] * 8))


def _tile(context, builder, sig, args, quads, minimum, bias=False):
    """The body of tile_int8 / tile_int4 / tile_int4_16 / tile_int8_q8 (argument order in tile_int8's
    docstring): quads, the 4-values-a-lane layout for vpmaddubsw / vpdpbusd (else pairs, for vpmaddwd /
    vpdpwssd); minimum, the m xsum term; bias (tile_int8_q8, VNNI): the weights are q + 128, and each
    group's int32 sums start from xsum's int32 -128 sum(xq), its correction."""
    RB, TT = (RB4, TT4) if quads else (RB8, TT8)
    direct = VNNI or SDOT or not quads  # the int32 sums accumulate in the instruction (or vpmaddwd + vpaddd)
    (wp_, woff, x_, xoff, Kp, sp_, soff, xs_, xsoff, G, gs, mp_, xsum_, out_, ooff, ostride, n_rb, n_tok) = [
        context.cast(builder, a, t, types.int64) if isinstance(t, types.Integer) else a
        for a, t in zip(args, sig.args)]
    ty = sig.args
    c = lambda v: ir.Constant(I64, v)          # noqa: E731
    one = c(1)
    rbs = [builder.select(builder.icmp_signed("<", c(i), n_rb), c(i), builder.sub(n_rb, one)) for i in range(RB)]
    toks = [builder.select(builder.icmp_signed("<", c(t), n_tok), c(t), builder.sub(n_tok, one)) for t in range(TT)]
    vstride = builder.mul(Kp, c(8))                                     # bytes of one 8-row vector block
    wbase = _ptr(context, builder, ty[0], wp_, I8, woff)
    wps = [builder.gep(wbase, [builder.mul(r, vstride)]) for r in rbs]
    xelem = I8 if quads else I16                                        # quads: xq int8; pairs: x as int16
    xbase = _ptr(context, builder, ty[2], x_, xelem, xoff)
    xps = [builder.gep(xbase, [builder.mul(t, Kp)]) for t in toks]
    G8 = builder.mul(G, c(8))
    sps = [builder.gep(_ptr(context, builder, ty[5], sp_, I16, soff), [builder.mul(r, G8)]) for r in rbs]
    mps = [builder.gep(_ptr(context, builder, ty[11], mp_, I16, soff), [builder.mul(r, G8)]) for r in rbs]
    xsps = [builder.gep(_ptr(context, builder, ty[7], xs_, F32, xsoff), [builder.mul(t, G)]) for t in toks]
    xsumps = [builder.gep(_ptr(context, builder, ty[12], xsum_, I32 if bias else F32, xsoff), [builder.mul(t, G)])
              for t in toks]
    if not direct:                      # AVX2 quads only
        maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", INTS8, [SHORTS16, SHORTS16])
        maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", SHORTS16, [BYTES32, BYTES32])
    fma = _fn(builder, "llvm.fma.v8f32", FLOATS8, [FLOATS8] * 3)
    ones = ir.Constant(SHORTS16, [1] * 16)
    facc = [[cgutils.alloca_once_value(builder, ir.Constant(FLOATS8, None)) for _ in range(TT)] for _ in range(RB)]
    iacc = [[cgutils.alloca_once(builder, INTS8) for _ in range(TT)] for _ in range(RB)]   # one group's dots
    n_chunks = builder.udiv(gs, c(CHUNK))
    per = 4 if quads else 2                                             # values per lane and step
    steps = CHUNK // per
    with cgutils.for_range(builder, G) as gl:
        g = gl.index
        for t in range(TT):                 # each group's int32 sums start from zero (or the correction)
            start = _splat(builder, builder.load(builder.gep(xsumps[t], [g])), INTS8) if bias else \
                ir.Constant(INTS8, None)
            for r in range(RB):
                builder.store(start, iacc[r][t])
        gw = builder.mul(g, builder.mul(gs, c(8)))                      # the group's first byte in a vector block
        gx = builder.mul(g, gs)
        with cgutils.for_range(builder, n_chunks) as cl:
            cw = builder.add(gw, builder.mul(cl.index, c(CHUNK * 8)))
            cx = builder.add(gx, builder.mul(cl.index, c(CHUNK)))
            acc = [[builder.load(iacc[r][t]) if direct else ir.Constant(SHORTS16, None) for t in range(TT)]
                   for r in range(RB)]
            for j in range(steps):
                if quads:
                    ws = [builder.load(builder.bitcast(builder.gep(p, [builder.add(cw, c(32 * j))]),
                                                       BYTES32.as_pointer()), align=1) for p in wps]
                else:
                    ws = [builder.sext(builder.load(builder.bitcast(builder.gep(p, [builder.add(cw, c(16 * j))]),
                                                                    BYTES16.as_pointer()), align=1), SHORTS16)
                          for p in wps]
                bc = [builder.load(builder.bitcast(builder.gep(p, [builder.add(cx, c(per * j))]), I32.as_pointer()),
                                   align=1) for p in xps]
                bc = [builder.bitcast(_splat(builder, v, INTS8), BYTES32 if quads else SHORTS16) for v in bc]
                for t in range(TT):
                    for r in range(RB):
                        if quads and direct:    # 8 rows x 4 bytes . the token's 4 int8 values (sdot: 2 halves)
                            acc[r][t] = simd._vpdpbusd(builder, ws[r], bc[t], acc[r][t])
                        elif quads:             # AVX2: pairs of those products into int16 lanes
                            acc[r][t] = builder.add(acc[r][t], builder.call(maddubs, [ws[r], bc[t]]))
                        else:                   # 8 rows x 2 int16 . the token's 2 int16 values
                            acc[r][t] = simd._vpdpwssd(builder, acc[r][t], ws[r], bc[t])
            for r in range(RB):             # int32 holds a whole group; AVX2 quads: the int16 sums widened
                for t in range(TT):
                    dot = acc[r][t] if direct else builder.add(builder.load(iacc[r][t]),
                                                               builder.call(maddwd, [acc[r][t], ones]))
                    builder.store(dot, iacc[r][t])
        svs = [simd._halves8(builder, p, builder.mul(g, c(8))) for p in sps]     # 8 rows' fp16 scales
        xsb = [_splat(builder, builder.load(builder.gep(p, [g])), FLOATS8) for p in xsps]
        for r in range(RB):                 # the group's epilogue: 8 rows' dots to fp32, times s xs
            for t in range(TT):
                lanes = builder.sitofp(builder.load(iacc[r][t]), FLOATS8)
                builder.store(builder.call(fma, [lanes, builder.fmul(svs[r], xsb[t]), builder.load(facc[r][t])]),
                              facc[r][t])
        if minimum:   # int4's minimum: m[r, g] xsum[t, g], 8 rows per FMA
            for r in range(RB):
                mv = simd._halves8(builder, mps[r], builder.mul(g, c(8)))
                for t in range(TT):
                    xm = _splat(builder, builder.load(builder.gep(xsumps[t], [g])), FLOATS8)
                    builder.store(builder.call(fma, [mv, xm, builder.load(facc[r][t])]), facc[r][t])
    obase = _ptr(context, builder, ty[13], out_, F32, ooff)
    for t in range(TT):
        for r in range(RB):
            keep = builder.and_(builder.icmp_signed("<", c(t), n_tok), builder.icmp_signed("<", c(r), n_rb))
            with builder.if_then(keep, likely=True):
                at = builder.add(builder.mul(c(t), ostride), c(8 * r))
                builder.store(builder.load(facc[r][t]),
                              builder.bitcast(builder.gep(obase, [at]), FLOATS8.as_pointer()), align=4)
    return context.get_dummy_value()


_SIG_DOC = """out[ooff + t ostride + 8 i + l] = row l of 8-row vector i, token t, for i < min(RB, n_rb),
    t < min(TT, n_tok): wp from woff (vector i at woff + i Kp 8), x from xoff (token t at
    xoff + t Kp), sp (and mp) from soff (vector i at soff + i G 8), xs (and xsum) from xsoff
    (token t at xsoff + t G). Vectors / tokens past n_rb / n_tok repeat the last ones (read,
    never stored)."""


@intrinsic
def tile_int8(typingctx, wp, woff, x, xoff, Kp, sp, soff, xs, xsoff, G, gs, mp, xsum, out, ooff, ostride,
              n_rb, n_tok):
    sig = types.void(wp, woff, x, xoff, Kp, sp, soff, xs, xsoff, G, gs, mp, xsum, out, ooff, ostride, n_rb, n_tok)
    return sig, lambda context, builder, signature, args: _tile(context, builder, signature, args, False, False)


@intrinsic
def tile_int4(typingctx, wp, woff, x, xoff, Kp, sp, soff, xs, xsoff, G, gs, mp, xsum, out, ooff, ostride,
              n_rb, n_tok):
    sig = types.void(wp, woff, x, xoff, Kp, sp, soff, xs, xsoff, G, gs, mp, xsum, out, ooff, ostride, n_rb, n_tok)
    return sig, lambda context, builder, signature, args: _tile(context, builder, signature, args, True, True)


@intrinsic
def tile_int4_16(typingctx, wp, woff, x, xoff, Kp, sp, soff, xs, xsoff, G, gs, mp, xsum, out, ooff, ostride,
                 n_rb, n_tok):
    sig = types.void(wp, woff, x, xoff, Kp, sp, soff, xs, xsoff, G, gs, mp, xsum, out, ooff, ostride, n_rb, n_tok)
    return sig, lambda context, builder, signature, args: _tile(context, builder, signature, args, False, True)


@intrinsic
def tile_int8_q8(typingctx, wp, woff, x, xoff, Kp, sp, soff, xs, xsoff, G, gs, mp, xsum, out, ooff, ostride,
                 n_rb, n_tok):
    sig = types.void(wp, woff, x, xoff, Kp, sp, soff, xs, xsoff, G, gs, mp, xsum, out, ooff, ostride, n_rb, n_tok)
    return sig, lambda context, builder, signature, args: _tile(context, builder, signature, args, True, False, True)


tile_int8.__doc__ = "int8 weights (pairs layout), x int16. " + _SIG_DOC
tile_int4.__doc__ = "int4 weights (quads layout), x int8, plus m[r, g] xsum[t, g]. " + _SIG_DOC
tile_int4_16.__doc__ = "int4 weights (pairs layout), x int16, plus m[r, g] xsum[t, g]. " + _SIG_DOC
tile_int8_q8.__doc__ = ("int8 weights as q + 128 (quads layout), x int8, xsum int32 -128 sum(xq) per token and "
                        "group (VNNI; on ARM sdot, BIAS 0: q itself, xsum 0). " + _SIG_DOC)


def _transpose(builder, a):
    """8 vectors of 8 values (rows) -> 8 vectors of 8 (columns: value j of the 8 rows), in 3 rounds of
    8 interleaves (punpck{l,h}{wd,dq,qdq}, or their 32-bit twins)."""
    def mix(x, y, lanes):                        # lanes of x (0..7) and y (8..15)
        return builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(I32, 8), lanes))
    lo16, hi16 = [0, 8, 1, 9, 2, 10, 3, 11], [4, 12, 5, 13, 6, 14, 7, 15]
    lo32, hi32 = [0, 1, 8, 9, 2, 3, 10, 11], [4, 5, 12, 13, 6, 7, 14, 15]
    lo64, hi64 = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    b = [mix(a[i], a[i + 1], h) for i in (0, 2, 4, 6) for h in (lo16, hi16)]   # rows 2i, 2i+1 interleaved
    c = [mix(b[i], b[i + 2], h) for i in (0, 1, 4, 5) for h in (lo32, hi32)]   # c[j]: values 2j, 2j+1 of 4 rows
    return [mix(c[j], c[j + 4], h) for j in range(4) for h in (lo64, hi64)]    # value j of the 8 rows


def _transpose_codegen(nibbles):
    """transpose8x8's body, or (nibbles) transpose8x8_nibbles'."""
    def codegen(context, builder, signature, args):
        ty = signature.args
        elem = ir.IntType(ty[0].dtype.bitwidth)
        vec = ir.VectorType(elem, 8)
        src_, soff_, stride_, dst_, doff_, *rest = [
            context.cast(builder, a, t, types.int64) if isinstance(t, types.Integer) else a for a, t in zip(args, ty)]
        sp, dp = _ptr(context, builder, ty[0], src_, elem, soff_), _ptr(context, builder, ty[3], dst_, elem, doff_)
        splat = lambda v: builder.shuffle_vector(                              # noqa: E731
            builder.insert_element(ir.Constant(vec, None), builder.trunc(v, elem), ir.Constant(I32, 0)),
            ir.Constant(vec, None), ir.Constant(ir.VectorType(I32, 8), [0] * 8))
        a = [builder.load(builder.bitcast(builder.gep(sp, [builder.mul(ir.Constant(I64, i), stride_)]),
                                          vec.as_pointer()), align=2) for i in range(8)]
        if nibbles:                              # transposed once, split into low and high nibbles after
            low = ir.Constant(vec, [int("0F" * (elem.width // 8), 16)] * 8)
            cols = _transpose(builder, a)
            outs = [(dp, [builder.and_(v, low) for v in cols]),
                    (_ptr(context, builder, ty[3], dst_, elem, rest[0]),
                     [builder.and_(builder.lshr(v, ir.Constant(vec, [4] * 8)), low) for v in cols])]
        else:
            shift_, mask_, flip_ = rest
            a = [builder.xor(builder.and_(builder.lshr(v, splat(shift_)), splat(mask_)), splat(flip_)) for v in a]
            outs = [(dp, _transpose(builder, a))]
        for p, cols in outs:
            for j, v in enumerate(cols):
                builder.store(v, builder.bitcast(builder.gep(p, [ir.Constant(I64, 8 * j)]), vec.as_pointer()),
                              align=2)
        return context.get_dummy_value()
    return codegen


@intrinsic
def transpose8x8(typingctx, src, soff, stride, dst, doff, shift, mask, flip):
    """dst[doff + 8 j + i] = ((src[soff + i stride + j] >> shift) & mask) ^ flip for i, j < 8 (src, dst: C
    arrays of 16- or 32-bit values, offsets into them flat): 8 rows' values j side by side."""
    return types.void(src, soff, stride, dst, doff, shift, mask, flip), _transpose_codegen(False)


@intrinsic
def transpose8x8_nibbles(typingctx, src, soff, stride, dst, doff, doff_hi):
    """transpose8x8 of src's words once, each byte's low nibble to dst[doff ..] and its high one to
    dst[doff_hi ..] (int4's nibble pairs: two groups' values from one transpose)."""
    return types.void(src, soff, stride, dst, doff, doff_hi), _transpose_codegen(True)


@njit(inline="always", fastmath=FAST, error_model="numpy")
def repack_scales(s, r0, v, lanes, sl):
    """sl[(v G + g) 8 + l] = s[r0 + 8 v + l, g], l < lanes: 8 rows' fp16 scales (or minima) side by side,
    still fp16 bits (the tile turns 8 of them into fp32 with one vcvtph2ps), 8 groups at a time through
    transpose8x8 where 8 rows and G % 8 == 0."""
    G = s.shape[1]
    if lanes == 8 and G % 8 == 0:
        for g0 in range(0, G, 8):
            transpose8x8(s, (r0 + 8 * v) * G + g0, G, sl, (v * G + g0) * 8, 0, 0xFFFF, 0)
    else:
        for lane in range(lanes):
            for g in range(G):
                sl[(v * G + g) * 8 + lane] = s[r0 + 8 * v + lane, g]


@njit(inline="always", fastmath=FAST, error_model="numpy")
def repack_int8(q, s, r0, wl, sl, flip):
    """Rows r0 .. r0 + 8 nv of q [O, N] (the stored int8 values n at a time: N = Kp/2 pairs as int16, the
    pairs layout, or N = Kp/4 quads as uint32, the quads one), s [O, G] fp16 bits -> wl [nv N 8] of q's
    type (word k of row 8 v + l at (v N + k) 8 + l, xor flip: 0x80808080 makes each byte q + 128),
    sl [nv G 8] fp16 bits; rows past O: zeros."""
    O, N = q.shape
    nv = wl.size // (8 * N)
    if O - r0 < 8 * nv:                            # the last block: its missing rows are zeros
        wl[:] = 0
        sl[:] = 0
    for v in range(nv):
        lanes = min(8, O - r0 - 8 * v)
        if lanes == 8:                             # 8 rows' words k .. k + 7 side by side (N % 8 == 0)
            for k in range(0, N, 8):
                transpose8x8(q, (r0 + 8 * v) * N + k, N, wl, (v * N + k) * 8, 0, -1, flip)
        else:
            for k in range(N):
                for lane in range(lanes):
                    wl[(v * N + k) * 8 + lane] = q[r0 + 8 * v + lane, k] ^ flip
        repack_scales(s, r0, v, lanes, sl)


@njit(inline="always", fastmath=FAST, error_model="numpy")
def repack_int4(b, s, m, gs, r0, wl, sl, ml):
    """Rows r0 .. r0 + 8 nv of b [O, G/2 gs/n] (the stored nibble pairs, n = 4 bytes at a time as
    uint32: the quads layout; or n = 2 as uint16: the pairs layout), s, m [O, G] fp16 bits ->
    wl [nv G gs/n 8] of b's type (n values of group g as n bytes 0..15: the low nibbles for even g,
    the high ones for odd g: one transpose8x8_nibbles serves both), sl, ml [nv G 8] fp16 bits; rows
    past O: zeros."""
    O = b.shape[0]
    G, n4 = s.shape[1], gs // b.itemsize
    nv = wl.size // (8 * G * n4)
    if O - r0 < 8 * nv:                            # the last block: its missing rows are zeros
        wl[:] = 0
        sl[:] = 0
        ml[:] = 0
    for v in range(nv):
        lanes = min(8, O - r0 - 8 * v)
        for g in range(0, G, 2):                   # groups g, g + 1: the low and high nibbles of the same bytes
            at, src = (v * G + g) * n4, (g >> 1) * n4
            if lanes == 8:                         # 8 rows' words k .. k + 7 side by side (n4 % 8 == 0)
                for k in range(0, n4, 8):
                    transpose8x8_nibbles(b, (r0 + 8 * v) * b.shape[1] + src + k, b.shape[1], wl, (at + k) * 8,
                                         (at + n4 + k) * 8)
            else:
                for k in range(n4):
                    for lane in range(lanes):
                        word = b[r0 + 8 * v + lane, src + k]
                        wl[(at + k) * 8 + lane] = word & 0x0F0F0F0F
                        wl[(at + n4 + k) * 8 + lane] = (word >> 4) & 0x0F0F0F0F
        repack_scales(s, r0, v, lanes, sl)
        repack_scales(m, r0, v, lanes, ml)


@intrinsic
def prefetch(typingctx, a, byte):
    """Asks for the 64-byte line holding byte `byte` of array a, into L2 (prefetcht1)."""
    def codegen(context, builder, signature, args):
        p = _ptr(context, builder, signature.args[0], args[0], I8,
                 context.cast(builder, args[1], signature.args[1], types.int64))
        fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
        builder.call(fn, [p, ir.Constant(I32, 0), ir.Constant(I32, 2), ir.Constant(I32, 1)])
        return context.get_dummy_value()
    return types.void(a, byte), codegen


@njit(inline="always", fastmath=FAST, error_model="numpy")
def prefetch_rows(a, r0, r1):
    """Asks for rows r0 .. r1 of a C array a [O, n] into L2, a line at a time."""
    n = a.shape[1] * a.itemsize
    for byte in range(r0 * n, min(r1, a.shape[0]) * n, 64):
        prefetch(a, byte)


def _blocks(tile, RB, TT):
    """The loops around one tile kind (each compiled on its own: a tile is a lot of code)."""
    @njit(inline="always", fastmath=FAST, error_model="numpy")
    def block(wl, xf, sl, xsf, ml, xsumf, G, gs, out, ostride, c0, nv, T):
        """nv 8-row vectors repacked in wl, sl (ml), every token, TOKEN_BLOCK tokens at a time,
        RB x TT per tile, into out [T, ostride] (vector v at column c0 + 8 v)."""
        Kp = G * gs
        for t0 in range(0, T, TOKEN_BLOCK):
            t_end = min(T, t0 + TOKEN_BLOCK)
            for v in range(0, nv, RB):
                for t in range(t0, t_end, TT):
                    tile(wl, v * Kp * 8, xf, t * Kp, Kp, sl, v * G * 8, xsf, t * G, G, gs, ml, xsumf,
                         out, t * ostride + c0 + 8 * v, ostride, min(RB, nv - v), min(TT, t_end - t))
    return block


block_int8 = _blocks(tile_int8, RB8, TT8)           # int8 weights, pairs x int16 (or int8 widened)
block_int4 = _blocks(tile_int4, RB4, TT4)           # int4 weights, quads x int8
block_int4_16 = _blocks(tile_int4_16, RB8, TT8)     # int4 weights, pairs x int16
block_int8_q8 = _blocks(tile_int8_q8, RB4, TT4)     # int8 weights, quads (q + 128) x int8 (VNNI)


@njit(inline="always", fastmath=FAST, error_model="numpy")
def _gemm_int8(block, xq, xs, xsum, q, s, flip, out, workers):
    """gemm_int8 and gemm_int8_q8: block is block_int8 (q int16 pairs) or block_int8_q8 (q uint32 quads,
    repacked xor flip). Each of the workers claims row blocks until none is left (sync.claim): a thread
    that runs slower, or starts later, takes fewer blocks, and the others do not wait for it."""
    T, G, gs = xq.shape
    O, Kp = q.shape[0], G * gs
    xf, xsf, xsumf, of = xq.reshape(-1), xs.reshape(-1), xsum.reshape(-1), out.reshape(-1)
    nv_all = -(-O // 8)
    n_blocks = -(-nv_all // BLOCK_RB)
    claims = np.zeros(2 * SLOT, dtype=np.int64)     # sync.counters(1): one phase, the blocks
    for _ in prange(workers):                   # one iteration per thread, a scratch block of its own
        wl_all = np.empty(BLOCK_RB * Kp * 8 // q.itemsize, dtype=q.dtype)
        sl_all = np.empty(BLOCK_RB * G * 8, dtype=np.uint16)
        blk = claim(claims, 0)
        while blk < n_blocks:
            nxt = claim(claims, 0)              # this thread's next block, claimed now: its rows are read
            nv = min(BLOCK_RB, nv_all - blk * BLOCK_RB)     # from memory while this one multiplies
            wl, sl = wl_all[:nv * Kp * 8 // q.itemsize], sl_all[:nv * G * 8]
            repack_int8(q, s, 8 * BLOCK_RB * blk, wl, sl, flip)
            prefetch_rows(q, 8 * BLOCK_RB * nxt, 8 * BLOCK_RB * (nxt + 1))
            prefetch_rows(s, 8 * BLOCK_RB * nxt, 8 * BLOCK_RB * (nxt + 1))
            block(wl, xf, sl, xsf, sl, xsumf, G, gs, of, out.shape[1], 8 * BLOCK_RB * blk, nv, T)
            blk = nxt


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def gemm_int8(x16, xs, q16, s, out, workers):
    """x16 [T, G, gs] int16 (the rounded activations), xs [T, G] f32; q16 [O, Kp/2] the stored int8
    weights as value pairs, s [O, G] their fp16 scales -> out [T, 8 ceil(O / 8)]:
    out[t, r] = sum_g s xs (q . xq). Each of the workers (numba.get_num_threads(), passed in: called in
    here, it would keep this from the disk cache) repacks BLOCK_RB x 8 rows at a time (repack_int8)."""
    _gemm_int8(block_int8, x16, xs, xs, q16, s, 0, out, workers)


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def gemm_int8_q8(xq, xs, xcorr, b32, s, out, workers):
    """gemm_int8 on int8 activations with vpdpbusd (VNNI) or sdot (ARM): xq [T, G, gs] int8, xs [T, G] f32,
    xcorr [T, G] int32 = -BIAS sum(xq); b32 [O, Kp/4] the stored int8 weights 4 at a time as uint32, s [O, G]
    fp16 bits -> out [T, 8 ceil(O / 8)]. vpdpbusd multiplies unsigned bytes by signed ones: the weights become
    q + 128 in the repack, and (q + 128) . xq - 128 sum(xq) = q . xq exactly, in int32 (sdot: BIAS 0, q itself)."""
    _gemm_int8(block_int8_q8, xq, xs, xcorr, b32, s, 0x80808080 if BIAS else 0, out, workers)


@njit(inline="always", fastmath=FAST, error_model="numpy")
def _gemm_int4(block, xq, xs, xsum, b, s, m, out, workers):
    """gemm_int4 and gemm_int4_16: block is block_int4 (b uint32) or block_int4_16 (b uint16); row blocks
    claimed as in _gemm_int8."""
    T, G, gs = xq.shape
    O, Kp = b.shape[0], G * gs
    xf, xsf, xsumf, of = xq.reshape(-1), xs.reshape(-1), xsum.reshape(-1), out.reshape(-1)
    nv_all = -(-O // 8)
    n_blocks = -(-nv_all // BLOCK_RB)
    claims = np.zeros(2 * SLOT, dtype=np.int64)
    for _ in prange(workers):
        wl_all = np.empty(BLOCK_RB * Kp * 8 // b.itemsize, dtype=b.dtype)
        sl_all, ml_all = np.empty(BLOCK_RB * G * 8, dtype=np.uint16), np.empty(BLOCK_RB * G * 8, dtype=np.uint16)
        blk = claim(claims, 0)
        while blk < n_blocks:
            nxt = claim(claims, 0)
            nv = min(BLOCK_RB, nv_all - blk * BLOCK_RB)
            wl, sl, ml = wl_all[:nv * Kp * 8 // b.itemsize], sl_all[:nv * G * 8], ml_all[:nv * G * 8]
            repack_int4(b, s, m, gs, 8 * BLOCK_RB * blk, wl, sl, ml)
            prefetch_rows(b, 8 * BLOCK_RB * nxt, 8 * BLOCK_RB * (nxt + 1))
            prefetch_rows(s, 8 * BLOCK_RB * nxt, 8 * BLOCK_RB * (nxt + 1))
            prefetch_rows(m, 8 * BLOCK_RB * nxt, 8 * BLOCK_RB * (nxt + 1))
            block(wl, xf, sl, xsf, ml, xsumf, G, gs, of, out.shape[1], 8 * BLOCK_RB * blk, nv, T)
            blk = nxt


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def gemm_int4(xq, xs, xsum, b32, s, m, out, workers):
    """xq [T, G, gs] int8, xs, xsum [T, G] f32; b32 [O, Kp/8] the stored nibble pairs 4 bytes at a
    time, s, m [O, G] fp16 scales and minima -> out [T, 8 ceil(O / 8)]:
    out[t, r] = sum_g s xs (nibbles . xq) + m xsum, on the quads tile."""
    _gemm_int4(block_int4, xq, xs, xsum, b32, s, m, out, workers)


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def gemm_int4_16(x16, xs, xsum, b16, s, m, out, workers):
    """gemm_int4 for x16 [T, G, gs] int16, b16 [O, Kp/4] (the nibble pairs 2 bytes at a time), on the
    pairs tile."""
    _gemm_int4(block_int4_16, x16, xs, xsum, b16, s, m, out, workers)


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def round_prompt16(x3):
    """kernels.quantize_activations16 for a prompt's tokens on all threads: x3 [T, G, gs] f32 ->
    x16 [T, G, gs] int16, xs [T, G] f32, and xsum [T, G] = xs sum(x16) for int4's minimum (the
    integer sum is exact in fp32: |sum(x16)| < 2^24)."""
    T, G, gs = x3.shape
    x16 = np.empty((T, G, gs), dtype=np.int16)
    xs, xsum = np.empty((T, G), dtype=np.float32), np.empty((T, G), dtype=np.float32)
    for t in prange(T):
        fk.quantize_token16(x3, t, x16, xs)
        for g in range(G):
            total = np.int32(0)                    # int32 lanes: |sum| <= 32767 gs
            for j in range(gs):
                total += x16[t, g, j]
            xsum[t, g] = np.float32(total) * xs[t, g]
    return x16, xs, xsum


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def round_prompt8(x3):
    """kernels.quantize_activations for a prompt's tokens on all threads -> xq int8, xs, xsum, and xcorr
    [T, G] int32 = -BIAS sum(xq) (gemm_int8_q8's correction)."""
    T, G, gs = x3.shape
    xq, xa = np.empty((T, G, gs), dtype=np.int8), np.empty((T, G, gs), dtype=np.uint8)
    xs, xsum = np.empty((T, G), dtype=np.float32), np.empty((T, G), dtype=np.float32)
    xcorr = np.empty((T, G), dtype=np.int32)
    for t in prange(T):
        fk.quantize_token(x3, t, xq, xa, xs, xsum)
        for g in range(G):
            total = np.int32(0)
            for j in range(gs):
                total += xq[t, g, j]
            xcorr[t, g] = -BIAS * total
    return xq, xs, xsum, xcorr


def gemm(w, x: np.ndarray, act: str = "int8") -> np.ndarray:
    """x [T, Kp] f32 (padded) @ W.T for a quant.Weight (int8 / int4) -> [T, out_features], x rounded
    to int8 per token and group (act "int8"), or to int16 (act "int16": the pairs tile multiplies
    int16 activations, so the finer rounding costs int8 weights nothing; int4 weights then take
    the pairs tile, at vpmaddwd's rate instead of vpmaddubsw's)."""
    T, gs, O = x.shape[0], w.group_size, w.out_features
    out = np.empty((T, 8 * -(-O // 8)), dtype=np.float32)
    data, scales = np.ascontiguousarray(w.data).reshape(O, -1), np.ascontiguousarray(w.scales).view(np.uint16)
    mins = None if w.mins is None else np.ascontiguousarray(w.mins).view(np.uint16)
    x3 = x.reshape(T, -1, gs)                                                    # [T, G, gs]
    workers = numba.get_num_threads()
    if act == "int16":
        x16, xs, xsum = round_prompt16(x3)                                       # [T, G, gs], [T, G]
        if w.fmt == "int8":
            gemm_int8(x16, xs, data.view(np.int16), scales, out, workers)
        else:
            gemm_int4_16(x16, xs, xsum, data.view(np.uint16), scales, mins, out, workers)
    else:
        xq, xs, xsum, xcorr = round_prompt8(x3)
        if w.fmt == "int8" and (VNNI or SDOT):
            gemm_int8_q8(xq, xs, xcorr, data.view(np.uint32), scales, out, workers)
        elif w.fmt == "int8":
            gemm_int8(xq.astype(np.int16), xs, data.view(np.int16), scales, out, workers)
        else:
            gemm_int4(xq, xs, xsum, data.view(np.uint32), scales, mins, out, workers)
    return out if out.shape[1] == O else np.ascontiguousarray(out[:, :O])


def gemm_ref(xq, xs, xsum, w) -> np.ndarray:
    """The numpy twin of gemm_int8 / gemm_int4 / gemm_int4_16, in float64: the integer dot products
    exactly, then the fp32 scales. w: a quant.Weight (int8 / int4); xq, xs, xsum from
    kernels.quantize_activations, or x16, xs from quantize_activations16 with xsum = xs sum(x16))."""
    T, G, gs = xq.shape
    O = w.out_features
    s = w.scales.view(np.float16).astype(np.float64)                        # [O, G]
    if w.fmt == "int8":
        q = w.data.astype(np.int64)                                          # [O, G, gs]
    else:
        b = w.data
        q = np.stack([b & 15, b >> 4], axis=2).reshape(O, G, gs).astype(np.int64)
    dots = np.einsum("ogj,tgj->tog", q, xq.astype(np.int64))                 # [T, O, G], exact integers
    out = (dots * (s[None] * xs.astype(np.float32)[:, None, :].astype(np.float64))).sum(-1)
    if w.fmt == "int4":
        out += xsum.astype(np.float64) @ w.mins.view(np.float16).astype(np.float64).T
    return out
