"""Prefill on integers: a GEMM of rounded activations by the weights' 8-row tiles.

Why (docs/stage1.md, "Prefill on integers"): the core's prefill dequantizes
ROW_BLOCK rows to an fp32 tile and hands it to BLAS sgemm, one fp32
multiply-add per weight and token, 8 per FMA instruction. Here the
activations are rounded per token and group to int16 (--activations auto,
kernels.quantize_activations16) or to int8, exactly as decode does
(--activations int8, kernels.quantize_activations), and each group's dot
product is integer multiply-adds, 16 per vpdpwssd / vpmaddwd (int16 activations)
or 32 per vpdpbusd / vpmaddubsw (int8), on tiles.py's register tiles: the weights
are stored in 8-row tiles already (FastWeight), so prefill reads them as decode
does, with no copy or repack per call.

    out[t, r] = sum_g s[r, g] xs[t, g] (q[r, g] . xq[t, g])          int8
              + sum_g m[r, g] xsum[t, g]                             int4 (its minimum)

The threads claim blocks of BLOCK_V x 8 rows one at a time from a shared counter
(sync.claim), each its next one ahead, whose bytes are prefetched while the current
one multiplies: a thread that runs slower (a VM's busy neighbour, a core with other
work) takes fewer blocks instead of holding the others up. A block (64 rows x Kp
bytes) stays in L2 while TOKEN_BLOCK tokens at a time go through it, 4 per tile.

Instructions (cpu.INT8): on VNNI vpdpwssd and vpdpbusd; on AVX2 vpmaddwd + vpaddd and
vpmaddubsw + vpmaddwd; on ARM64 sdot for int8 activations, and for int16 ones the
products widened and added in pairs (ARM has no int16 dot product: --activations
auto keeps its prefill on sgemm, cpu.INT16_GEMM). None of it is compiled where
cpu.INT8 is None: weight.py never calls it there. The numpy twin: gemm_ref below.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..kernels import FAST
from . import kernels as fk
from . import tiles
from .sync import SLOT, claim

BLOCK_V = 8                   # 8-row blocks a thread takes at a time (64 rows x Kp bytes: in L2)
# tokens per pass over a block of rows (48 x Kp activations: in L2 beside it)
TOKEN_BLOCK = 48
VNNI, REGISTERS = tiles.VNNI, tiles.REGISTERS
I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)


@intrinsic
def prefetch(typingctx, a, byte):
    """Asks for the 64-byte line holding byte `byte` of array a, into L2 (prefetcht1)."""
    def codegen(context, builder, signature, args):
        base = context.make_array(signature.args[0])(context, builder, args[0]).data
        p = builder.gep(builder.bitcast(base, I8.as_pointer()),
                        [context.cast(builder, args[1], signature.args[1], types.int64)])
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(),
                                            [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0i8")
        builder.call(fn, [p, ir.Constant(I32, 0), ir.Constant(I32, 2), ir.Constant(I32, 1)])
        return context.get_dummy_value()
    return types.void(a, byte), codegen


@njit(inline="always", fastmath=FAST, error_model="numpy")
def prefetch_blocks(a, v0, v1):
    """Asks for blocks v0 .. v1 of a C array a [V, ...] into L2, a line at a time."""
    n = a.size // a.shape[0] * a.itemsize
    for byte in range(v0 * n, min(v1, a.shape[0]) * n, 64):
        prefetch(a, byte)


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def gemm_tiled(x, xs, xcorr, xsum, data, scales, mins, out, workers, k8_8, k8_16, k4_8, k4_16):
    """x [T, Kp] rounded activations (int8 or int16), xs, xcorr, xsum [T, G]; data, scales, mins:
    a tiled matrix (tiles.py) -> out [T, 8 V]. k*: its kind (kernels.tile_rows). Each of the workers
    (numba.get_num_threads(), passed in: called in here, it would keep this from the disk cache)
    claims blocks of BLOCK_V x 8 rows until none is left."""
    T, Kp = x.shape
    V, G = scales.shape[0], scales.shape[1]
    gs = Kp // G
    xf, xsf, xcf, xsumf, of = (x.reshape(-1), xs.reshape(-1), xcorr.reshape(-1),
                               xsum.reshape(-1), out.reshape(-1))
    w, s, m, wblock = data.reshape(-1), scales.reshape(-1), mins.reshape(-1), data.size // V
    n_blocks = -(-V // BLOCK_V)
    claims = np.zeros(2 * SLOT, dtype=np.int64)     # sync.counters(1): one phase, the blocks
    for _ in prange(workers):
        blk = claim(claims, 0)
        while blk < n_blocks:
            # this thread's next block, claimed now: its bytes are read
            nxt = claim(claims, 0)
            prefetch_blocks(data, BLOCK_V * nxt, BLOCK_V * (nxt + 1))    # while this one multiplies
            v0, v1 = BLOCK_V * blk, min(V, BLOCK_V * (blk + 1))
            for t0 in range(0, T, TOKEN_BLOCK):
                fk.tile_rows(xf, t0 * Kp, xsf, xcf, xsumf, t0 * G, w, wblock, s, m, G, gs, of,
                             t0 * out.shape[1] + tiles.ROWS * v0, out.shape[1], v0, v1,
                             min(TOKEN_BLOCK, T - t0), k8_8, k8_16, k4_8, k4_16)
            blk = nxt


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def round_prompt16(x3):
    """kernels.quantize_activations16 for a prompt's tokens on all threads: x3 [T, G, gs] f32 ->
    x16 [T, G, gs] int16, xs, xsum [T, G] f32."""
    T, G, gs = x3.shape
    x16 = np.empty((T, G, gs), dtype=np.int16)
    xs, xsum = np.empty((T, G), dtype=np.float32), np.empty((T, G), dtype=np.float32)
    for t in prange(T):
        fk.quantize_token16(x3, t, x16, xs, xsum)
    return x16, xs, xsum


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def round_prompt8(x3):
    """kernels.quantize_activations for a prompt's tokens on all threads -> xq int8, xcorr int32,
    xs, xsum."""
    T, G, gs = x3.shape
    xq, xcorr = np.empty((T, G, gs), dtype=np.int8), np.empty((T, G), dtype=np.int32)
    xs, xsum = np.empty((T, G), dtype=np.float32), np.empty((T, G), dtype=np.float32)
    for t in prange(T):
        fk.quantize_token(x3, t, xq, xcorr, xs, xsum)
    return xq, xcorr, xs, xsum


def gemm(w, x: np.ndarray, act: str = "int8") -> np.ndarray:
    """x [T, Kp] f32 (padded) @ W.T for a tiled FastWeight (int8 / int4) -> [T, 8 V] (the tiled
    rows: FastWeight._rows_out takes the padding out), x rounded to int8 per token and group (act
    "int8") or to int16 (act "int16": almost exact; int16 products, 16 per instruction)."""
    T = x.shape[0]
    x3 = x.reshape(T, -1, w.group_size)                                          # [T, G, gs]
    if act == "int16":
        # [T, G, gs], [T, G]
        xq, xs, xsum = round_prompt16(x3)
        xcorr = np.zeros(xs.shape, dtype=np.int32)
    else:
        xq, xcorr, xs, xsum = round_prompt8(x3)
    out = np.empty((T, w.data.shape[0] * tiles.ROWS), dtype=np.float32)
    # kernels.tile_rows' kind
    k = [None] * 4
    k[2 * (w.fmt == "int4") + (act == "int16")] = True
    mins = w.scales if w.mins is None else w.mins
    gemm_tiled(xq.reshape(T, -1), xs, xcorr, xsum, w.data, w.scales, mins, out,
               numba.get_num_threads(), *k)
    return out


def gemm_ref(xq, xs, xsum, w) -> np.ndarray:
    """The numpy twin of gemm_tiled (and of the decode tiles), in float64: the integer dot products
    exactly, then the fp32 scales. w: a quant.Weight or FastWeight (int8 / int4), in tiles or not;
    xq, xs, xsum from kernels.quantize_activations, or x16, xs, xsum from quantize_activations16."""
    T, G, gs = xq.shape
    O = w.out_features
    data, scales, mins = w.data, w.scales, w.mins
    if getattr(w, "tiled", False):
        data, scales, mins = tiles.untile(data, scales, mins, O, w.seg, G * gs, w.fmt == "int4")
    s = scales.view(np.float16).astype(np.float64).reshape(O, G)            # [O, G]
    if w.fmt == "int8":
        q = data.astype(np.int64).reshape(O, G, gs)                          # [O, G, gs]
    else:
        b = data.reshape(O, G // 2, gs)
        q = np.stack([b & 15, b >> 4], axis=2).reshape(O, G, gs).astype(np.int64)
    # [T, O, G], exact integers
    dots = np.einsum("ogj,tgj->tog", q, xq.astype(np.int64))
    out = (dots * (s[None] * xs.astype(np.float32)[:, None, :].astype(np.float64))).sum(-1)
    if w.fmt == "int4":
        out += xsum.astype(np.float64) @ mins.view(np.float16).astype(np.float64).reshape(O, G).T
    return out
