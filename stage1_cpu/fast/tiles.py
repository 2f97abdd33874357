"""int8 / int4 weights stored in 8-row tiles, and the register tile that multiplies them by
one to a few thousand tokens: decode, a verify step of T tokens and prefill all run it.

Why a layout of its own. The core stores a matrix row by row ([O, G, gs]): a row's dot
product with one token ends in a sum across the lanes of a vector, so the fast path used
to keep 8 float lanes per row and group, one conversion and one multiply-add each per
group (docs/stage1.md, section 12). Here 8 rows sit side by side, 4 values at a time:

    data[v, u, l, j] = W[8 v + l, 4 u + j]      one 32-byte vector per block v and step u
                                                (int4: the byte of nibble pair j: value 4u+j
                                                of group 2p low, of group 2p + 1 high)
    scales[v, g, l]  = s[8 v + l, g]            8 rows' fp16 scales side by side (mins too)

so one instruction multiplies 4 values of 8 rows by the same 4 values of one token,
broadcast to every lane (vpdpbusd, 32 multiply-adds), and lane l of the int32 sum *is*
row l: no sum across lanes, a group's integer sum is exact, and its float work (one
conversion, one multiply-add with the scales) serves 8 rows at once. A weight vector,
loaded once, serves every token of the tile from a register: T tokens cost the bytes of
one (section 15).

    out[t, r] = sum_g  s[r, g] xs[t, g] * (q[r, g] . xq[t, g])     in that order of g,
              (+ m[r, g] xsum[t, g] after each group: int4's minimum)

Each output is the same float operations in the same order whatever the tile's size or
the number of tokens beside it: a step of T tokens gives T one-token steps' logits bit
for bit (tests/test_stage1_decode_step.py).

Which sums, by the activations' rounding (fast/kernels.py: quantize_token) and cpu.INT8:

    q8    int8 activations. VNNI: vpdpbusd(q ^ 0x80, x) from -128 sum(x) (unsigned by signed
          bytes: q + 128 is unsigned, its extra 128 sum(x) taken off first); int4 nibbles as
          they are. ARM: sdot, signed by signed. AVX2: vpmaddubsw (|x|, q sign(x)) then
          vpmaddwd by ones (its pair sums 2 x 127 x 127 stay within int16); nibbles x x add
          up in int16 over a chunk of 32 values, then widen.
    q16   int16 activations (the lm_head at decode, and prefill): the 32 bytes become two
          vectors of 16 int16 (rows 0-3, rows 4-7, 4 values each), multiplied by the token's
          4 values broadcast as pairs (vpdpwssd, or vpmaddwd): each row's sum sits in two
          lanes, added once per group.

A tile is RB blocks of 8 rows by TT tokens of int32 accumulators in registers (AVX2 has
16 ymm registers, AVX-512VL 32): RB x TT x 4 values per weight load and broadcast. TT is 1
(decode), 4, or 8 (a verify step of 5 to 8 tokens, where 8 tokens' accumulators fit).
Compiled for one (kind, RB, TT) each; nothing here is compiled where cpu.INT8 is None.
The numpy twin: tiles_ref below (and FastWeight.matmul_ref).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..kernels import FAST
from ..matmul import f16_to_f32
from . import cpu, simd

ROWS = 8                      # rows in one vector: 8 lanes of int32
CHUNK = 32                    # values per unrolled run of steps (AVX2 int4: its int16 sums' limit)
VNNI, SDOT = simd.VNNI, simd.SDOT
REGISTERS = 32 if "avx512vl" in cpu.FEATURES or cpu.ARM64 else 16
# (RB, TT) per kind and token count: int32 accumulators RB x TT (x 2 for q16, x 2 for int4's pair of
# groups) within the registers, with room for the weights and the broadcasts; chosen by timing
# the step (bench profile): an int4 token runs faster in 2 blocks than in 8 on AVX-512
SHAPES = {("int8.q8", 1): (8, 1), ("int8.q8", 4): (4, 4) if REGISTERS == 32 else (2, 4),
          ("int4.q8", 1): (2, 1) if REGISTERS == 32 else (4, 1),
          ("int4.q8", 4): (2, 4) if REGISTERS == 32 else (1, 4),
          ("int8.q16", 1): (4, 1), ("int8.q16", 4): (2, 4) if REGISTERS == 32 else (1, 4),
          ("int4.q16", 1): (2, 1), ("int4.q16", 4): (1, 4),
          # 8 tokens at once where their accumulators fit beside the weights; else two tiles of 4
          ("int8.q8", 8): (2, 8) if REGISTERS == 32 else (1, 8),
          ("int4.q8", 8): None,
          ("int8.q16", 8): (1, 8) if REGISTERS == 32 else None, ("int4.q16", 8): None}
# per kind, how many last tokens past a multiple of 4 (0 or 1) run in the one-token tile rather
# than in a tile of 4 (or of 8) that computes 4 (or 8) tokens for them; timed on Zen 4, a step of 5:
# the default model's int4 layers, +1.4 ms over a step of 4 in 4 + 1 against +2.8 in 4 + 4; the
# 0.6B shape's int16 lm_head 6.5 ms in 4 + 1 against 8.4 in its tile of 8; its int8 layers, faster
# in the tile of 8 (2 x 8) than in 4 + 1
ONE_BY_ONE = {"int8.q8": 0, "int4.q8": 1, "int8.q16": 1, "int4.q16": 1}

I8, I16, I32, I64, F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                          ir.FloatType())
BYTES32, BYTES16 = ir.VectorType(I8, 32), ir.VectorType(I8, 16)
SHORTS16, INTS8, FLOATS8 = ir.VectorType(I16, 16), ir.VectorType(I32, 8), ir.VectorType(F32, 8)


# ---------------------------------------------------------------------------
# The layout: made once at load time (FastWeight), read back for the embedding
# ---------------------------------------------------------------------------


def padded_rows(O: int, seg: int) -> int:
    """Rows of the tiled matrix: each segment of seg rows (one expert of a stack; or all O)
    padded to whole vectors of 8."""
    return (O // seg) * (-(-seg // ROWS) * ROWS)


@njit(parallel=True, cache=True)
def _to_tiles(words, seg, out):
    """words [O, N] uint32 (4 stored values each) -> out [V, N, 8]: row r of segment i at tiled
    row i seg8 + r % seg, zeros in the padding."""
    V, N = out.shape[0], out.shape[1]
    seg8 = -(-seg // ROWS) * ROWS
    for v in prange(V):
        for lane in range(ROWS):
            i, r = divmod(v * ROWS + lane, seg8)
            for k in range(N):
                out[v, k, lane] = words[i * seg + r, k] if r < seg else 0


@njit(parallel=True, cache=True)
def _scales_to_tiles(s, seg, out):
    """s [O, G] fp16 bits -> out [V, G, 8], padded as _to_tiles."""
    V, G = out.shape[0], out.shape[1]
    seg8 = -(-seg // ROWS) * ROWS
    for v in prange(V):
        for lane in range(ROWS):
            i, r = divmod(v * ROWS + lane, seg8)
            for g in range(G):
                out[v, g, lane] = s[i * seg + r, g] if r < seg else 0


def to_tiles(data: np.ndarray, scales: np.ndarray, mins, seg: int):
    """A stored int8 [O, G, gs] or int4 [O, G/2, gs] matrix (and its [O, G] scales, minima)
    -> (data [V, N, 32] bytes, scales [V, G, 8], mins or None), V = padded_rows / 8."""
    O = data.shape[0]
    V = padded_rows(O, seg) // ROWS
    words = np.ascontiguousarray(data).reshape(O, -1).view(np.uint32)
    tiled = np.empty((V, words.shape[1], ROWS), dtype=np.uint32)
    _to_tiles(words, seg, tiled)

    def side(a):
        out = np.empty((V, a.shape[1], ROWS), dtype=np.uint16)
        _scales_to_tiles(np.ascontiguousarray(a).view(np.uint16), seg, out)
        return out
    return (tiled.view(data.dtype).reshape(V, -1, 32), side(scales),
            None if mins is None else side(mins))


def tiled_row(r, seg):
    """Row r of the matrix -> its row in the tiled (padded) order."""
    return (r // seg) * (-(-seg // ROWS) * ROWS) + r % seg


@njit(cache=True, fastmath=FAST, error_model="numpy")
def dequant_rows(ids, data, scales, mins, int4, gs, out):
    """Rows ids (tiled order) of a tiled matrix into out [R, Kp] f32: W = q s (int8), or
    nibble s + m (int4). The embedding lookup, and the core's prefill tile where it runs."""
    G = out.shape[1] // gs
    for i in range(ids.shape[0]):
        v, lane = ids[i] // ROWS, ids[i] % ROWS
        for g in range(G):
            sc = f16_to_f32(scales[v, g, lane])
            mn = f16_to_f32(mins[v, g, lane]) if int4 else np.float32(0.0)
            shift = 4 * (g & 1) if int4 else 0
            base = ((g >> 1) if int4 else g) * gs // 4          # the group's first step
            for u in range(gs // 4):                             # 4 values a step, lane's 4 bytes
                for j in range(4):
                    b = data[v, base + u, lane * 4 + j]
                    if int4:
                        out[i, g * gs + 4 * u + j] = np.float32((b >> shift) & 15) * sc + mn
                    else:
                        out[i, g * gs + 4 * u + j] = np.float32(np.int8(b)) * sc


def untile(data, scales, mins, O: int, seg: int, Kp: int, int4: bool):
    """The row-major arrays back (tests and references): data [O, G, gs] or [O, G/2, gs]."""
    rows = np.array([tiled_row(r, seg) for r in range(O)], dtype=np.int64)
    v, lane = rows // ROWS, rows % ROWS
    per_row = Kp // 2 if int4 else Kp
    d = data.reshape(data.shape[0], -1, ROWS, 4)[v, :, lane].reshape(O, per_row)
    back = lambda a: None if a is None else np.ascontiguousarray(a[v, :, lane])  # noqa: E731
    return d, back(scales), back(mins)


# ---------------------------------------------------------------------------
# The register tile
# ---------------------------------------------------------------------------


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _ptr(context, builder, aty, ary, elem, offset):
    """Pointer to element `offset` of a 1-D numba array, as elem*."""
    base = builder.bitcast(context.make_array(aty)(context, builder, ary).data, elem.as_pointer())
    return builder.gep(base, [offset])


def _splat(builder, value, count):
    """A scalar (i32, i64 or f32) repeated `count` times."""
    vty = ir.VectorType(value.type, count)
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(ir.VectorType(I32, count), [0] * count))


def _tile_codegen(int4: bool, q16: bool, RB: int, TT: int):
    """The body of one tile kind (the argument order: TILE_ARGS)."""

    def codegen(context, builder, sig, args):
        (w_, woff, x_, xoff, Kp, s_, soff, xs_, xsoff, G, gs, m_, xcorr_, xsum_, out_, ooff,
         ostride, n_rb, n_tok) = [context.cast(builder, a, t, types.int64)
                                  if isinstance(t, types.Integer) else a
                                  for a, t in zip(args, sig.args)]
        ty = sig.args
        c = lambda v: ir.Constant(I64, v)          # noqa: E731
        last = lambda n, i: builder.select(  # noqa
            builder.icmp_signed("<", c(i), n), c(i), builder.sub(n, c(1)))
        rbs, toks = [last(n_rb, r) for r in range(RB)], [last(n_tok, t) for t in range(TT)]
        # bytes of one block of 8 rows
        vbytes = builder.mul(Kp, c(4 if int4 else 8))
        wps = [builder.gep(_ptr(context, builder, ty[0], w_, I8, woff), [builder.mul(r, vbytes)])
               for r in rbs]
        xps = [builder.gep(_ptr(context, builder, ty[2], x_, I16 if q16 else I8, xoff),
                           [builder.mul(t, Kp)])
               for t in toks]
        G8 = builder.mul(G, c(ROWS))
        sps = [builder.gep(_ptr(context, builder, ty[5], s_, I16, soff), [builder.mul(r, G8)])
               for r in rbs]
        mps = [builder.gep(_ptr(context, builder, ty[11], m_, I16, soff), [builder.mul(r, G8)])
               for r in rbs]
        def per_token(i, arr, elem):               # token t's G values of xs / xcorr / xsum
            base = _ptr(context, builder, ty[i], arr, elem, xsoff)
            return [builder.gep(base, [builder.mul(t, G)]) for t in toks]
        xsps, xcps, xsumps = (per_token(7, xs_, F32), per_token(12, xcorr_, I32),
                              per_token(13, xsum_, F32))
        fma = _fn(builder, "llvm.fma.v8f32", FLOATS8, [FLOATS8] * 3)
        maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", SHORTS16, [BYTES32, BYTES32])
        maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", INTS8, [SHORTS16, SHORTS16])
        psign = _fn(builder, "llvm.x86.avx2.psign.b", BYTES32, [BYTES32, BYTES32])
        prefetch = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(),
                       [I8.as_pointer(), I32, I32, I32])
        ones = ir.Constant(SHORTS16, [1] * 16)
        # q16: rows 0-3 and 4-7 apart
        n_acc = 2 if q16 else 1
        # groups a pass over the bytes serves: int4's pair, low and high nibbles
        H = 2 if int4 else 1
        facc = [[cgutils.alloca_once_value(builder, ir.Constant(FLOATS8, None)) for _ in range(TT)]
                for _ in range(RB)]
        iacc = [[[[cgutils.alloca_once(builder, INTS8) for _ in range(n_acc)] for _ in range(TT)]
                 for _ in range(RB)] for _ in range(H)]
        avx2_int8_q8 = not (VNNI or SDOT) and not q16 and not int4         # |x| by q sign(x)
        avx2_int4_q8 = not (VNNI or SDOT) and not q16 and int4             # int16 sums over a chunk
        # q ^ 0x80, from -128 sum(x)
        bias = VNNI and not q16 and not int4
        low4, four = ir.Constant(BYTES32, [15] * 32), ir.Constant(BYTES32, [4] * 32)
        flip = ir.Constant(BYTES32, [-128] * 32)

        def dots(acc, acc16, ws, xb):
            """One step of every accumulator: the RB weight vectors ws by the TT tokens'
            broadcasts xb."""
            if q16:                             # rows 0-3 and 4-7 as 16 int16 each
                ext = builder.zext if int4 else builder.sext
                halves = [[ext(builder.shuffle_vector(w, w, ir.Constant(ir.VectorType(I32, 16),
                                                                         list(range(h, h + 16)))),
                               SHORTS16)
                           for h in (0, 16)] for w in ws]
            for t in range(TT):
                if avx2_int8_q8:
                    xa = builder.call(psign, [xb[t], xb[t]])        # |x| (x sign(x))
                for r in range(RB):
                    a = acc[r][t]
                    if q16:
                        a[0] = simd._vpdpwssd(builder, a[0], halves[r][0], xb[t])
                        a[1] = simd._vpdpwssd(builder, a[1], halves[r][1], xb[t])
                    elif avx2_int8_q8:
                        pairs = builder.call(maddubs, [xa, builder.call(psign, [ws[r], xb[t]])])
                        a[0] = builder.add(a[0], builder.call(maddwd, [pairs, ones]))
                    elif avx2_int4_q8:
                        acc16[r][t] = builder.add(acc16[r][t],
                                                  builder.call(maddubs, [ws[r], xb[t]]))
                    else:
                        a[0] = simd._vpdpbusd(builder, ws[r], xb[t], a[0])

        # one unit a loop turn: a group (int8), or a pair of groups in the same bytes (int4)
        with cgutils.for_range(builder, builder.udiv(G, c(H))) as ul:
            u = ul.index
            for h in range(H):
                g = builder.add(builder.mul(u, c(H)), c(h))
                # each group's int32 sums start from zero (or -128 sum(x))
                for r in range(RB):
                    for t in range(TT):
                        start = (_splat(builder, builder.load(builder.gep(xcps[t], [g])), 8) if bias
                                 else ir.Constant(INTS8, None))
                        for a in iacc[h][r][t]:
                            builder.store(start, a)
            # the unit's bytes in a block
            uw = builder.mul(u, builder.mul(gs, c(ROWS)))
            with cgutils.for_range(builder, builder.udiv(gs, c(CHUNK))) as cl:
                cw = builder.add(uw, builder.mul(cl.index, c(CHUNK * ROWS)))
                acc = [[[[builder.load(a) for a in iacc[h][r][t]] for t in range(TT)]
                        for r in range(RB)] for h in range(H)]
                acc16 = [[[ir.Constant(SHORTS16, None) for t in range(TT)] for r in range(RB)]
                         for h in range(H)]
                # the next tile's bytes (RB blocks on), this chunk's lines, asked for while this
                # one multiplies, for one token as for several: the reads overlap the arithmetic
                ahead = builder.add(builder.mul(vbytes, c(RB)), cw)
                for p in wps:
                    for line in range(0, CHUNK * ROWS, 64):
                        builder.call(prefetch, [builder.gep(p, [builder.add(ahead, c(line))]),
                                                ir.Constant(I32, 0), ir.Constant(I32, 2),
                                                ir.Constant(I32, 1)])
                for j in range(CHUNK // 4):         # a step: 4 values of 8 rows, one 32-byte vector
                    raw = [builder.load(
                        builder.bitcast(builder.gep(p, [builder.add(cw, c(32 * j))]),
                                        BYTES32.as_pointer()),
                        align=1) for p in wps]
                    for h in range(H):
                        # group 2u + h: the low nibbles, then the high ones
                        if int4:
                            ws = [builder.and_(builder.lshr(w, four) if h else w, low4)
                                  for w in raw]
                        else:
                            ws = [builder.xor(w, flip) for w in raw] if bias else raw
                        g = builder.add(builder.mul(u, c(H)), c(h))
                        cx = builder.add(builder.mul(g, gs),
                                         builder.add(builder.mul(cl.index, c(CHUNK)), c(4 * j)))
                        # the token's 4 int16 values as pairs, in every lane
                        if q16:
                            xv = [builder.load(builder.bitcast(builder.gep(p, [cx]),
                                                               I64.as_pointer()), align=2)
                                  for p in xps]
                            xb = [builder.bitcast(_splat(builder, v, 4), SHORTS16) for v in xv]
                        else:                       # its 4 int8 values, in every lane
                            xv = [builder.load(builder.bitcast(builder.gep(p, [cx]),
                                                               I32.as_pointer()), align=1)
                                  for p in xps]
                            xb = [builder.bitcast(_splat(builder, v, 8), BYTES32) for v in xv]
                        dots(acc[h], acc16[h], ws, xb)
                for h in range(H):
                    for r in range(RB):
                        for t in range(TT):
                            if avx2_int4_q8:
                                acc[h][r][t][0] = builder.add(
                                    acc[h][r][t][0], builder.call(maddwd, [acc16[h][r][t], ones]))
                            for a, slot in zip(acc[h][r][t], iacc[h][r][t]):
                                builder.store(a, slot)
            for h in range(H):
                # group g's epilogue, in the order of g: 8 rows' exact int32 sums to fp32, times s
                # xs (int4: then + m xsum)
                g = builder.add(builder.mul(u, c(H)), c(h))
                svs = [simd._halves8(builder, p, builder.mul(g, c(ROWS))) for p in sps]
                for t in range(TT):
                    xsb = _splat(builder, builder.load(builder.gep(xsps[t], [g])), 8)
                    for r in range(RB):
                        # lanes (r0a r0b r1a r1b r2a r2b r3a r3b) (r4a ...): pair them
                        if q16:
                            lo, hi = (builder.load(a) for a in iacc[h][r][t])
                            idx = lambda k: ir.Constant(ir.VectorType(I32, 8),  # noqa: E731
                                                        list(range(k, 16, 2)))
                            dot = builder.add(builder.shuffle_vector(lo, hi, idx(0)),
                                              builder.shuffle_vector(lo, hi, idx(1)))
                        else:
                            dot = builder.load(iacc[h][r][t][0])
                        scale = builder.fmul(svs[r], xsb)
                        builder.store(builder.call(fma, [builder.sitofp(dot, FLOATS8), scale,
                                                         builder.load(facc[r][t])]), facc[r][t])
                if int4:                        # the minimum: m[r, g] xsum[t, g], 8 rows per FMA
                    for r in range(RB):
                        mv = simd._halves8(builder, mps[r], builder.mul(g, c(ROWS)))
                        for t in range(TT):
                            xm = _splat(builder, builder.load(builder.gep(xsumps[t], [g])), 8)
                            builder.store(builder.call(fma, [mv, xm, builder.load(facc[r][t])]),
                                          facc[r][t])
        obase = _ptr(context, builder, ty[14], out_, F32, ooff)
        for t in range(TT):
            for r in range(RB):
                keep = builder.and_(builder.icmp_signed("<", c(t), n_tok),
                                    builder.icmp_signed("<", c(r), n_rb))
                with builder.if_then(keep, likely=True):
                    at = builder.add(builder.mul(c(t), ostride), c(ROWS * r))
                    builder.store(builder.load(facc[r][t]),
                                  builder.bitcast(builder.gep(obase, [at]), FLOATS8.as_pointer()),
                                  align=4)
        return context.get_dummy_value()

    return codegen


TILE_ARGS = ("w", "woff", "x", "xoff", "Kp", "s", "soff", "xs", "xsoff", "G", "gs", "m", "xcorr",
             "xsum", "out", "ooff", "ostride", "n_rb", "n_tok")
_TILE_DOC = """{what}: out[ooff + t ostride + 8 i + l] = row l of block i, token t, for
    i < min(RB, n_rb), t < min(TT, n_tok) ({RB} x {TT}). w: the tiled weights, block i at
    woff + i (bytes a block); x: token t's rounded activations at xoff + t Kp; s (and m): block
    i's at soff + i G 8; xs, xcorr (int32 -128 sum(xq), VNNI int8 only), xsum (int4's): token
    t's at xsoff + t G. Blocks and tokens past n_rb / n_tok repeat the last ones (read, never
    stored)."""


def _make_tile(int4: bool, q16: bool, TT: int):
    """-> (the tile, RB, TT); TT = 8 where SHAPES has no room for 8 tokens gives the tile of 4."""
    shape = SHAPES[(f"{'int4' if int4 else 'int8'}.{'q16' if q16 else 'q8'}", TT)]
    if shape is None:
        return _make_tile(int4, q16, 4)
    RB = shape[0]

    def tile(typingctx, w, woff, x, xoff, Kp, s, soff, xs, xsoff, G, gs, m, xcorr, xsum, out, ooff,
             ostride, n_rb, n_tok):
        sig = types.void(w, woff, x, xoff, Kp, s, soff, xs, xsoff, G, gs, m, xcorr, xsum, out, ooff,
                         ostride, n_rb, n_tok)
        return sig, _tile_codegen(int4, q16, RB, TT)
    what = f"{'int4' if int4 else 'int8'} weights x {'int16' if q16 else 'int8'} activations"
    tile.__doc__ = _TILE_DOC.format(what=what, RB=RB, TT=TT)
    return intrinsic(tile), RB, TT


def _blocks(int4: bool, q16: bool):
    """The loops around one kind's tiles: blocks v0..v1 of a tiled matrix by T tokens."""
    (tile1, RB1, _), (tile4, RB4, _), (tile8, RB8, TT8) = (_make_tile(int4, q16, TT)
                                                           for TT in (1, 4, 8))
    one_by_one = ONE_BY_ONE[f"{'int4' if int4 else 'int8'}.{'q16' if q16 else 'q8'}"]

    @njit(inline="always", fastmath=FAST, error_model="numpy")
    def blocks(w, wblock, x, xoff, Kp, s, xs, xcorr, xsum, xsoff, m, G, gs, out, ooff, ostride, v0,
               v1, T):
        """out[ooff + t ostride + 8 (v - v0) + l] = row l of block v . token t, for v0 <= v < v1,
        t < T: one token in tiles of RB1 blocks; more in tiles of RB4 blocks by 4 tokens, a step
        of 5 to 8 in one tile of 8 where its accumulators fit the registers; a last token past a
        multiple of 4, where the kind's ONE_BY_ONE says so, in the one-token tile rather than in a
        tile that would compute 4 or 8 for it. Each block's bytes are read from memory once: the
        tiles after the first find them in L1 or L2. Flat arrays and offsets, no views: a view of
        an array the threads share costs an atomic count on a cache line every thread writes."""
        if T == 1:
            for v in range(v0, v1, RB1):
                tile1(w, v * wblock, x, xoff, Kp, s, v * G * ROWS, xs, xsoff, G, gs, m, xcorr, xsum,
                      out, ooff + ROWS * (v - v0), ostride, min(RB1, v1 - v), 1)
        elif TT8 == 8 and 4 + one_by_one < T <= 8:
            for v in range(v0, v1, RB8):
                tile8(w, v * wblock, x, xoff, Kp, s, v * G * ROWS, xs, xsoff, G, gs, m, xcorr, xsum,
                      out, ooff + ROWS * (v - v0), ostride, min(RB8, v1 - v), T)
        else:
            left = T % 4 if T % 4 <= one_by_one else 0      # tokens for the one-token tile
            step = max(RB1, RB4)                             # (both powers of 2)
            for v in range(v0, v1, step):
                end = min(v + step, v1)
                for t in range(0, T - left, 4):
                    for u in range(v, end, RB4):
                        tile4(w, u * wblock, x, xoff + t * Kp, Kp, s, u * G * ROWS, xs,
                              xsoff + t * G, G, gs, m, xcorr, xsum, out,
                              ooff + t * ostride + ROWS * (u - v0), ostride, min(RB4, end - u),
                              min(4, T - left - t))
                for t in range(T - left, T):
                    for u in range(v, end, RB1):
                        tile1(w, u * wblock, x, xoff + t * Kp, Kp, s, u * G * ROWS, xs,
                              xsoff + t * G, G, gs, m, xcorr, xsum, out,
                              ooff + t * ostride + ROWS * (u - v0), ostride, min(RB1, end - u), 1)
    return blocks


blocks_int8_q8 = _blocks(False, False)
blocks_int8_q16 = _blocks(False, True)
blocks_int4_q8 = _blocks(True, False)
blocks_int4_q16 = _blocks(True, True)
# xcorr = -BIAS sum(xq): the int8 x int8 tiles' sums start from it (VNNI)
BIAS = 128 if VNNI else 0
