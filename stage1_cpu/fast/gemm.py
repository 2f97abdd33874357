"""Prefill on integers: an int8-activation GEMM with a register tile (int8 / int4 weights).

Why (docs/stage1.md, "Prefill on integers"): the core's prefill dequantizes
ROW_BLOCK rows to an fp32 tile and hands it to BLAS sgemm, one fp32
multiply-add per weight and token, 8 per FMA instruction. Here the
activations are rounded to int8 per token and group, exactly as decode does
(kernels.quantize_activations), and each group's dot product is integer
multiply-adds: 32 per vpmaddubsw + vpmaddwd (AVX2) or per vpdpbusd (VNNI).

The micro-kernel (gemm_int8_tile / gemm_int4_tile) computes a tile of ROWS
weight rows x TOKENS tokens at once. Per chunk of 32 values it loads each
row's 32 weight bytes once and each token's 32 activation bytes once, and
multiplies every row with every token from registers: a weight load serves
TOKENS tokens, an activation load serves ROWS rows. Per group and (row, token)
pair the int32 lanes are converted to float and multiply-added, with the
scale s[r, g] * xs[t, g], into that pair's 8 float lanes; those are summed once
at the end of the row. ROWS x TOKENS float accumulators live in registers
(16 ymm registers on AVX2: 4 x 2 = 8 accumulators, plus the loads).

    out[t, r] = sum_g s[r, g] xs[t, g] (q[r, g] . xq[t, g])          int8
              + sum_g m[r, g] xsum[t, g]                             int4 (its minimum)

The int4 minimum term is a [T, G] x [G, O] product (1/gs of the work), added
in plain numba after the tile. No weight repacking: the tile reads the stored
layouts ([O, G, gs] int8; [O, G/2, gs] nibble pairs) in place, so prefill
costs no memory beyond the rounded activations (xq and |xq|, and on AVX2 an
int16 copy: 4 bytes per activation) and fp32 copies of the scales and minima
(O x G x 4 bytes each per call).

Instructions (cpu.INT8, decided in Python before anything here compiles):
  "avx2"  int8 weights widened to int16 once per row and chunk (vpmovsxbw), against
          int16 activations (activations_for) in vpmaddwd: 16 products a step, exact,
          no saturation and no sign trick;
  "vnni"  vpdpbusd on (q + 128) unsigned x xq signed, minus 128 sum(xq), the
          correction one vpdpbusd per token and chunk, shared by the rows (not
          measured: no VNNI machine was at hand);
  int4    nibbles (0..15) are unsigned already: vpmaddubsw on them and xq as they
          are, the pair sums (<= 2 * 15 * 127) added in int16 for a whole group
          (up to 8 chunks, gs <= 256), then one vpmaddwd by ones per group.
None of it is compiled where cpu.INT8 is None: weight.py never calls it there.
The numpy twin: gemm_ref below.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import cpu
from ..kernels import FAST

VNNI = cpu.INT8 == "vnni"
ROWS = 4                      # weight rows per tile
TOKENS = 2                    # tokens per tile
ROW_BLOCK = 64                # rows a thread takes at a time (64 x Kp bytes: in L2 beside a token block)
TOKEN_BLOCK = 64              # tokens per pass over a row block (64 x Kp activation bytes)

I8, I16, I32, I64, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
BYTES32 = ir.VectorType(I8, 32)
SHORTS16 = ir.VectorType(I16, 16)
INTS8 = ir.VectorType(I32, 8)
FLOATS8 = ir.VectorType(F32, 8)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _ptr(context, builder, aty, ary, elem, offset):
    """Pointer to element `offset` of a 1-D numba array."""
    base = builder.bitcast(context.make_array(aty)(context, builder, ary).data, elem.as_pointer())
    return builder.gep(base, [offset])


def _load32(builder, p, at):
    return builder.load(builder.bitcast(builder.gep(p, [at]), BYTES32.as_pointer()), align=1)


def _dot(builder, unsigned, signed, acc):
    """acc (8 x int32) + sums of 4 products of unsigned x signed bytes: vpdpbusd, or
    vpmaddubsw + vpmaddwd by ones (callers keep each pair sum within int16)."""
    if VNNI:
        f = _fn(builder, "llvm.x86.avx512.vpdpbusd.256", INTS8, [INTS8] * 3)
        return builder.call(f, [acc, builder.bitcast(unsigned, INTS8), builder.bitcast(signed, INTS8)])
    maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", SHORTS16, [BYTES32, BYTES32])
    maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", INTS8, [SHORTS16, SHORTS16])
    pairs = builder.call(maddubs, [unsigned, signed])
    return builder.add(acc, builder.call(maddwd, [pairs, ir.Constant(SHORTS16, [1] * 16)]))


def _splat(builder, v):
    one = builder.insert_element(ir.Constant(FLOATS8, ir.Undefined), v, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(FLOATS8, ir.Undefined), ir.Constant(INTS8, [0] * 8))


def _tile(context, builder, sig, args, int4):
    """Shared body of the two tile intrinsics (argument order in gemm_int8_tile)."""
    (q_, qoff, rstride, xq_, xa_, xoff, xstride, s_, soff, xs_, xsoff, G, gs, res_, n_rows, n_tok, xsum_) = [
        context.cast(builder, a, t, types.int64) if isinstance(t, types.Integer) else a
        for a, t in zip(args, sig.args)]
    ty = sig.args
    one64 = ir.Constant(I64, 1)
    qbase = _ptr(context, builder, ty[0], q_, I8, qoff)
    xbase = _ptr(context, builder, ty[3], xq_, I8, xoff)
    sbase = _ptr(context, builder, ty[7], s_, F32, soff)
    xsbase = _ptr(context, builder, ty[9], xs_, F32, xsoff)
    resp = _ptr(context, builder, ty[13], res_, F32, ir.Constant(I64, 0))
    # rows / tokens past the tile's end repeat the last one (read, never stored by the caller)
    rows = [builder.select(builder.icmp_signed("<", ir.Constant(I64, i), n_rows), ir.Constant(I64, i),
                           builder.sub(n_rows, one64)) for i in range(ROWS)]
    toks = [builder.select(builder.icmp_signed("<", ir.Constant(I64, t), n_tok), ir.Constant(I64, t),
                           builder.sub(n_tok, one64)) for t in range(TOKENS)]
    qps = [builder.gep(qbase, [builder.mul(r, rstride)]) for r in rows]
    sps = [builder.gep(sbase, [builder.mul(r, G)]) for r in rows]
    xps = [builder.gep(xbase, [builder.mul(t, xstride)]) for t in toks]
    xsps = [builder.gep(xsbase, [builder.mul(t, G)]) for t in toks]
    fma = _fn(builder, "llvm.fma.v8f32", FLOATS8, [FLOATS8] * 3)
    zero = ir.Constant(INTS8, None)
    bias = ir.Constant(BYTES32, [128] * 32)
    low4 = ir.Constant(BYTES32, [15] * 32)
    facc = [[cgutils.alloca_once_value(builder, ir.Constant(FLOATS8, None)) for _ in range(TOKENS)]
            for _ in range(ROWS)]
    iacc = [[cgutils.alloca_once(builder, INTS8) for _ in range(TOKENS)] for _ in range(ROWS)]
    corr = [cgutils.alloca_once(builder, INTS8) for _ in range(TOKENS)]
    n_chunks = builder.udiv(gs, ir.Constant(I64, 32))
    maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", INTS8, [SHORTS16, SHORTS16])
    maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", SHORTS16, [BYTES32, BYTES32])
    ones = ir.Constant(SHORTS16, [1] * 16)
    wide = not int4 and not VNNI            # AVX2 int8: int16 x int16 by vpmaddwd (xq holds int16)
    if wide:
        xps = [builder.gep(_ptr(context, builder, ty[3], xq_, I16, xoff), [builder.mul(t, xstride)]) for t in toks]
    with cgutils.for_range(builder, G) as gl:
        g = gl.index
        for r in range(ROWS):
            for t in range(TOKENS):
                builder.store(zero, iacc[r][t])
        for t in range(TOKENS):
            builder.store(zero, corr[t])
        if int4:      # group g: the low (g even) or high (g odd) nibbles of pair g // 2's gs bytes
            qat = builder.mul(builder.lshr(g, one64), gs)
            shift = builder.trunc(builder.shl(builder.and_(g, one64), ir.Constant(I64, 2)), I8)
            shifts = builder.shuffle_vector(
                builder.insert_element(ir.Constant(BYTES32, ir.Undefined), shift, ir.Constant(I32, 0)),
                ir.Constant(BYTES32, ir.Undefined), ir.Constant(ir.VectorType(I32, 32), [0] * 32))
        else:
            qat = builder.mul(g, gs)
        xat = builder.mul(g, gs)
        with cgutils.for_range(builder, n_chunks) as cl:
            off = builder.mul(cl.index, ir.Constant(I64, 32))
            xo = builder.add(xat, off)
            qo = builder.add(qat, off)
            if wide:          # two halves of 16: weights widened once per row, activations loaded as int16
                for h in range(2):
                    ho = ir.Constant(I64, 16 * h)
                    ws = [builder.sext(builder.load(builder.bitcast(builder.gep(p, [builder.add(qo, ho)]),
                                                                    ir.VectorType(I8, 16).as_pointer()), align=1),
                                       SHORTS16) for p in qps]
                    xv = [builder.load(builder.bitcast(builder.gep(p, [builder.add(xo, ho)]),
                                                       SHORTS16.as_pointer()), align=2) for p in xps]
                    for r in range(ROWS):
                        for t in range(TOKENS):
                            d = builder.call(maddwd, [ws[r], xv[t]])
                            builder.store(builder.add(builder.load(iacc[r][t]), d), iacc[r][t])
            else:
                xv = [_load32(builder, p, xo) for p in xps]
                if int4:      # nibble x int8 pair sums <= 2 * 15 * 127: up to 8 chunks add up in int16
                    ws = [builder.and_(builder.lshr(_load32(builder, p, qo), shifts), low4) for p in qps]
                    for r in range(ROWS):
                        for t in range(TOKENS):
                            acc16 = builder.bitcast(builder.load(iacc[r][t]), SHORTS16)
                            d = builder.add(acc16, builder.call(maddubs, [ws[r], xv[t]]))
                            builder.store(builder.bitcast(d, INTS8), iacc[r][t])
                else:         # VNNI: (q + 128) . xq - 128 sum(xq), the correction shared by the rows
                    ws = [builder.xor(_load32(builder, p, qo), bias) for p in qps]
                    for t in range(TOKENS):
                        builder.store(_dot(builder, bias, xv[t], builder.load(corr[t])), corr[t])
                    for r in range(ROWS):
                        for t in range(TOKENS):
                            builder.store(_dot(builder, ws[r], xv[t], builder.load(iacc[r][t])), iacc[r][t])
        xsg = [_splat(builder, builder.load(builder.gep(p, [g]))) for p in xsps]    # broadcasts from memory
        for r in range(ROWS):
            sg = _splat(builder, builder.load(builder.gep(sps[r], [g])))
            for t in range(TOKENS):
                dot = builder.load(iacc[r][t])
                if int4:
                    dot = builder.call(maddwd, [builder.bitcast(dot, SHORTS16), ones])
                elif VNNI:
                    dot = builder.sub(dot, builder.load(corr[t]))
                lanes = builder.sitofp(dot, FLOATS8)
                scale = builder.fmul(sg, xsg[t])
                builder.store(builder.call(fma, [lanes, scale, builder.load(facc[r][t])]), facc[r][t])
    if int4:          # the minimum: sum_g m[r, g] xsum[t, g], 8 groups per FMA (then the last G % 8)
        mbase = _ptr(context, builder, ty[4], xa_, F32, soff)          # int4: the xa slot carries m [O G] f32
        mps = [builder.gep(mbase, [builder.mul(r, G)]) for r in rows]
        xsumps = [builder.gep(_ptr(context, builder, ty[16], xsum_, F32, xsoff), [builder.mul(t, G)]) for t in toks]
        g8 = builder.udiv(G, ir.Constant(I64, 8))
        with cgutils.for_range(builder, g8) as gl:
            at = builder.mul(gl.index, ir.Constant(I64, 8))
            mv = [builder.load(builder.bitcast(builder.gep(p, [at]), FLOATS8.as_pointer()), align=4) for p in mps]
            sv = [builder.load(builder.bitcast(builder.gep(p, [at]), FLOATS8.as_pointer()), align=4) for p in xsumps]
            for r in range(ROWS):
                for t in range(TOKENS):
                    builder.store(builder.call(fma, [mv[r], sv[t], builder.load(facc[r][t])]), facc[r][t])
        with cgutils.for_range_slice(builder, builder.mul(g8, ir.Constant(I64, 8)), G, one64) as (g, _):
            for r in range(ROWS):
                m = builder.load(builder.gep(mps[r], [g]))
                for t in range(TOKENS):
                    term = builder.insert_element(ir.Constant(FLOATS8, None),
                                                  builder.fmul(m, builder.load(builder.gep(xsumps[t], [g]))),
                                                  ir.Constant(I32, 0))
                    builder.store(builder.fadd(builder.load(facc[r][t]), term), facc[r][t])
    total = _fn(builder, "llvm.vector.reduce.fadd.v8f32", F32, [F32, FLOATS8])
    for r in range(ROWS):
        for t in range(TOKENS):
            v = builder.call(total, [ir.Constant(F32, 0.0), builder.load(facc[r][t])], fastmath=("reassoc",))
            builder.store(v, builder.gep(resp, [ir.Constant(I64, t * ROWS + r)]))
    return context.get_dummy_value()


@intrinsic
def gemm_int8_tile(typingctx, q, qoff, rstride, xq, xa, xoff, xstride, s, soff, xs, xsoff, G, gs, res, n_rows,
                   n_tok, xsum):
    """res[t * ROWS + i] = sum_g s[soff + i G + g] xs[xsoff + t G + g]
                              * (q[qoff + i rstride + g gs ..] . xq[xoff + t xstride + g gs ..])
    for i < ROWS, t < TOKENS (rows i >= n_rows and tokens t >= n_tok repeat the last
    ones). q int8, xq int8, xa = |xq| uint8 (read on AVX2), s and xs float32, res float32."""
    sig = types.void(q, qoff, rstride, xq, xa, xoff, xstride, s, soff, xs, xsoff, G, gs, res, n_rows, n_tok, xsum)
    return sig, lambda context, builder, signature, args: _tile(context, builder, signature, args, False)


@intrinsic
def gemm_int4_tile(typingctx, q, qoff, rstride, xq, xa, xoff, xstride, s, soff, xs, xsoff, G, gs, res, n_rows,
                   n_tok, xsum):
    """gemm_int8_tile for int4 weights: q holds matmul_int4's [O, G/2, gs] nibble
    pairs (group g: the low nibbles of pair g // 2 when g is even, the high ones
    when odd); the nibbles 0..15 meet xq as they are. xa is not read. The minimum
    term is the caller's (matmul_int4_prefill)."""
    sig = types.void(q, qoff, rstride, xq, xa, xoff, xstride, s, soff, xs, xsoff, G, gs, res, n_rows, n_tok, xsum)
    return sig, lambda context, builder, signature, args: _tile(context, builder, signature, args, True)


@njit(inline="always", fastmath=FAST, error_model="numpy")
def _gemm_block(int4, qf, rstride, xf, mf, sf, xsf, xsumf, G, gs, out, b, T, O, res):
    """Rows b * ROW_BLOCK .. of out [T, O], all tokens, tile by tile: TOKEN_BLOCK tokens'
    activations (64 x Kp elements) against the block's rows, ROWS x TOKENS at a time."""
    r_end = min(O, (b + 1) * ROW_BLOCK)
    Kp = G * gs
    for t0 in range(0, T, TOKEN_BLOCK):
        t_end = min(T, t0 + TOKEN_BLOCK)
        for r0 in range(b * ROW_BLOCK, r_end, ROWS):
            nr = min(ROWS, r_end - r0)
            for t in range(t0, t_end, TOKENS):
                nt = min(TOKENS, t_end - t)
                if int4:
                    gemm_int4_tile(qf, r0 * rstride, rstride, xf, mf, t * Kp, Kp, sf, r0 * G, xsf, t * G, G, gs,
                                   res, nr, nt, xsumf)
                else:
                    gemm_int8_tile(qf, r0 * rstride, rstride, xf, mf, t * Kp, Kp, sf, r0 * G, xsf, t * G, G, gs,
                                   res, nr, nt, xsumf)
                for j in range(nt):
                    for i in range(nr):
                        out[t + j, r0 + i] = res[j * ROWS + i]


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_int8_prefill(x, xs, q, s32, out):
    """x [T, G, gs] the rounded activations (int16 on AVX2, int8 with VNNI: activations_for),
    xs [T, G] their scales (kernels.quantize_activations); q [O, G, gs] int8; s32 [O, G]
    float32 -> out [T, O]: out[t, r] = sum_g s[r, g] xs[t, g] (q[r, g] . xq[t, g])."""
    T, G, gs = x.shape
    O = q.shape[0]
    qf, xf, sf, xsf = q.reshape(-1), x.reshape(-1), s32.reshape(-1), xs.reshape(-1)
    for b in prange(-(-O // ROW_BLOCK)):
        res = np.empty(ROWS * TOKENS, dtype=np.float32)
        _gemm_block(False, qf, G * gs, xf, xsf, sf, xsf, xsf, G, gs, out, b, T, O, res)


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_int4_prefill(xq, xs, xsum, q, s32, m32, out):
    """xq [T, G, gs], xs, xsum [T, G] from kernels.quantize_activations; q [O, G/2, gs]
    uint8 nibble pairs; s32, m32 [O, G] float32 -> out [T, O]:
        out[t, r] = sum_g s[r, g] xs[t, g] (nibbles[r, g] . xq[t, g]) + m[r, g] xsum[t, g]"""
    T, G, gs = xq.shape
    O = q.shape[0]
    qf, xqf, sf, mf, xsf, xsumf = q.reshape(-1), xq.reshape(-1), s32.reshape(-1), m32.reshape(-1), \
        xs.reshape(-1), xsum.reshape(-1)
    for b in prange(-(-O // ROW_BLOCK)):
        res = np.empty(ROWS * TOKENS, dtype=np.float32)
        _gemm_block(True, qf, G * gs // 2, xqf, mf, sf, xsf, xsumf, G, gs, out, b, T, O, res)


def activations_for(xq: np.ndarray) -> np.ndarray:
    """The rounded activations as matmul_int8_prefill takes them: int16 on AVX2 (vpmaddwd
    multiplies int16 pairs: 2 bytes per activation), int8 with VNNI (vpdpbusd)."""
    return xq if VNNI else xq.astype(np.int16)


def gemm_ref(xq, xs, xsum, w) -> np.ndarray:
    """The numpy twin of matmul_int8_prefill / matmul_int4_prefill, in float64:
    the integer dot products exactly, then the fp32 scales. w: a quant.Weight
    (int8 / int4); xq, xs, xsum from kernels.quantize_activations."""
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
