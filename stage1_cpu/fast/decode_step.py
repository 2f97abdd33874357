"""A whole decode step (one token, all layers, the logits) in one parallel region.

Changed from the core (stage1_cpu/model.py): model.py's forward pass calls one
numba kernel per op: for one token that is 4 matmuls per layer plus the lm_head,
113 parallel regions for Qwen3-0.6B, each starting the threads anew (tens of
microseconds each when idle threads sleep, OMP_WAIT_POLICY=PASSIVE; about a
microsecond when they spin), with Python and small serial ops in between. Here
the threads start once per token and stay for all of it:

    for worker in prange(threads):                 # the only parallel region
        x = embedding row                          (every worker keeps its own copy)
        for each layer:
            h = rmsnorm(x)                         private: every worker computes it
            qkv   = h @ wqkv.T                     phase: rows claimed in blocks   -> shared
            att   = norm, rope, cache, attend      phase: one item per KV head     -> shared
            x    += att @ wo.T                     phase: rows                      -> shared, then added privately
            h = rmsnorm(x)
            gu    = h @ w_gate_up.T                phase: rows                      -> shared
            x    += silu(gate) * up @ w_down.T     phase: rows
        logits = rmsnorm(x) @ lm_head.T            phase: rows

Between phases, each worker waits until every item of the previous one is done
(sync.py: items are claimed through atomic counters, so a thread that wakes late
just takes fewer). The small ops (norms, the residual, SiLU) are done by every
worker on its own copy: recomputing 1024 floats is cheaper than a handoff.

Nothing makes a worker wait for the others to *arrive*, so one can run several
layers ahead of one that woke late (it does all the items itself). Hence every
layer writes its phases' outputs to buffers of its own ([L, ...], ~1.5 MB for
Qwen3-0.6B): the late worker still reads its layer's values, never a later
layer's that overwrote them. (A first version reused one buffer for all layers:
it passed a 6-token bit-for-bit check, then one engine test's 32-token greedy
output parted from transformers' at its third token.)

Every op is the same inlined body the per-op kernels run, in the same order on
the same values: the core's (stage1_cpu/kernels.py: row_f32, rows_bf16, row_int8,
row_int4, rmsnorm_row, rope_head, attention_item, silu_mul_row) and, for rounded
activations, the fast path's (stage1_cpu/fast/kernels.py: rows_int8_q8,
rows_int8_q16, row_int4_q8, quantize_token). So the logits and the KV cache are
bit for bit those of model.forward with the same weights: with fp32 activations
those of the plain path, with rounded ones those of FastWeight.matmul
(tests/test_stage1_decode_step.py checks both, for every weight format).

Which row bodies the step inlines is chosen in Python from cpu.INT8 (the `if`
around _rows below): where the CPU has no integer dot product the fast
kernels are never named, so numba never hands their instructions to LLVM. (A
runtime branch would not do: both sides are compiled, and on an AVX2-only CPU
LLVM aborted with "Cannot select ... VPDPWSSD".)

Not covered, and run by model.py's per-op path instead (DecodeStep.supported):
MoE layers (qwen3_moe, qwen2_moe), qwen2's q/k/v biases, and models whose
layers differ in format or shape.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import prange, types
from numba.typed import List

from stage1_cpu import kernels
from stage1_cpu.fast import cpu, sync
from stage1_cpu.fast import kernels as fk
from stage1_cpu.kernels import FAST

FMT = {"none": 0, "bf16": 1, "int8": 2, "int4": 3}
ACT = {"fp32": 0, "int8": 1, "int16": 2}
NONE, BF16, INT8, INT4 = range(4)
A_FP32, A_INT8, A_INT16 = range(3)
QKV, WO, GATE_UP, DOWN, HEAD = range(5)   # the matrices of a layer (and the lm_head): rows of meta
PHASES = 5                                # per layer: qkv, attention, wo, gate_up, down
ITEMS_PER_WORKER = 16                     # small row blocks per matmul and worker, at least ...
ITEM_BYTES = 1 << 18                      # ... and at most ~256 KB of weights per small block (~10 us)
BIG = 8                                   # a phase's first items are 8 small blocks long ...
TAIL_ITEMS = 2                            # ... its last 2 per worker are small ones (see _items)

_njit = numba.njit(cache=True, fastmath=FAST, error_model="numpy")


_inline = numba.njit(inline="always", fastmath=FAST, error_model="numpy")


@_inline
def _rows_float(fmt, r0, r1, out, wf, wb, q8, q4, s2, m2, x2, x3, x4, xsum4):
    """out[r] = row r of W times x (fp32 activations), r0 <= r < r1: the core's row bodies."""
    if fmt == BF16:
        kernels.rows_bf16(x2, 0, wb, r0, r1, out, 0)
        return
    for r in range(r0, r1):
        if fmt == NONE:
            out[r] = kernels.row_f32(x2, 0, wf, r)
        elif fmt == INT8:
            out[r] = kernels.row_int8(x3, 0, q8, s2, r)
        else:
            out[r] = kernels.row_int4(x4, xsum4, 0, q4, s2, m2, r)


# Which rows kernel the step inlines is decided here, in Python, from cpu.py: where the CPU
# has no integer dot product, the intrinsics (fast/kernels.py) are never named, so numba never
# hands them to LLVM (a runtime `if` would not do: the code is compiled either way).
if cpu.INT8:
    @_inline
    def _rows(fmt, act, r0, r1, out, wf, wb, q8, q4, s2, m2, qf, sf, x2, x3, x4, xsum4, xqf, xaf, x16f, xsf, xsum,
              G, gs):
        """out[r] = row r of W times x, r0 <= r < r1, by the kernel matmul() would use."""
        if act == A_INT8 and fmt == INT8:
            fk.rows_int8_q8(xqf, xaf, xsf, 0, qf, sf, r0, r1, G, gs, out, 0)
        elif act == A_INT16:
            fk.rows_int8_q16(x16f, xsf, 0, qf, sf, r0, r1, G, gs, out, 0)
        elif act == A_INT8:
            for r in range(r0, r1):
                out[r] = fk.row_int4_q8(xqf, xsf, xsum, 0, qf, sf, m2, r, G, gs)
        else:
            _rows_float(fmt, r0, r1, out, wf, wb, q8, q4, s2, m2, x2, x3, x4, xsum4)
else:
    @_inline
    def _rows(fmt, act, r0, r1, out, wf, wb, q8, q4, s2, m2, qf, sf, x2, x3, x4, xsum4, xqf, xaf, x16f, xsf, xsum,
              G, gs):
        """out[r] = row r of W times x, r0 <= r < r1 (activations are fp32 on this CPU)."""
        _rows_float(fmt, r0, r1, out, wf, wb, q8, q4, s2, m2, x2, x3, x4, xsum4)


@numba.njit(inline="always")
def _block_rows(O, row_bytes, workers):
    """Rows per item: small enough that the phase's last item is short (the other
    workers wait for it), large enough that claims (~20 ns each) cost nothing."""
    rows = min(-(-O // (ITEMS_PER_WORKER * workers)), max(1, ITEM_BYTES // max(row_bytes, 1)))
    return max(4, rows + (-rows) % 4)                # whole 4-row blocks, as the prange kernels take them


@numba.njit(inline="always")
def _items(O, row_bytes, workers):
    """How a phase's O rows are cut into items: (small block rows, big block rows,
    number of big items, rows they cover, number of items).

    Big items first, small ones last (the "guided" schedule of OpenMP): every item
    starts new memory streams, and the prefetcher needs a few misses on each before
    it runs ahead, so long items read faster (one core: 30.0 -> 27.0 ms per int8
    step with whole-matrix items instead of 256 KB ones); but the phase ends when its
    last item does, so the last ones are short. Which rows an item holds changes no
    result: every row's dot product is computed alone (kernels.py)."""
    block = _block_rows(O, row_bytes, workers)
    big = BIG * block
    n_big = max(0, O - TAIL_ITEMS * workers * block) // big
    split = n_big * big
    return block, big, n_big, split, n_big + -(-(O - split) // block)


@_njit
def _matvec(m, data, scales, mins, x, out, counts, phase, workers):
    """Phase `phase`: out [O] = W x for x [K] (this worker's copy), W given by its
    format row m = (fmt, act, O, K, Kp, gs) and flat arrays. Rows in claimed blocks."""
    fmt, act, O, K, Kp, gs = m[0], m[1], m[2], m[3], m[4], m[5]
    block, big, n_big, split, n = _items(O, data.size // O, workers)
    i = sync.claim(counts, phase)
    if i >= n:                                                   # the others took every item
        sync.wait(counts, phase, n)
        return
    G = Kp // gs if gs else 0
    # the input as matmul() sees it: padded to whole groups, rounded as the weight asks
    x2 = np.zeros((1, Kp), dtype=np.float32)
    x2[0, :K] = x
    x3 = x2.reshape(1, G, gs) if gs else np.empty((1, 0, 0), dtype=np.float32)
    x4 = x2.reshape(1, G // 2, 2, gs) if fmt == INT4 else np.empty((1, 0, 2, 0), dtype=np.float32)
    xsum4 = np.empty((1, G // 2, 2), dtype=np.float32)
    if fmt == INT4 and act == A_FP32:
        kernels.group_sums(x4, 0, xsum4)
    xq = np.empty((1, G, gs), dtype=np.int8)
    xa = np.empty((1, G, gs), dtype=np.uint8)
    x16 = np.empty((1, G, gs), dtype=np.int16)
    xs = np.empty((1, G), dtype=np.float32)
    xsum = np.empty((1, G), dtype=np.float32)
    if act == A_INT8:
        fk.quantize_token(x3, 0, xq, xa, xs, xsum)
    elif act == A_INT16:
        fk.quantize_token16(x3, 0, x16, xs)
    # the weight in the shape its kernel indexes (an empty stand-in for the other formats)
    wf = data.view(np.float32).reshape(O, Kp) if fmt == NONE else np.empty((0, 0), dtype=np.float32)
    wb = data.view(np.uint16).reshape(O, Kp) if fmt == BF16 else np.empty((0, 0), dtype=np.uint16)
    q8 = data.view(np.int8).reshape(O, G, gs) if fmt == INT8 else np.empty((0, 0, 0), dtype=np.int8)
    q4 = data.reshape(O, G // 2, gs) if fmt == INT4 else np.empty((0, 0, 0), dtype=np.uint8)
    s2 = scales.reshape(O, G) if gs else np.empty((0, 0), dtype=np.uint16)
    m2 = mins.reshape(O, G) if fmt == INT4 else np.empty((0, 0), dtype=np.uint16)
    xqf, xaf, x16f, xsf = xq.reshape(-1), xa.reshape(-1), x16.reshape(-1), xs.reshape(-1)

    while i < n:
        r0 = i * big if i < n_big else split + (i - n_big) * block
        r1 = min(O, r0 + (big if i < n_big else block))
        _rows(fmt, act, r0, r1, out, wf, wb, q8, q4, s2, m2, data, scales,
              x2, x3, x4, xsum4, xqf, xaf, x16f, xsf, xsum, G, gs)
        sync.finish(counts, phase)
        i = sync.claim(counts, phase)
    sync.wait(counts, phase, n)


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


@_njit
def _worker(workers, x0, pos, meta, data, scales, mins, norms, qk_norms, final_norm, kv, cos, sin, eps, dims,
            qkv, att, o_out, gate_up, down_out, logits, counts):
    """Everything one worker does in a decode step (see the module docstring)."""
    L, C, H, Hkv, D, F, qk_norm = dims[0], dims[1], dims[2], dims[3], dims[4], dims[5], dims[6] != 0
    x = x0.copy().reshape(1, C)                      # [1, C] this worker's residual stream
    h = np.empty((1, C), dtype=np.float32)           # [1, C] its normed copy
    act = np.empty((1, F), dtype=np.float32)         # [1, F] silu(gate) * up
    for layer in range(L):
        p, w = PHASES * layer, 4 * layer
        kernels.rmsnorm_row(x, norms[layer, 0], eps, h, 0)
        _matvec(meta[QKV], data[w + QKV], scales[w + QKV], mins[w + QKV], h[0], qkv[layer], counts, p, workers)
        _attention(qkv[layer], kv, layer, pos, cos, sin, qk_norms[layer, 0], qk_norms[layer, 1], qk_norm, eps,
                   H, Hkv, D, att[layer], counts, p + 1)
        _matvec(meta[WO], data[w + WO], scales[w + WO], mins[w + WO], att[layer], o_out[layer], counts, p + 2,
                workers)
        for c in range(C):
            x[0, c] = x[0, c] + o_out[layer, c]
        kernels.rmsnorm_row(x, norms[layer, 1], eps, h, 0)
        _matvec(meta[GATE_UP], data[w + GATE_UP], scales[w + GATE_UP], mins[w + GATE_UP], h[0], gate_up[layer],
                counts, p + 3, workers)
        kernels.silu_mul_row(gate_up[layer:layer + 1], act, 0)
        _matvec(meta[DOWN], data[w + DOWN], scales[w + DOWN], mins[w + DOWN], act[0], down_out[layer],
                counts, p + 4, workers)
        for c in range(C):
            x[0, c] = x[0, c] + down_out[layer, c]
    kernels.rmsnorm_row(x, final_norm, eps, h, 0)
    _matvec(meta[HEAD], data[4 * L], scales[4 * L], mins[4 * L], h[0], logits, counts, PHASES * L, workers)


@numba.njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def _decode(workers, x0, pos, meta, data, scales, mins, norms, qk_norms, final_norm, kv, cos, sin, eps, dims,
            qkv, att, o_out, gate_up, down_out, logits, counts):
    # workers: numba.get_num_threads(), passed in (called in here, it would keep this from the disk cache)
    for _ in prange(workers):                        # one iteration per thread: the one parallel region
        _worker(workers, x0, pos, meta, data, scales, mins, norms, qk_norms, final_norm, kv, cos, sin, eps,
                dims, qkv, att, o_out, gate_up, down_out, logits, counts)


_READONLY = types.Array(types.uint8, 1, "C", readonly=True)
_READONLY16 = types.Array(types.uint16, 1, "C", readonly=True)


def _format_row(w) -> list[int]:
    """A Weight as the kernel sees it: (fmt, act, O, K, Kp, gs), a row of meta."""
    return [FMT[w.fmt], ACT[getattr(w, "decode_act", "fp32")], w.out_features, w.in_features, w.padded_in,
            w.group_size]


def _flat_list(arrays, ty):
    """A numba typed list of read-only flat views (no copies; the weights may be mapped read-only)."""
    out = List.empty_list(ty)
    for a in arrays:
        out.append(a)
    return out


class DecodeStep:
    """The model's arrays in the form _decode takes, built once (views, no weight copies).
    step(x, pos) runs one token: x [C] its embedding, its K/V go to cache position pos."""

    @staticmethod
    def supported(weights) -> bool:
        """Dense models whose layers all have the same matrix formats and shapes (the
        kernel takes one format row per kind of matrix). MoE layers route per token:
        model.py runs them."""
        if any(lw.experts for lw in weights.layers):
            return False
        if any(lw.bqkv is not None for lw in weights.layers):    # qwen2's q/k/v biases: not added here yet
            return False
        kinds = [[_format_row(w) for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)] for lw in weights.layers]
        return all(k == kinds[0] for k in kinds)

    def __init__(self, weights, cache, cos: np.ndarray, sin: np.ndarray):
        cfg = weights.config
        self.cache, self.cos, self.sin = cache, cos, sin
        mats = [[lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down] for lw in weights.layers]
        every = [w for four in mats for w in four] + [weights.lm_head]
        no16 = np.zeros(0, dtype=np.uint16)
        self.data = _flat_list([np.ascontiguousarray(w.data).reshape(-1).view(np.uint8) for w in every], _READONLY)
        self.scales = _flat_list([no16 if w.scales is None else w.scales.reshape(-1).view(np.uint16)
                                  for w in every], _READONLY16)
        self.mins = _flat_list([no16 if w.mins is None else w.mins.reshape(-1).view(np.uint16)
                                for w in every], _READONLY16)

        if not self.supported(weights):
            raise ValueError("decode_step takes dense models with the same formats in every layer")
        first = mats[0]
        self.meta = np.array([_format_row(w) for w in first] + [_format_row(weights.lm_head)], dtype=np.int64)
        L, C, H, Hkv, D = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        F = first[GATE_UP].out_features // 2
        self.norms = np.stack([np.stack([lw.attn_norm, lw.mlp_norm]) for lw in weights.layers]).astype(np.float32)
        ones = np.ones(D, dtype=np.float32)
        self.qk_norms = np.stack([np.stack([lw.q_norm if cfg.qk_norm else ones, lw.k_norm if cfg.qk_norm else ones])
                                  for lw in weights.layers]).astype(np.float32)   # [L, 2, D]
        self.final_norm = np.ascontiguousarray(weights.final_norm, dtype=np.float32)
        self.eps = np.float32(cfg.rms_norm_eps)
        self.dims = np.array([L, C, H, Hkv, D, F, int(cfg.qk_norm)], dtype=np.int64)
        # the phases' shared outputs, one buffer per layer (see the module docstring)
        self.qkv = np.empty((L, (H + 2 * Hkv) * D), dtype=np.float32)
        self.att = np.empty((L, H * D), dtype=np.float32)
        self.o_out = np.empty((L, C), dtype=np.float32)
        self.gate_up = np.empty((L, 2 * F), dtype=np.float32)
        self.down_out = np.empty((L, C), dtype=np.float32)
        self.V = weights.lm_head.out_features
        self.n_phases = PHASES * L + 1

    def step(self, x: np.ndarray, pos: int) -> np.ndarray:
        """x [C] f32 -> logits [V] f32 (a new array)."""
        logits = np.empty(self.V, dtype=np.float32)
        _decode(numba.get_num_threads(), np.ascontiguousarray(x, dtype=np.float32), pos, self.meta, self.data, self.scales, self.mins,
                self.norms, self.qk_norms, self.final_norm, self.cache.data, self.cos[pos:pos + 1],
                self.sin[pos:pos + 1], self.eps, self.dims, self.qkv, self.att, self.o_out, self.gate_up,
                self.down_out, logits, sync.counters(self.n_phases))
        return logits
