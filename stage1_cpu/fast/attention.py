"""Prefill attention as two matrix products per KV head, in register tiles.

Changed from the core (stage1_cpu/kernels.py: attention): the core gives each
(KV head, query) pair to a thread, whose loops compute one query's scores, softmax
and sum of values. For T queries at once that is compute-bound work, and it is two
matrix products per KV head and block of queries, (keys x queries) then
(probabilities x values), each a GEMM with D = head_dim or the key count inside.

    attention_tiled   (x86 with AVX2 and FMA) each thread takes whole (KV head, query
                      block) items; a block's scores, softmax and sum of values stay in
                      its caches; both products run on tile_f32, a register tile of
                      NA x 16 fp32 accumulators (what gemm.py's integer tile is, in fp32)
    attention_blas    (any other CPU) the same two products through numpy's BLAS, per KV
                      head and query block of ATT_BLOCK, one call at a time

Fewer than ATT_BLAS_MIN_T queries (decode, short prompts) keep the core's kernel.
KERNELS is the core's kernels module with that one op replaced: Model.forward calls
it where the core calls stage1_cpu/kernels.py (FastPath.kernels).

Why not BLAS everywhere: one layer of a 512-token prefill is 64 small GEMMs through
BLAS (8 KV heads x 4 query blocks x 2), each a start of BLAS's own threads, which take
turns with numba's on the same cores, with the softmax on one thread in between; with
K = D = 128 inside, the scores' product ran at about a fifth of the FMA's peak
(docs/stage1.md, section 14).
"""
import math
from types import SimpleNamespace

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import cpu, simd
from .. import kernels
from ..kernels import FAST, exp_f32

# BLAS: queries per block, the masked part above the diagonal is skipped per block
ATT_BLOCK = 128
ATT_BLAS_MIN_T = 16         # from 16 queries the two GEMMs beat the core's per-item loops
# 8-lane fp32 FMAs: attention_tiled compiles here
TILED = cpu.X86 and {"avx2", "fma"} <= cpu.FEATURES
# tile_f32: NA rows x NV 8-lane vectors, 12 accumulators (AVX2 has 16 registers)
NA, NV = 6, 2
ROWS = 64                   # attention_tiled: (query, head) rows per block, about (group x queries)

I64, F32 = ir.IntType(64), ir.FloatType()
FLOATS8 = ir.VectorType(F32, 8)


@intrinsic
def tile_f32(typingctx, a, aoff, ai, ak, b, boff, bk, n_k, c, coff, ci, n_a):
    """c[coff + i ci + l] = sum_{k < n_k} a[aoff + i ai + k ak] * b[boff + k bk + l] for i < min(NA,
    n_a), l < 8 NV (a, b, c: flat float32 arrays). Each step of k loads NV vectors of b's row k and
    broadcasts NA values of a, one per row of c: NA x NV FMAs for NV + NA loads. Rows past n_a
    repeat the last one (read, never stored)."""
    sig = types.void(a, aoff, ai, ak, b, boff, bk, n_k, c, coff, ci, n_a)

    def codegen(context, builder, signature, args):
        ty = signature.args
        a_, aoff_, ai_, ak_, b_, boff_, bk_, n_k_, c_, coff_, ci_, n_a_ = simd._as_int64(
            context, builder, signature, args)
        ap = builder.gep(simd._base(context, builder, ty[0], a_, F32), [aoff_])
        bp = builder.gep(simd._base(context, builder, ty[4], b_, F32), [boff_])
        cp = builder.gep(simd._base(context, builder, ty[8], c_, F32), [coff_])
        c64 = lambda v: ir.Constant(I64, v)          # noqa: E731
        last = builder.sub(n_a_, c64(1))
        aps = [builder.gep(ap, [builder.mul(builder.select(builder.icmp_signed("<", c64(i), n_a_),
                                                           c64(i), last),
                                            ai_)]) for i in range(NA)]
        fma = simd._declare(builder, "llvm.fma.v8f32", FLOATS8, [FLOATS8] * 3)
        acc = [[cgutils.alloca_once_value(builder, ir.Constant(FLOATS8, None)) for _ in range(NV)]
               for _ in range(NA)]
        with cgutils.for_range(builder, n_k_) as loop:
            k = loop.index
            row = builder.gep(bp, [builder.mul(k, bk_)])
            bv = [builder.load(builder.bitcast(builder.gep(row, [c64(8 * v)]),
                                               FLOATS8.as_pointer()), align=4)
                  for v in range(NV)]
            at = builder.mul(k, ak_)
            for i in range(NA):
                av = simd._splat(builder, builder.load(builder.gep(aps[i], [at])))
                for v in range(NV):
                    builder.store(builder.call(fma, [av, bv[v], builder.load(acc[i][v])]),
                                  acc[i][v])
        for i in range(NA):
            with builder.if_then(builder.icmp_signed("<", c64(i), n_a_), likely=True):
                for v in range(NV):
                    at = builder.add(builder.mul(c64(i), ci_), c64(8 * v))
                    builder.store(builder.load(acc[i][v]),
                                  builder.bitcast(builder.gep(cp, [at]), FLOATS8.as_pointer()),
                                  align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def attention_tiled(q, k_cache, v_cache, start_pos, out, tq):
    """kernels.attention's result into out [T, H, D] (D a multiple of 16), tq queries a block: each
    thread takes (KV head, block) items, whose `group` heads share the block's keys and values.
    For one item, with rows r = (query, head) pairs of the block:

        sT [n, R]  = K [n, D] @ qT [D, R]      the scores, keys x rows (tile_f32: NA keys x 16 rows)
        softmax of each column over the keys its query may see (0 .. its position), in place
        o  [R, D]  = sT.T [R, n] @ V [n, D]    (tile_f32: NA rows x 16 of D)
        out[query, head] = o[r] / the column's sum"""
    T, H, D = q.shape
    Hkv, Tmax = k_cache.shape[0], k_cache.shape[1]
    group = H // Hkv
    nb = -(-T // tq)
    # a block's rows, padded to whole tiles
    rp = -(-(tq * group) // (8 * NV)) * (8 * NV)
    scale = np.float32(1.0 / math.sqrt(D))
    kf, vf = k_cache.reshape(-1), v_cache.reshape(-1)
    for item in prange(Hkv * nb):
        kvh, i = item % Hkv, item // Hkv
        # blocks in the order 0, nb-1, 1, nb-2, ...: a block's keys grow with its place, and the
        # threads take equal runs of items, so each run holds as many long blocks as short ones
        b = i // 2 if i % 2 == 0 else nb - 1 - i // 2
        t0, t1 = b * tq, min(T, b * tq + tq)
        # the block's rows; the keys its last query sees
        rows, n = (t1 - t0) * group, start_pos + t1
        # [D, R]: column r = query t0 + r // group, head kvh * group + r % group
        qT = np.zeros((D, rp), dtype=np.float32)
        for r in range(rows):
            for d in range(D):
                qT[d, r] = q[t0 + r // group, kvh * group + r % group, d]
        sT = np.empty((n, rp), dtype=np.float32)               # [n, R]
        qTf, sTf = qT.reshape(-1), sT.reshape(-1)
        for j0 in range(0, n, NA):
            for r0 in range(0, rp, 8 * NV):
                tile_f32(kf, (kvh * Tmax + j0) * D, D, 1, qTf, r0, rp, D, sTf, j0 * rp + r0, rp,
                         n - j0)
        # softmax: column r sees keys 0 .. lim[r] (its position); exp((s - max) * scale), zero past
        # lim
        lim = np.empty(rp, dtype=np.int64)
        mx = np.empty(rp, dtype=np.float32)
        ssum = np.zeros(rp, dtype=np.float32)
        for r in range(rp):
            lim[r] = start_pos + t0 + r // group
            mx[r] = sT[0, r]
        for j in range(1, n):
            for r in range(rp):
                if j <= lim[r]:
                    mx[r] = max(mx[r], sT[j, r])
        for j in range(n):
            for r in range(rp):
                e = exp_f32((sT[j, r] - mx[r]) * scale)
                e = e if j <= lim[r] else np.float32(0.0)
                sT[j, r] = e
                ssum[r] += e
        o = np.empty((rp, D), dtype=np.float32)                # [R, D]
        of = o.reshape(-1)
        for r0 in range(0, rows, NA):
            for d0 in range(0, D, 8 * NV):
                tile_f32(sTf, r0, 1, rp, vf, kvh * Tmax * D + d0, D, n, of, r0 * D + d0, D,
                         rows - r0)
        for r in range(rows):
            inv = np.float32(1.0) / ssum[r]
            for d in range(D):
                out[t0 + r // group, kvh * group + r % group, d] = o[r, d] * inv


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


def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
              start_pos: int) -> np.ndarray:
    """kernels.attention, in register tiles (or through BLAS) from ATT_BLAS_MIN_T queries."""
    if q.shape[0] < ATT_BLAS_MIN_T:
        return kernels.attention(q, k_cache, v_cache, start_pos)
    T, H, D = q.shape
    if H % k_cache.shape[0]:
        raise ValueError(f"{H} query heads cannot share {k_cache.shape[0]} KV heads evenly")
    out = np.empty_like(q)
    if TILED and D % (8 * NV) == 0:
        attention_tiled(q, k_cache, v_cache, start_pos, out,
                        max(1, ROWS // (H // k_cache.shape[0])))
    else:
        attention_blas(q, k_cache, v_cache, start_pos, out)
    return out


KERNELS = SimpleNamespace(**{name: getattr(kernels, name) for name in
                             ("rmsnorm", "rope", "silu_mul", "route", "mix", "gated_add")},
                          attention=attention)
