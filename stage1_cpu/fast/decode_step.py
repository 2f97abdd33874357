"""A whole decode step (one token, all layers, the logits) in one parallel region.

Changed from the core (stage1_cpu/model.py): Model.forward calls one numba kernel
per op: for one token of Qwen3-0.6B that is 113 parallel regions (4 matmuls per
layer plus the lm_head), each starting the threads anew (tens of microseconds each
when idle threads sleep, OMP_WAIT_POLICY=PASSIVE; about a microsecond when they
spin), with Python and small serial ops in between. Here the threads start once per
token and run the step written down as data (plan.py), encoded as a table of
integers (DecodeStep below):

    for worker in prange(threads):                 # the only parallel region
        for phase in program:
            private phases (norm, add, silu_mul, route, mix, gated_add):
                every worker computes them on its own copy of the buffers
            shared phases (matmul, experts, attention):
                the work is cut into items (blocks of rows, KV heads), claimed
                through atomic counters; the outputs go to a shared arena;
                each worker waits until every item is done (sync.py)

The small ops run privately because recomputing 1024 floats is cheaper than a
handoff; a worker that wakes late just claims fewer items. MoE layers take the
same route: every worker routes the token itself (E logits, a few hundred
floats), then the k chosen experts' rows form one work list, so both threads
stream expert weights the whole time.

Nothing makes a worker wait for the others to *arrive*, so one can run several
layers ahead of one that woke late (it does all the items itself). Hence every
shared phase writes to a slot of the arena of its own: the late worker still
reads its layer's values, never a later layer's that overwrote them (one buffer
reused by every layer passes a few steps and then parts from the core's tokens).

Every op is the same inlined body the per-op kernels run, in the same order on
the same values: the core's (stage1_cpu/norms.py: rmsnorm_row; kernels.py: rope_head,
attention_item, silu_mul_row, route_row, mix_row, gated_add_row; matmul.py:
row_f32, row_int8, row_int4) and the fast path's (fast/blocks.py: rows_bf16; for
rounded activations fast/kernels.py: rows_int8_q8, rows_int8_q16, rows_int4_q8,
quantize_token). So the logits and the KV cache are bit for bit those of
Model.forward with the same weights: with fp32 activations those of the plain
path (bf16 weights: of FastWeight.matmul, which runs blocks.py's rows too), with
rounded ones those of FastWeight.matmul (tests/test_stage1_decode_step.py
checks both, for every weight format, dense and MoE).

Which row bodies the step may inline is chosen in Python from cpu.INT8 (the `if`
around _rows_q8 below): where the CPU has no integer dot product the fast
kernels are never named, so numba never hands their instructions to LLVM (a
runtime branch would not do: both sides are compiled, and on an AVX2-only CPU
LLVM aborts with "Cannot select ... VPDPWSSD"). Of those, the step compiles only
the bodies its model's weights use (kinds(): a None argument drops its branch
before numba compiles it), so a cold start compiles one or two formats, not all.
"""
from __future__ import annotations

import os

import numba
import numpy as np
from numba import prange, types
from numba.typed import List

from .. import kernels, matmul
from . import blocks, cpu, simd, sync
from .plan import plan
from . import kernels as fk
from ..kernels import FAST

FMT = {"none": 0, "bf16": 1, "int8": 2, "int4": 3}
ACT = {"fp32": 0, "int8": 1, "int16": 2}
NONE, BF16, INT8, INT4 = range(4)
A_FP32, A_INT8, A_INT16 = range(3)
# the phases of plan.plan(), as opcodes
OPS = {"norm": 0, "matmul": 1, "attention": 2, "add": 3, "silu_mul": 4, "route": 5, "experts": 6, "mix": 7,
       "gated_add": 8}
NORM, MATMUL, ATTENTION, ADD, SILU_MUL, ROUTE, EXPERTS, MIX, GATED_ADD = range(9)
SHARED = {"matmul", "experts", "attention"}      # split into items across the workers; the rest is private
# a row of the program: the op, three buffers as (arena, offset, length) with arena 0 the
# worker's own and 1 the shared one, then weight, vector, second vector (-1: none),
# layer, counter (shared phases), rows of the input (experts: 1, or k slots)
OP, SRC, DST, AUX, WEIGHT, VEC, VEC2, LAYER, COUNTER, ROWS = 0, 1, 4, 7, 10, 11, 12, 13, 14, 15
FIELDS = 16
ITEMS_PER_WORKER = 16                     # small row blocks per matmul and worker, at least ...
ITEM_BYTES = 1 << 18                      # ... and at most ~256 KB of weights per small block (~10 us)
BIG = 8                                   # a phase's first items are 8 small blocks long ...
TAIL_ITEMS = 2                            # ... its last 2 per worker are small ones (see _items)

_njit = numba.njit(cache=True, fastmath=FAST, error_model="numpy")
_inline = numba.njit(inline="always", fastmath=FAST, error_model="numpy")


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
    x2[:, :K] = x.reshape(S, K)
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


@_njit
def _attention(qkv, kv, layer, pos, cos, sin, q_norm, k_norm, qk_norm, eps, H, Hkv, D, att, counts, phase):
    """Phase `phase`, one item per KV head: its q heads and k normed and rotated in
    place in qkv, its k and v stored in the cache at pos, its q heads attending."""
    q3 = qkv[:H * D].reshape(1, H, D)                          # [1, H, D]
    k3 = qkv[H * D:(H + Hkv) * D].reshape(1, Hkv, D)           # [1, Hkv, D]
    v3 = qkv[(H + Hkv) * D:].reshape(1, Hkv, D)
    q2, k2 = q3.reshape(H, D), k3.reshape(Hkv, D)
    out3 = att.reshape(1, H, D)
    group = H // Hkv
    i = sync.claim(counts, phase)
    while i < Hkv:
        for h in range(i * group, (i + 1) * group):
            if qk_norm:
                kernels.rmsnorm_row(q2, q_norm, eps, q2, h)
            kernels.rope_head(q3, cos, sin, q3, 0, h)
        if qk_norm:
            kernels.rmsnorm_row(k2, k_norm, eps, k2, i)
        kernels.rope_head(k3, cos, sin, k3, 0, i)
        for d in range(D):
            kv[layer, 0, i, pos, d] = k3[0, i, d]
            kv[layer, 1, i, pos, d] = v3[0, i, d]
        kernels.attention_item(q3, kv[layer, 0], kv[layer, 1], pos, out3, i)
        sync.finish(counts, phase)
        i = sync.claim(counts, phase)
    sync.wait(counts, phase, Hkv)


@numba.njit(inline="always")
def _buf(own, shared, ref):
    """A buffer of the program, (arena, offset, length): a view of this worker's arena or the shared one."""
    return own[ref[1]:ref[1] + ref[2]] if ref[0] == 0 else shared[ref[1]:ref[1] + ref[2]]


@_njit
def _worker(workers, x0, pos, prog, meta, data, scales, mins, vecs, shared, own_size, kv, cos, sin, eps, dims,
            counts, k_f32, k_bf16, k_int8, k_int4, k_q8, k_q16, k_q4, gsk):
    """Everything one worker does in a decode step: the program, phase by phase."""
    H, Hkv, D, k, norm_topk = dims[0], dims[1], dims[2], dims[3], dims[4] != 0
    own = np.zeros(own_size, dtype=np.float32)       # this worker's private buffers; x first
    own[:x0.size] = x0
    top = np.zeros((1, max(k, 1)), dtype=np.int64)   # [1, k] the experts of the current MoE layer ...
    weight = np.zeros((1, max(k, 1)), dtype=np.float32)   # ... and their weights
    one = np.zeros(1, dtype=np.int64)                # a matmul: one segment, from row 0
    none = np.empty(0, dtype=np.float32)
    for p in range(prog.shape[0]):
        row = prog[p]
        op = row[OP]
        src, dst = _buf(own, shared, row[SRC:SRC + 3]), _buf(own, shared, row[DST:DST + 3])
        if op == NORM:
            kernels.rmsnorm_row(src.reshape(1, -1), vecs[row[VEC]], eps, dst.reshape(1, -1), 0)
        elif op == ADD:
            for c in range(dst.size):
                dst[c] = dst[c] + src[c]
        elif op == SILU_MUL:
            S = row[ROWS]
            for t in range(S):
                kernels.silu_mul_row(src.reshape(S, -1), dst.reshape(S, -1), t)
        elif op == ROUTE:
            kernels.route_row(src.reshape(1, -1), 0, k, norm_topk, top, weight)
        elif op == MIX:
            kernels.mix_row(src.reshape(k, -1), weight, dst.reshape(1, -1), 0)
        elif op == GATED_ADD:
            gate = _buf(own, shared, row[AUX:AUX + 3])
            kernels.gated_add_row(dst.reshape(1, -1), src.reshape(1, -1), gate.reshape(1, 1), 0)
        elif op == ATTENTION:
            qk = row[VEC] >= 0
            q_norm = vecs[row[VEC]] if qk else none
            k_norm = vecs[row[VEC2]] if qk else none
            _attention(src, kv, row[LAYER], pos, cos, sin, q_norm, k_norm, qk, eps, H, Hkv, D, dst, counts,
                       row[COUNTER])
        else:                                        # MATMUL, EXPERTS
            w = row[WEIGHT]
            bias = vecs[row[VEC]] if row[VEC] >= 0 else none
            if op == MATMUL:
                _matvec(meta[w], data[w], scales[w], mins[w], src, 1, one, dst.size, bias, dst, counts,
                        row[COUNTER], workers, k_f32, k_bf16, k_int8, k_int4, k_q8, k_q16, k_q4, gsk)
            else:
                n = dst.size // k                    # each expert's rows in the stacked matrix
                _matvec(meta[w], data[w], scales[w], mins[w], src, row[ROWS], top[0] * n, n, bias, dst,
                        counts, row[COUNTER], workers, k_f32, k_bf16, k_int8, k_int4, k_q8, k_q16, k_q4, gsk)


@numba.njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def _decode(workers, x0, pos, prog, meta, data, scales, mins, vecs, shared, own_size, kv, cos, sin, eps, dims,
            counts, k_f32, k_bf16, k_int8, k_int4, k_q8, k_q16, k_q4, gsk):
    # workers: numba.get_num_threads(), passed in (called in here, it would keep this from the disk cache)
    for _ in prange(workers):                        # one iteration per thread: the one parallel region
        _worker(workers, x0, pos, prog, meta, data, scales, mins, vecs, shared, own_size, kv, cos, sin, eps,
                dims, counts, k_f32, k_bf16, k_int8, k_int4, k_q8, k_q16, k_q4, gsk)


_READONLY = types.Array(types.uint8, 1, "C", readonly=True)
_READONLY16 = types.Array(types.uint16, 1, "C", readonly=True)
_VEC = types.Array(types.float32, 1, "C")


def _format_row(w) -> list[int]:
    """A Weight as the kernel sees it: (fmt, act, O, K, Kp, gs), a row of meta."""
    return [FMT[w.fmt], ACT[getattr(w, "decode_act", "fp32")], w.out_features, w.in_features, w.padded_in,
            w.group_size]


def _typed_list(arrays, ty):
    """A numba typed list of flat arrays (views: the weights may be mapped read-only)."""
    out = List.empty_list(ty)
    for a in arrays:
        out.append(a)
    return out


class DecodeStep:
    """plan.plan()'s phases for one token, as the table _decode runs, built once (views,
    no weight copies). step(x, pos): x [C] the token's embedding, its K/V go to cache
    position pos -> logits [V]."""

    def __init__(self, model):
        cfg = model.config
        self.phases = phases = plan(model.w)
        self.cache, self.cos, self.sin = model.cache, model.cos, model.sin
        k = cfg.num_experts_per_tok if cfg.num_experts else 0
        weights, vecs, rows = [], [], []
        own = {"x": (0, cfg.hidden_size)}           # private buffers: name -> (offset, size)
        where = {"x": (0, 0, cfg.hidden_size)}      # every buffer: name -> (arena, offset, length)
        n_rows = {"x": 1}                           # rows of each buffer (experts' outputs: k)
        self.shared_size, self.own_size = 0, cfg.hidden_size
        n_counters = 0

        def index(items, a):
            for i, b in enumerate(items):
                if b is a:
                    return i
            items.append(a)
            return len(items) - 1

        def vec(a):
            return -1 if a is None else index(vecs, a)

        for ph in phases:
            src = where[ph.src]
            size = {"norm": src[2], "matmul": ph.weight.out_features if ph.weight else 0,
                    "experts": k * (ph.weight.out_features // max(cfg.num_experts, 1)) if ph.weight else 0,
                    "attention": cfg.num_heads * cfg.head_dim, "silu_mul": src[2] // 2,
                    "mix": src[2] // max(k, 1)}.get(ph.op)
            if ph.op == "route":                      # top and weight live in the worker itself
                dst = where[ph.dst] = (0, 0, 0)
            elif size is None:                        # add, gated_add: into an existing buffer
                dst = where[ph.dst]
            elif ph.op in SHARED:                     # a slot of the shared arena of its own
                dst = where[ph.dst] = (1, self.shared_size, size)
                self.shared_size += size
            else:
                if ph.dst not in own or own[ph.dst][1] < size:
                    own[ph.dst] = (self.own_size, size)       # a new place at the end
                    self.own_size += size
                dst = where[ph.dst] = (0, own[ph.dst][0], size)
            n_rows[ph.dst] = {"experts": k, "silu_mul": n_rows[ph.src]}.get(ph.op, 1)
            r = [0] * FIELDS
            r[OP], r[SRC:SRC + 3], r[DST:DST + 3] = OPS[ph.op], src, dst
            r[AUX:AUX + 3] = where[ph.aux] if ph.aux else (0, 0, 0)
            r[WEIGHT] = index(weights, ph.weight) if ph.weight is not None else -1
            r[VEC], r[VEC2], r[LAYER], r[ROWS] = vec(ph.vec), -1, ph.layer, n_rows[ph.src]
            if ph.op == "attention" and cfg.qk_norm:
                lw = model.w.layers[ph.layer]
                r[VEC], r[VEC2] = vec(lw.q_norm), vec(lw.k_norm)
            if ph.op in SHARED:
                r[COUNTER], n_counters = n_counters, n_counters + 1
            rows.append(r)
        self.logits = where["logits"]
        self.prog = np.array(rows, dtype=np.int64)
        self.n_counters = n_counters

        no16 = np.zeros(0, dtype=np.uint16)
        self.meta = np.array([_format_row(w) for w in weights], dtype=np.int64)
        self.kinds = kinds(weights)                  # the row bodies _matvec compiles for this model
        rounded = {w.group_size for w in weights if getattr(w, "decode_act", "fp32") != "fp32"}
        self.gsk = simd.chunks(rounded.pop()) if len(rounded) == 1 else ()   # (): a loop for any size
        self.data = _typed_list([np.ascontiguousarray(w.data).reshape(-1).view(np.uint8) for w in weights],
                                _READONLY)
        self.scales = _typed_list([no16 if w.scales is None else w.scales.reshape(-1).view(np.uint16)
                                   for w in weights], _READONLY16)
        self.mins = _typed_list([no16 if w.mins is None else w.mins.reshape(-1).view(np.uint16)
                                 for w in weights], _READONLY16)
        self.vecs = _typed_list([np.array(v, dtype=np.float32).reshape(-1) for v in vecs], _VEC)
        self.shared = np.zeros(self.shared_size, dtype=np.float32)
        self.eps = np.float32(cfg.rms_norm_eps)
        self.dims = np.array([cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, k, int(cfg.norm_topk_prob)],
                             dtype=np.int64)

    def step(self, x: np.ndarray, pos: int, workers: int | None = None) -> np.ndarray:
        """x [C] f32 -> logits [V] f32 (a new array). workers: worker iterations of the
        region (default: numba's threads; any number gives the same result)."""
        _decode(workers or numba.get_num_threads(), np.ascontiguousarray(x, dtype=np.float32), pos, self.prog,
                self.meta, self.data, self.scales, self.mins, self.vecs, self.shared, self.own_size,
                self.cache.data, self.cos[pos:pos + 1], self.sin[pos:pos + 1], self.eps, self.dims,
                sync.counters(self.n_counters), *self.kinds, self.gsk)
        _, off, n = self.logits
        return self.shared[off:off + n].copy()
