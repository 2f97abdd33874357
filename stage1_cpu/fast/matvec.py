"""The one-region step's matrix phases (decode_step.py): out = W x for T tokens at once (or
for the k chosen experts of each token), W's rows cut into items that the workers claim.

Every row is the same inlined body the per-op kernels run, so the step's results are bit for
bit theirs: for rounded activations the register tiles of fast/tiles.py (through
kernels.tile_rows, as FastWeight.matmul), which read each weight once for all T tokens; for
fp32 activations the core's row bodies (stage1_cpu/matmul.py: row_f32, row_int8, row_int4;
fast/blocks.py: rows_bf16), one token after another on rows still in L1.

_matvec is a file of its own because numba stamps a cached function with the file that
defines it, and stage1_cpu/jit/numba_stamps.py widens that stamp to the files it inlines: here
the matmul files, not the norms or attention (fast/__init__.py). decode_step.py's worker
calls it through a function pointer (decode_step.Pointer), so an edit to a matmul kernel
recompiles this and not the worker, and an edit to RMSNorm the worker and not this.
"""
from __future__ import annotations

import os

import numba
import numpy as np

from .. import matmul
from ..kernels import FAST
from . import blocks, cpu, sync
from . import kernels as fk
from .tiles import ROWS

FMT = {"none": 0, "bf16": 1, "int8": 2, "int4": 3}
ACT = {"fp32": 0, "int8": 1, "int16": 2}
NONE, BF16, INT8, INT4 = range(4)
A_FP32, A_INT8, A_INT16 = range(3)
ITEMS_PER_WORKER = 16                     # small items per matmul and worker, at least ...
ITEM_BYTES = 1 << 18                      # ... and at most ~256 KB of weights per small item (~10 us)
BIG = 8                                   # a phase's first items are 8 small ones long ...
TAIL_ITEMS = 2                            # ... its last 2 per worker are small ones (see _items)
CHUNK = 8                                 # blocks of 8 rows per call of the tiles (the scratch: 64 x T)
# a segment of a matrix phase: its first row of W, first row of x, first row of out, tokens
SEG_ROW, SEG_X, SEG_OUT, SEG_TOKENS = range(4)

_njit = numba.njit(cache=True, fastmath=FAST, error_model="numpy")

# The row bodies a model uses, out of the seven below (the other arguments of _matvec are
# None): numba drops the branch of a None argument before it compiles anything, so a model
# compiles only its own formats' bodies (each a few seconds of LLVM's time). Where the CPU has
# no integer dot product, no weight has rounded activations (weight.check_act) and the tiles'
# bodies are never compiled (their arguments are None).
KINDS = ("f32", "bf16", "int8", "int4", "int8.q8", "int8.q16", "int4.q8")


def kinds(weights) -> tuple:
    """The body each weight's matvec runs (FastWeight.matmul's choice) -> True / None per KINDS.
    QS_FAST_ALL_KINDS=1: all this CPU can run (one compile serves every model: the tests set it)."""
    if os.environ.get("QS_FAST_ALL_KINDS") == "1":
        return tuple(True if cpu.INT8 or "." not in k else None for k in KINDS)
    used = set()
    for w in weights:
        act = getattr(w, "decode_act", "fp32")
        used.add({"none": "f32"}.get(w.fmt, w.fmt) if act == "fp32" else
                 f"{w.fmt}.q16" if act == "int16" else f"{w.fmt}.q8")
    return tuple(True if k in used else None for k in KINDS)


@numba.njit(inline="always")
def _items(nb, block_bytes, workers):
    """How a phase's nb blocks of 8 rows are cut into items: (small item's blocks, big item's
    blocks, number of big items, blocks they cover, number of items).

    Big items first, small ones last (the "guided" schedule of OpenMP): every item
    starts new memory streams, and the prefetcher needs a few misses on each before
    it runs ahead, so long items read faster; but the phase ends when its last item
    does, so the last ones are short. Which rows an item holds changes no result:
    every row's dot product is computed alone (tiles.py). Small enough that the phase's
    last item is short (the other workers wait for it), large enough that claims (tens of
    nanoseconds each) cost nothing."""
    small = max(1, min(-(-nb // (ITEMS_PER_WORKER * workers)), ITEM_BYTES // max(block_bytes, 1)))
    big = BIG * small
    n_big = max(0, nb - TAIL_ITEMS * workers * small) // big
    split = n_big * big
    return small, big, n_big, split, n_big + -(-(nb - split) // small)


@numba.njit(inline="always")
def _fp32_rows(fmt, x2, x3, x4, xsum4, t, wf, wb, q8, q4, s2, m2, r0, r1, out, ooff,
               k_f32, k_bf16, k_int8, k_int4):
    """out[ooff + r] = x[t] . W[r] for r0 <= r < r1, by the core's row bodies (fp32 activations)."""
    if fmt == BF16:
        if k_bf16 is not None:
            blocks.rows_bf16(x2, t, wb, r0, r1, out, ooff)
        return
    for r in range(r0, r1):
        if fmt == NONE:
            if k_f32 is not None:
                out[ooff + r] = matmul.row_f32(x2, t, wf, r)
        elif fmt == INT8:
            if k_int8 is not None:
                out[ooff + r] = matmul.row_int8(x3, t, q8, s2, r)
        elif k_int4 is not None:
            out[ooff + r] = matmul.row_int4(x4, xsum4, t, q4, s2, m2, r)


@_njit
def _matvec(m, data, scales, mins, x, segs, n, bias, out, counts, phase, workers,
            k_f32, k_bf16, k_int8, k_int4, k_q8, k_q16, k_q4):
    """Phase `phase`: for each segment s (segs [S, 4]: its first row of W, of x, of out, and
    its tokens), out[(o + j) n + i] = x[xr + j] . W[w0 + i] (+ bias[w0 + i]) for its tokens
    j and i < n: a matmul is one segment of all O rows and all T tokens; the experts phase one
    segment per token and chosen expert. x [R, K] (flat) is this worker's input. W is given by
    its format row m = (fmt, act, O, K, Kp, gs, seg) and flat arrays (tiled where act rounds:
    each segment's rows start a block of its own). The segments' blocks of 8 rows, end to end,
    are cut into claimed items. k_*: the row bodies this model uses (kinds()), None for the
    others."""
    fmt, act, O, K, Kp, gs, seg = m[0], m[1], m[2], m[3], m[4], m[5], m[6]
    nbs = -(-n // ROWS)                                          # blocks of one segment
    nb = segs.shape[0] * nbs
    G = Kp // gs if gs else 0
    V = scales.size // (G * ROWS) if seg else 0                  # tiled: blocks of 8 rows
    block_bytes = data.size // V if seg else ROWS * (data.size // O)
    small, big, n_big, split, n_items = _items(nb, block_bytes, workers)
    i = sync.claim(counts, phase)
    if i >= n_items:                                             # the others took every item
        sync.wait(counts, phase, n_items)
        return
    R = 0
    for s in range(segs.shape[0]):
        R = max(R, segs[s, SEG_X] + segs[s, SEG_TOKENS])
    # the input as matmul() sees it: padded to whole groups, then rounded as the weight asks
    x2 = np.zeros((R, Kp), dtype=np.float32)
    for t in range(R):                                           # (loops, not x2[:, :K] = ...: a slice
        for c in range(K):                                       # assignment compiles numba's error
            x2[t, c] = x[t * K + c]                              # message formatting, seconds of LLVM)
    x3 = x2.reshape(R, G, gs) if gs else np.empty((R, 0, 0), dtype=np.float32)
    x4 = x2.reshape(R, G // 2, 2, gs) if fmt == INT4 and act == A_FP32 else np.empty((R, 0, 2, 0), np.float32)
    xsum4 = np.empty((R, G // 2, 2), dtype=np.float32)
    xq = np.empty((R if act == A_INT8 else 0, G, gs), dtype=np.int8)
    x16 = np.empty((R if act == A_INT16 else 0, G, gs), dtype=np.int16)
    xs, xsum = np.empty((R, G), dtype=np.float32), np.empty((R, G), dtype=np.float32)
    xcorr = np.zeros((R, G), dtype=np.int32)
    for t in range(R):
        if fmt == INT4 and act == A_FP32:
            if k_int4 is not None:
                matmul.group_sums(x4, t, xsum4)
        if act == A_INT8:
            fk.quantize_token(x3, t, xq, xcorr, xs, xsum)
        elif act == A_INT16:
            fk.quantize_token16(x3, t, x16, xs, xsum)
    # the weight in the shape its kernel indexes (an empty stand-in for the other formats)
    wblock = data.size // V if seg else 0
    wf = data.view(np.float32).reshape(O, Kp) if fmt == NONE else np.empty((0, 0), dtype=np.float32)
    wb = data.view(np.uint16).reshape(O, Kp) if fmt == BF16 else np.empty((0, 0), dtype=np.uint16)
    q8 = data.view(np.int8).reshape(O, G, gs) if fmt == INT8 and not seg else np.empty((0, 0, 0), np.int8)
    q4 = data.reshape(O, G // 2, gs) if fmt == INT4 and not seg else np.empty((0, 0, 0), dtype=np.uint8)
    s2 = scales.reshape(O, G) if gs and not seg else np.empty((0, 0), dtype=np.uint16)
    m2 = mins.reshape(O, G) if fmt == INT4 and not seg else np.empty((0, 0), dtype=np.uint16)
    T_max = 0
    for s in range(segs.shape[0]):
        T_max = max(T_max, segs[s, SEG_TOKENS])
    scratch = np.empty(T_max * CHUNK * ROWS, dtype=np.float32)  # the tiles' outputs, [T, 64]
    x8, x16f = xq.reshape(-1), x16.reshape(-1)
    xsf, xcf, xsumf = xs.reshape(-1), xcorr.reshape(-1), xsum.reshape(-1)

    while i < n_items:
        b0 = i * big if i < n_big else split + (i - n_big) * small    # blocks b0..b1 of all segments
        b1 = min(nb, b0 + (big if i < n_big else small))
        while b0 < b1:                                           # an item may span segments
            s = b0 // nbs
            e = min(b1, (s + 1) * nbs)
            w0, xr, o0, nt = segs[s, SEG_ROW], segs[s, SEG_X], segs[s, SEG_OUT], segs[s, SEG_TOKENS]
            lb0, lb1 = b0 - s * nbs, e - s * nbs                 # the segment's blocks lb0..lb1
            if act == A_FP32:                                    # the core's bodies, a token at a time
                for j in range(nt):
                    _fp32_rows(fmt, x2, x3, x4, xsum4, xr + j, wf, wb, q8, q4, s2, m2, w0 + ROWS * lb0,
                               w0 + min(n, ROWS * lb1), out, (o0 + j) * n - w0, k_f32, k_bf16, k_int8, k_int4)
            else:                                                # the tiles: all nt tokens per weight load
                tb = (w0 // seg) * nbs                           # the segment's first block in the tiles
                for c0 in range(lb0, lb1, CHUNK):
                    c1 = min(lb1, c0 + CHUNK)
                    xo, xso = xr * Kp, xr * G                    # the segment's first token's activations
                    if fmt == INT8 and act == A_INT8:           # one call per kind, the others None:
                        if k_q8 is not None:                     # each compiled only where it is used
                            fk.tile_rows(x8, xo, xsf, xcf, xsumf, xso, data, wblock, scales, mins, G, gs,
                                         scratch, 0, CHUNK * ROWS, tb + c0, tb + c1, nt, k_q8, None, None, None)
                    elif fmt == INT8:
                        if k_q16 is not None:
                            fk.tile_rows(x16f, xo, xsf, xcf, xsumf, xso, data, wblock, scales, mins, G, gs,
                                         scratch, 0, CHUNK * ROWS, tb + c0, tb + c1, nt, None, k_q16, None, None)
                    elif k_q4 is not None:
                        fk.tile_rows(x8, xo, xsf, xcf, xsumf, xso, data, wblock, scales, mins, G, gs,
                                     scratch, 0, CHUNK * ROWS, tb + c0, tb + c1, nt, None, None, k_q4, None)
                    for j in range(nt):
                        for r in range(ROWS * c0, min(n, ROWS * c1)):
                            out[(o0 + j) * n + r] = scratch[j * CHUNK * ROWS + r - ROWS * c0]
            if bias.size:
                for j in range(nt):
                    for r in range(ROWS * lb0, min(n, ROWS * lb1)):
                        out[(o0 + j) * n + r] = out[(o0 + j) * n + r] + bias[w0 + r]
            b0 = e
        sync.finish(counts, phase)
        i = sync.claim(counts, phase)
    sync.wait(counts, phase, n_items)
