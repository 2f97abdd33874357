"""The one-region decode step's matrix phases (decode_step.py): out = W x for one
matrix (or the k chosen experts' rows), its rows cut into items that the workers claim.

Every row is the same inlined body the per-op kernels run (stage1_cpu/matmul.py: row_f32,
row_int8, row_int4; fast/blocks.py: rows_bf16; for rounded activations fast/kernels.py: rows_int8_q8,
rows_int8_q16, rows_int4_q8), so the step's results are bit for bit the core's.

_matvec is a file of its own because numba stamps a cached function with the file that
defines it, and common/numba_stamps.py widens that stamp to the files it inlines: here
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

FMT = {"none": 0, "bf16": 1, "int8": 2, "int4": 3}
ACT = {"fp32": 0, "int8": 1, "int16": 2}
NONE, BF16, INT8, INT4 = range(4)
A_FP32, A_INT8, A_INT16 = range(3)
ITEMS_PER_WORKER = 16                     # small row blocks per matmul and worker, at least ...
ITEM_BYTES = 1 << 18                      # ... and at most ~256 KB of weights per small block (~10 us)
BIG = 8                                   # a phase's first items are 8 small blocks long ...
TAIL_ITEMS = 2                            # ... its last 2 per worker are small ones (see _items)

_njit = numba.njit(cache=True, fastmath=FAST, error_model="numpy")


# Which rows kernels the step may name is decided here, in Python, from cpu.py: where the CPU
# has no integer dot product, the intrinsics (fast/kernels.py) are never named, so numba never
# hands them to LLVM (a runtime `if` would not do: the code is compiled either way).
if cpu.INT8:
    _rows_q8, _rows_q16, _rows_q4 = fk.rows_int8_q8, fk.rows_int8_q16, fk.rows_int4_q8
else:                   # never named: no weight has rounded activations on this CPU (weight.check_act)
    _rows_q8 = _rows_q16 = _rows_q4 = None

# The row bodies a model uses, out of the seven below (the other arguments of _matvec are
# None): numba drops the branch of a None argument before it compiles anything, so a model
# compiles only its own formats' bodies (each a few seconds of LLVM's time).
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
def _block_rows(O, row_bytes, workers):
    """Rows per item: small enough that the phase's last item is short (the other
    workers wait for it), large enough that claims (tens of nanoseconds each) cost nothing."""
    rows = min(-(-O // (ITEMS_PER_WORKER * workers)), max(1, ITEM_BYTES // max(row_bytes, 1)))
    return max(4, rows + (-rows) % 4)                # whole 4-row blocks, as the prange kernels take them


@numba.njit(inline="always")
def _items(O, row_bytes, workers):
    """How a phase's O rows are cut into items: (small block rows, big block rows,
    number of big items, rows they cover, number of items).

    Big items first, small ones last (the "guided" schedule of OpenMP): every item
    starts new memory streams, and the prefetcher needs a few misses on each before
    it runs ahead, so long items read faster; but the phase ends when its last item
    does, so the last ones are short. Which rows an item holds changes no result:
    every row's dot product is computed alone (kernels.py)."""
    block = _block_rows(O, row_bytes, workers)
    big = BIG * block
    n_big = max(0, O - TAIL_ITEMS * workers * block) // big
    split = n_big * big
    return block, big, n_big, split, n_big + -(-(O - split) // block)


@_njit
def _matvec(m, data, scales, mins, x, S, starts, n, bias, out, counts, phase, workers,
            k_f32, k_bf16, k_int8, k_int4, k_q8, k_q16, k_q4, gsk):
    """Phase `phase`: out[s n + i] = x[s] . W[starts[s] + i] (+ bias[starts[s] + i]) for
    segment s < len(starts) and i < n. x [S K] is this worker's input: S = 1 (every
    segment reads it; a matmul is one segment of all O rows) or one row per segment
    (the experts' down projection). W is given by its format row m = (fmt, act, O, K, Kp, gs)
    and flat arrays. The segments' rows, end to end, are cut into claimed items. k_*: the
    row bodies this model uses (kinds()), None for the others; gsk: simd.chunks() of the
    group size every weight with rounded activations has (their row bodies are compiled for it)."""
    fmt, act, O, K, Kp, gs = m[0], m[1], m[2], m[3], m[4], m[5]
    R = starts.size * n                                          # rows of all segments
    block, big, n_big, split, n_items = _items(R, data.size // O, workers)
    i = sync.claim(counts, phase)
    if i >= n_items:                                             # the others took every item
        sync.wait(counts, phase, n_items)
        return
    G = Kp // gs if gs else 0
    # the input as matmul() sees it: padded to whole groups, rounded as the weight asks
    x2 = np.zeros((S, Kp), dtype=np.float32)
    for t in range(S):                                           # (loops, not x2[:, :K] = ...: a slice
        for c in range(K):                                       # assignment compiles numba's error
            x2[t, c] = x[t * K + c]                              # message formatting, seconds of LLVM)
    x3 = x2.reshape(S, G, gs) if gs else np.empty((S, 0, 0), dtype=np.float32)
    x4 = x2.reshape(S, G // 2, 2, gs) if fmt == INT4 else np.empty((S, 0, 2, 0), dtype=np.float32)
    xsum4 = np.empty((S, G // 2, 2), dtype=np.float32)
    xq = np.empty((S, G, gs), dtype=np.int8)
    xa = np.empty((S, G, gs), dtype=np.uint8)
    x16 = np.empty((S, G, gs), dtype=np.int16)
    xs = np.empty((S, G), dtype=np.float32)
    xsum = np.empty((S, G), dtype=np.float32)
    for t in range(S):
        if fmt == INT4 and act == A_FP32:
            if k_int4 is not None:
                matmul.group_sums(x4, t, xsum4)
        if act == A_INT8:
            fk.quantize_token(x3, t, xq, xa, xs, xsum)
        elif act == A_INT16:
            fk.quantize_token16(x3, t, x16, xs)
    # the weight in the shape its kernel indexes (an empty stand-in for the other formats)
    wf = data.view(np.float32).reshape(O, Kp) if fmt == NONE else np.empty((0, 0), dtype=np.float32)
    wb = data.view(np.uint16).reshape(O, Kp) if fmt == BF16 else np.empty((0, 0), dtype=np.uint16)
    q8 = data.view(np.int8).reshape(O, G, gs) if fmt == INT8 else np.empty((0, 0, 0), dtype=np.int8)
    q4 = data.reshape(O, G // 2, gs) if fmt == INT4 else np.empty((0, 0, 0), dtype=np.uint8)
    s2 = scales.reshape(O, G) if gs else np.empty((0, 0), dtype=np.uint16)
    m2 = mins.reshape(O, G) if fmt == INT4 else np.empty((0, 0), dtype=np.uint16)
    xqf, xaf, x16f, xsf = xq.reshape(-1), xa.reshape(-1), x16.reshape(-1), xs.reshape(-1)

    while i < n_items:
        v0 = i * big if i < n_big else split + (i - n_big) * block     # rows v0..v1 of all segments
        v1 = min(R, v0 + (big if i < n_big else block))
        while v0 < v1:                                               # an item may span segments
            s = v0 // n
            e = min(v1, (s + 1) * n)
            r0, ooff = starts[s] + v0 - s * n, s * n - starts[s]     # W's rows r0.. -> out[ooff + r]
            r1 = r0 + e - v0
            t = s if S > 1 else 0                                    # the row of x: out[ooff + r] = W[r] . x[t]
            if act == A_INT8 and fmt == INT8:                        # the kernel matmul() would use
                if k_q8 is not None:
                    _rows_q8(xqf, xaf, xsf, t, data, scales, r0, r1, G, gs, out, ooff, gsk)
            elif act == A_INT16:
                if k_q16 is not None:
                    _rows_q16(x16f, xsf, t, data, scales, r0, r1, G, gs, out, ooff, gsk)
            elif act == A_INT8:
                if k_q4 is not None:
                    _rows_q4(xqf, xsf, xsum.reshape(-1), t, data, scales, m2.reshape(-1), r0, r1, G, gs, out,
                             ooff, gsk)
            elif fmt == BF16:                                        # fp32 activations: the core's bodies
                if k_bf16 is not None:
                    blocks.rows_bf16(x2, t, wb, r0, r1, out, ooff)
            else:
                for r in range(r0, r1):
                    if fmt == NONE:
                        if k_f32 is not None:
                            out[ooff + r] = matmul.row_f32(x2, t, wf, r)
                    elif fmt == INT8:
                        if k_int8 is not None:
                            out[ooff + r] = matmul.row_int8(x3, t, q8, s2, r)
                    elif k_int4 is not None:
                        out[ooff + r] = matmul.row_int4(x4, xsum4, t, q4, s2, m2, r)
            if bias.size:
                for r in range(r0, r1):
                    out[ooff + r] = out[ooff + r] + bias[r]
            v0 = e
        sync.finish(counts, phase)
        i = sync.claim(counts, phase)
    sync.wait(counts, phase, n_items)
