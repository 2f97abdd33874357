"""A whole decode step (one token or a few, all layers, the logits) in one parallel region.

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
rounded activations fast/kernels.py: quantize_token and tile_rows, tiles.py's
register tiles). So the logits and the KV cache are bit for bit those of
Model.forward with the same weights: with fp32 activations those of the plain
path (bf16 weights: of FastWeight.matmul, which runs blocks.py's rows too), with
rounded ones those of FastWeight.matmul (tests/test_stage1_decode_step.py
checks both, for every weight format, dense and MoE).

Several tokens at once. A step takes up to MAX_TOKENS tokens: the last token made and
the drafts that follow it (speculative decoding's verify step, docs/stage1.md section
15). Every buffer has a row per token; private phases loop over the rows; a matrix
phase multiplies each weight it reads by every token (the tiles keep a weight vector in
a register for up to 4 tokens), so T tokens cost the bytes of one; attention stores the
T tokens' keys and values first and then lets token t see positions up to pos + t,
causal within the step. Each token's result is the float operations of a one-token
step, in the same order: a step of T tokens equals T steps of one, bit for bit.

Which bodies the matrix phases may inline: where the CPU has no integer dot product no
weight has rounded activations (weight.check_act), so the tiles' arguments are None and
numba never compiles them, let alone hands their instructions to LLVM (a runtime branch
would not do: both sides are compiled, and on an AVX2-only CPU LLVM aborts with "Cannot
select ... VPDPWSSD"). Of the rest, the step compiles only the bodies its model's weights
use (kinds(): a None argument drops its branch before numba compiles it), so a cold start
compiles one or two formats, not all.

What compiling costs: the step is three compiled functions, _decode (the parallel
region) calling _worker (the program) calling matvec._matvec (a matrix phase), each
through a function pointer (Pointer), not linked into its caller. numba links a
called function's code into its caller and LLVM optimizes and emits it again there;
the parallel region's body is a function of its own too, so linked, _matvec's code
went through LLVM four times and the step took about 49 s of a cold start, through
pointers once each, well under half of that (docs/stage1.md, section 13). The
pointers also let each be cached with its own files: an edit to RMSNorm recompiles
_worker, one to an int8 matmul kernel _matvec.
"""
from __future__ import annotations

import os
import time

import numba
import numpy as np
from numba import prange, types
from numba.core.types.function_type import WrapperAddressProtocol
from numba.typed import List

from .. import kernels
from ..kernels import FAST
from ..quant import PREFILL_MIN_T
from . import sync
# names the tests and FastPath import from here
from .matvec import ACT, BIG, FMT, KINDS, TAIL_ITEMS, _items, _matvec, kinds  # noqa: F401
from .plan import plan
from .threads import Threads

# tokens a step takes at most: the last one and up to 7 drafts (section 15)
MAX_TOKENS = 8
# the phases of plan.plan(), as opcodes
OPS = {"norm": 0, "matmul": 1, "attention": 2, "add": 3, "silu_mul": 4, "route": 5, "experts": 6,
       "mix": 7, "gated_add": 8}
NORM, MATMUL, ATTENTION, ADD, SILU_MUL, ROUTE, EXPERTS, MIX, GATED_ADD = range(9)
# split into items across the workers; the rest is private
SHARED = {"matmul", "experts", "attention"}
# a row of the program: the op, three buffers as (arena, offset, row length) with arena 0 the
# worker's own and 1 the shared one, then weight, vector, second vector (-1: none), layer,
# counter (shared phases), rows of the input per token (experts: 1, or k slots), and whether the
# phase makes the logits (only the last token's unless all are asked for)
OP, SRC, DST, AUX, WEIGHT, VEC, VEC2, LAYER, COUNTER, ROWS, LOGITS = (
    0, 1, 4, 7, 10, 11, 12, 13, 14, 15, 16)
FIELDS = 17
_inline = numba.njit(inline="always", fastmath=FAST, error_model="numpy")


@_inline
def _attention(qkv, kv, layer, pos, T, cos, sin, q_norm, k_norm, qk_norm, eps, H, Hkv, D, att, qbuf,
               counts, phase):
    """Phases `phase` and `phase + 1`. The first, one item per KV head: for each of the T tokens
    (position pos + t), its q heads and k normed and rotated in place in qkv [T, (H + 2 Hkv) D],
    its k and v stored in the cache at pos + t. The second, one item per (KV head, token): the
    token's q heads attend to positions 0 .. pos + t (causal within the step too), the group's
    heads sharing each key and value read. One token (a decode step) attends in the first phase's
    item, which stored what it reads: no second wait. qbuf [T, H, D]: this worker's copy of an
    item's q heads."""
    width = (H + 2 * Hkv) * D
    group = H // Hkv
    i = sync.claim(counts, phase)
    while i < Hkv:
        for t in range(T):
            row = qkv[t * width:(t + 1) * width]
            q3 = row[:H * D].reshape(1, H, D)                  # [1, H, D] token t's q heads
            k3 = row[H * D:(H + Hkv) * D].reshape(1, Hkv, D)
            v3 = row[(H + Hkv) * D:].reshape(1, Hkv, D)
            q2, k2 = q3.reshape(H, D), k3.reshape(Hkv, D)
            c, s = cos[t:t + 1], sin[t:t + 1]
            for h in range(i * group, (i + 1) * group):
                if qk_norm:
                    kernels.rmsnorm_row(q2, q_norm, eps, q2, h)
                kernels.rope_head(q3, c, s, q3, 0, h)
            if qk_norm:
                kernels.rmsnorm_row(k2, k_norm, eps, k2, i)
            kernels.rope_head(k3, c, s, k3, 0, i)
            for d in range(D):
                kv[layer, 0, i, pos + t, d] = k3[0, i, d]
                kv[layer, 1, i, pos + t, d] = v3[0, i, d]
        if T == 1:                                             # one token: it attends in this item,
            for h in range(i * group, (i + 1) * group):       # no second phase to wait for
                for d in range(D):
                    qbuf[0, h, d] = qkv[h * D + d]
            kernels.attention_item(qbuf, kv[layer, 0], kv[layer, 1], pos, att.reshape(1, H, D), i)
        sync.finish(counts, phase)
        i = sync.claim(counts, phase)
    sync.wait(counts, phase, Hkv)
    if T == 1:
        return
    out3 = att.reshape(T, H, D)
    i = sync.claim(counts, phase + 1)
    while i < Hkv * T:                                         # item i: KV head i // T, token i % T
        kvh, t = i // T, i % T
        for h in range(kvh * group, (kvh + 1) * group):
            for d in range(D):
                qbuf[t, h, d] = qkv[t * width + h * D + d]
        kernels.attention_item(qbuf, kv[layer, 0], kv[layer, 1], pos, out3, kvh * T + t)
        sync.finish(counts, phase + 1)
        i = sync.claim(counts, phase + 1)
    sync.wait(counts, phase + 1, Hkv * T)


@numba.njit(inline="always")
def _buf(own, shared, ref, rows):
    """A buffer of the program, (arena, offset, row length), `rows` rows of it: a view of this
    worker's arena or the shared one, [rows * length]."""
    n = rows * ref[2]
    return own[ref[1]:ref[1] + n] if ref[0] == 0 else shared[ref[1]:ref[1] + n]


@numba.njit(cache=True, fastmath=FAST, error_model="numpy")
def _worker(matvec, workers, x0, T, last_only, pos, prog, meta, data, scales, mins, vecs, shared,
            own_size, kv, cos, sin, eps, dims, counts, k_f32, k_bf16, k_int8, k_int4, k_q8, k_q16,
            k_q4, k_moe, k_qk):
    """Everything one worker does in a step of T tokens: the program, phase by phase, each on
    all T tokens' rows (x0 [T C], positions pos .. pos + T - 1; last_only: the logits of the
    last token alone). matvec: _matvec, compiled for this model's kinds, as a function pointer
    (Pointer). k_moe, k_qk: True where the model has MoE layers / q and k norms, else None
    (ops()): numba drops the branches of a None argument before compiling, so a dense model
    without q/k norms (llama) compiles neither the routing and mixing ops nor the norms inside
    attention."""
    H, Hkv, D, k, norm_topk = dims[0], dims[1], dims[2], dims[3], dims[4] != 0
    kk = max(k, 1)
    own = np.zeros(own_size, dtype=np.float32)       # this worker's private buffers; x first
    for c in range(x0.size):                         # (a loop: a slice assignment compiles numba's
        own[c] = x0[c]                               # error-message formatting, seconds of LLVM)
    top = np.zeros((T, kk), dtype=np.int64)          # [T, k] the current MoE layer's experts ...
    weight = np.zeros((T, kk), dtype=np.float32)     # ... and their weights
    segs = np.zeros((T * kk, 4), dtype=np.int64)     # a matrix phase's segments (matvec.py)
    qbuf = np.empty((T, H, D), dtype=np.float32)
    none = np.empty(0, dtype=np.float32)
    for p in range(prog.shape[0]):
        row = prog[p]
        op = row[OP]
        S = T * row[ROWS]                            # the input's rows: one per token (or slot)
        src = _buf(own, shared, row[SRC:SRC + 3], S)
        dst = _buf(own, shared, row[DST:DST + 3], S)
        if op == NORM:
            for t in range(S):
                kernels.rmsnorm_row(src.reshape(S, -1), vecs[row[VEC]], eps, dst.reshape(S, -1), t)
        elif op == ADD:
            for c in range(dst.size):
                dst[c] = dst[c] + src[c]
        elif op == SILU_MUL:
            for t in range(S):
                kernels.silu_mul_row(src.reshape(S, -1), dst.reshape(S, -1), t)
        elif op == ROUTE:
            if k_moe is not None:
                for t in range(T):
                    kernels.route_row(src.reshape(T, -1), t, k, norm_topk, top, weight)
        elif op == MIX:
            if k_moe is not None:
                y = _buf(own, shared, row[SRC:SRC + 3], T * k)
                out = _buf(own, shared, row[DST:DST + 3], T)
                for t in range(T):
                    kernels.mix_row(y.reshape(T * k, -1), weight, out.reshape(T, -1), t)
        elif op == GATED_ADD:
            if k_moe is not None:
                gate = _buf(own, shared, row[AUX:AUX + 3], T)
                for t in range(T):
                    kernels.gated_add_row(dst.reshape(T, -1), src.reshape(T, -1),
                                          gate.reshape(T, 1), t)
        elif op == ATTENTION:
            if k_qk is not None:
                qk = row[VEC] >= 0
                q_norm = vecs[row[VEC]] if qk else none
                k_norm = vecs[row[VEC2]] if qk else none
                _attention(src, kv, row[LAYER], pos, T, cos, sin, q_norm, k_norm, qk, eps, H, Hkv,
                           D, dst, qbuf, counts, row[COUNTER])
            else:                                    # a constant False: LLVM drops the norms
                _attention(src, kv, row[LAYER], pos, T, cos, sin, none, none, False, eps, H, Hkv, D,
                           dst, qbuf, counts, row[COUNTER])
        else:                                        # MATMUL, EXPERTS: one call through the pointer
            w = row[WEIGHT]
            bias = vecs[row[VEC]] if row[VEC] >= 0 else none
            if op == EXPERTS:                        # a segment per token and chosen expert
                n = row[DST + 2]
                for t in range(T):
                    for j in range(k):
                        s = t * k + j
                        segs[s, 0], segs[s, 1], segs[s, 2], segs[s, 3] = (
                            top[t, j] * n, s if row[ROWS] > 1 else t, s, 1)
                n_segs = T * k
                out = _buf(own, shared, row[DST:DST + 3], T * k)
            else:                                    # T tokens on every row (logits: maybe last)
                n, n_segs = row[DST + 2], 1
                first = T - 1 if last_only and row[LOGITS] else 0
                segs[0, 0], segs[0, 1], segs[0, 2], segs[0, 3] = 0, first, 0, T - first
                out = _buf(own, shared, row[DST:DST + 3], T - first)
            matvec(meta[w], data[w], scales[w], mins[w], src, segs[:n_segs], n, bias, out, counts,
                   row[COUNTER], workers, k_f32, k_bf16, k_int8, k_int4, k_q8, k_q16, k_q4)


@numba.njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def _decode(worker, matvec, workers, x0, T, last_only, pos, prog, meta, data, scales, mins, vecs,
            shared, own_size, kv, cos, sin, eps, dims, counts, k_f32, k_bf16, k_int8, k_int4, k_q8,
            k_q16, k_q4, k_moe, k_qk):
    # workers: numba.get_num_threads(), passed in (called in here, it would keep this from the
    # disk cache)
    # one iteration per thread: the one parallel region
    for _ in prange(workers):
        worker(matvec, workers, x0, T, last_only, pos, prog, meta, data, scales, mins, vecs, shared,
               own_size, kv, cos, sin, eps, dims, counts, k_f32, k_bf16, k_int8, k_int4, k_q8,
               k_q16, k_q4, k_moe, k_qk)


def ops(cfg) -> tuple:
    """(k_moe, k_qk) for _worker: True where the model has MoE layers / q and k norms, else None
    (QS_FAST_ALL_KINDS=1: both True, one compile for every model)."""
    every = os.environ.get("QS_FAST_ALL_KINDS") == "1"
    return (True if every or cfg.num_experts else None), (True if every or cfg.qk_norm else None)


class Pointer(WrapperAddressProtocol):
    """A cached numba function compiled for one signature, handed to another as a function
    pointer (numba's first-class functions). The caller calls it through the pointer: it does
    not link the callee's code into its own, so LLVM optimizes and emits each body once, in
    the callee's own compile. (A callee numba links in is optimized and emitted again by every
    caller above it: _matvec, inside _worker inside the parallel region's body inside _decode,
    was compiled four times.) A call through the pointer costs nanoseconds; a phase,
    microseconds."""

    def __init__(self, fn, arg_types):
        self._sig = types.void(*arg_types)
        fn.compile(self._sig)                        # or loads it from the disk cache
        cres = fn.get_compile_result(self._sig)
        self._address = cres.library.get_pointer_to_function(cres.fndesc.llvm_cfunc_wrapper_name)

    def __wrapper_address__(self):
        return self._address

    def signature(self):
        return self._sig


_READONLY = types.Array(types.uint8, 1, "C", readonly=True)
_READONLY16 = types.Array(types.uint16, 1, "C", readonly=True)
_VEC = types.Array(types.float32, 1, "C")


def _format_row(w) -> list[int]:
    """A Weight as the kernel sees it: (fmt, act, O, K, Kp, gs, seg), a row of meta (seg: 0 stored
    as the core stores it, else the rows of a segment of its 8-row tiles)."""
    return [FMT[w.fmt], ACT[getattr(w, "decode_act", "fp32")], w.out_features, w.in_features,
            w.padded_in, w.group_size, getattr(w, "seg", 0)]


def _typed_list(arrays, ty):
    """A numba typed list of flat arrays (views: the weights may be mapped read-only)."""
    out = List.empty_list(ty)
    for a in arrays:
        out.append(a)
    return out


class DecodeStep:
    """plan.plan()'s phases for up to MAX_TOKENS tokens, as the table _decode runs, built once
    (views, no weight copies). forward(tokens, pos) is Model.forward's, for the steps it takes;
    step(x, pos): x [T, C] the tokens' embeddings, their K/V go to cache positions
    pos .. pos + T - 1 -> logits [T, V] (all_logits) or [V] (the last token's)."""

    def __init__(self, model):
        cfg = model.config
        self.phases = phases = plan(model.w)
        self.cache, self.cos, self.sin = model.cache, model.cos, model.sin
        self.embed = model.w.embed
        k = cfg.num_experts_per_tok if cfg.num_experts else 0
        weights, vecs, rows = [], [], []
        T = MAX_TOKENS
        own = {"x": (0, cfg.hidden_size)}           # private buffers: name -> (offset, row length)
        # every buffer: name -> (arena, offset, row length)
        where = {"x": (0, 0, cfg.hidden_size)}
        # rows of each buffer per token (experts' outputs: k)
        n_rows = {"x": 1}
        self.shared_size, self.own_size = 0, T * cfg.hidden_size
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
                    "experts": (ph.weight.out_features // max(cfg.num_experts, 1)
                                if ph.weight else 0),
                    "attention": cfg.num_heads * cfg.head_dim, "silu_mul": src[2] // 2,
                    "mix": src[2]}.get(ph.op)
            n_rows[ph.dst] = {"experts": k,
                              "silu_mul": n_rows[ph.src]}.get(ph.op, n_rows.get(ph.dst, 1))
            room = T * n_rows[ph.dst] * (size or 0)  # the buffer's floats for MAX_TOKENS tokens
            if ph.op == "route":                      # top and weight live in the worker itself
                dst = where[ph.dst] = (0, 0, 0)
            elif size is None:                        # add, gated_add: into an existing buffer
                dst = where[ph.dst]
            elif ph.op in SHARED:                     # a slot of the shared arena of its own
                dst = where[ph.dst] = (1, self.shared_size, size)
                self.shared_size += room
            else:
                if ph.dst not in own or own[ph.dst][1] < room:
                    own[ph.dst] = (self.own_size, room)       # a new place at the end
                    self.own_size += room
                dst = where[ph.dst] = (0, own[ph.dst][0], size)
            r = [0] * FIELDS
            r[OP], r[SRC:SRC + 3], r[DST:DST + 3] = OPS[ph.op], src, dst
            r[AUX:AUX + 3] = where[ph.aux] if ph.aux else (0, 0, 0)
            r[WEIGHT] = index(weights, ph.weight) if ph.weight is not None else -1
            r[VEC], r[VEC2], r[LAYER], r[ROWS] = vec(ph.vec), -1, ph.layer, n_rows[ph.src]
            r[LOGITS] = int(ph.dst == "logits")
            if ph.op == "attention" and cfg.qk_norm:
                lw = model.w.layers[ph.layer]
                r[VEC], r[VEC2] = vec(lw.q_norm), vec(lw.k_norm)
            if ph.op in SHARED:                        # attention: two phases, two counters
                r[COUNTER], n_counters = n_counters, n_counters + (2 if ph.op == "attention" else 1)
            rows.append(r)
        self.logits = where["logits"]
        self.prog = np.array(rows, dtype=np.int64)
        self.n_counters = n_counters

        self._tables(weights, vecs)
        # the row bodies _matvec compiles for this model
        self.kinds = kinds(weights)
        # (k_moe, k_qk): the ops _worker compiles for it
        self.ops = ops(cfg)
        self.shared = np.zeros(self.shared_size, dtype=np.float32)
        self.eps = np.float32(cfg.rms_norm_eps)
        self.worker = self.matvec = None             # Pointers, made at the first step
        # how many threads a step runs on (threads.py)
        self.threads = Threads(numba.get_num_threads())
        self.dims = np.array([cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, k,
                              int(cfg.norm_topk_prob)],
                             dtype=np.int64)

    def _tables(self, weights: list, vecs: list) -> None:
        """The program's weights and vectors as _decode reads them: a row of meta per weight
        (_format_row), its bytes, scales and mins as typed lists of flat views (no copies), and
        the norm and bias vectors."""
        no16 = np.zeros(0, dtype=np.uint16)
        self.meta = np.array([_format_row(w) for w in weights], dtype=np.int64)
        self.data = _typed_list([np.ascontiguousarray(w.data).reshape(-1).view(np.uint8)
                                 for w in weights], _READONLY)
        self.scales = _typed_list([no16 if w.scales is None
                                   else w.scales.reshape(-1).view(np.uint16)
                                   for w in weights], _READONLY16)
        self.mins = _typed_list([no16 if w.mins is None else w.mins.reshape(-1).view(np.uint16)
                                 for w in weights], _READONLY16)
        self.vecs = _typed_list([np.array(v, dtype=np.float32).reshape(-1) for v in vecs], _VEC)

    def _pointers(self, args):
        """_worker and _matvec compiled for the types of this model's arguments (the first
        call compiles them, or loads them from the disk cache) -> (worker, matvec) Pointers."""
        t = [numba.typeof(a) for a in args]
        f32, i64 = types.Array(types.float32, 1, "C"), types.int64
        i64_2d = types.Array(types.int64, 2, "C")
        # _matvec(m, data, scales, mins, x, segs, n, bias, out, counts, phase, workers, kinds...)
        matvec = Pointer(_matvec, [types.Array(types.int64, 1, "C"), _READONLY, _READONLY16,
                                   _READONLY16, f32, i64_2d, i64, f32, f32, t[18], i64, t[0]]
                         + t[19:26])
        return Pointer(_worker, [numba.typeof(matvec)] + t), matvec

    def takes(self, T: int, all_logits: bool) -> bool:
        """Whether a forward of T tokens is a step: a decode step or a verify step (all_logits) of
        at most MAX_TOKENS tokens, or a prompt too short for the prefill path
        (quant.PREFILL_MIN_T)."""
        return T <= MAX_TOKENS and (all_logits or T < PREFILL_MIN_T)

    def forward(self, tokens: np.ndarray, start_pos: int, all_logits: bool = False) -> np.ndarray:
        """Model.forward's contract: tokens [T] (T <= MAX_TOKENS) at positions start_pos.. -> logits
        [V] of the last, or [T, V] with all_logits: Model.forward's bits, in one region."""
        if start_pos + len(tokens) > self.cache.max_ctx:      # before a write past the cache's end
            raise ValueError(f"positions up to {start_pos + len(tokens)} exceed the cache "
                             f"({self.cache.max_ctx}); raise --max-ctx")
        return self.step(self.embed.rows(np.asarray(tokens, dtype=np.int64)), start_pos, all_logits)

    def step(self, x: np.ndarray, pos: int, all_logits: bool = False,
             workers: int | None = None) -> np.ndarray:
        """x [T, C] f32 (T <= MAX_TOKENS; or [C], one token) -> logits [T, V] (all_logits) or [V], a
        new array. workers: worker iterations of the region (default: as many as the threads the
        step runs on, numba's or fewer where that is faster now: threads.py); any number gives
        the same result."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        x = x.reshape(-1, x.shape[-1])
        T = x.shape[0]
        if not 1 <= T <= MAX_TOKENS:
            raise ValueError(f"a step takes 1 to {MAX_TOKENS} tokens, not {T}")
        most = numba.get_num_threads()
        if self.threads.most != most:                # numba's count changed (--threads): start over
            self.threads = Threads(most)
        # fewer where faster now
        n = workers or (self.threads.pick() if T == 1 else self.threads.use)
        args = (n, x.reshape(-1), T, not all_logits, pos, self.prog,
                self.meta, self.data, self.scales, self.mins, self.vecs, self.shared, self.own_size,
                self.cache.data, self.cos[pos:pos + T], self.sin[pos:pos + T], self.eps, self.dims,
                sync.counters(self.n_counters), *self.kinds, *self.ops)
        if self.worker is None:
            self.worker, self.matvec = self._pointers(args)
        numba.set_num_threads(min(n, most))
        t0 = time.perf_counter()
        try:
            _decode(self.worker, self.matvec, *args)
        finally:
            numba.set_num_threads(most)
        if T == 1 and not workers:
            self.threads.update(n, time.perf_counter() - t0)
        _, off, n = self.logits
        rows = T if all_logits else 1
        logits = self.shared[off:off + rows * n].reshape(rows, n).copy()
        return logits if all_logits else logits[0]
