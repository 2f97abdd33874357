"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

Changed from stage 2: a new file; stage 2 launches every kernel of every step from
Python. A decode step of Qwen3-0.6B launches about 290 kernels and GEMMs
(model.py's docstring); each costs the host a few microseconds to launch, and a small
batch's kernels finish faster than the host can issue them, so the GPU waits on
Python. A CUDA graph records the whole forward pass once and replays it with one
launch. What a graph records is fixed: the kernels, their launch grids, their
scalar arguments and every pointer. So:

  * The inputs live in static buffers (`StaticInputs`), sized for the largest bucket;
    a step copies its batch into them and the graph reads them where they are. The
    output (logits [B, V]) is one array the graph writes on every replay.
  * A graph is captured for a batch size B; a step with b sequences replays the graph of
    the smallest bucket >= b (`pick_bucket`), its b rows first and B - b padding rows
    after them (`pad_decode_batch`). A padding row has slot -1, which the KV store
    (qk_norm_rope_store.cu and its twin) skips, so it writes no page; it reads one
    position (context length 1) of page 0, a real page it only reads, so its numbers
    stay finite; its logits are thrown away.
  * Host numbers that size a launch are fixed at capture: the decode attention grid is
    sized for the model's whole context (max_ctx) instead of this step's longest; the
    splits past a sequence's context return at once.
  * Anything that waits for the host cannot be captured, and those steps run eagerly
    (model.forward as it is): prefill and mixed steps (their shapes change every step),
    batches larger than the largest bucket, and MoE models, whose router copies its
    scores to the host to choose the experts (model.moe). Sampling is not in the graph:
    it reads the logits after the replay (kernels.sample, or the host Sampler for
    penalties), as in an eager step.

If a capture or a replay fails (an error from CUDA or CuPy), the engine warns, keeps the message in
`DecodeGraphs.error` (the benchmark reports it) and runs every later step eagerly.

A bucket's graph is captured the first time a step needs it. That first step runs
eagerly on the static buffers (the warm-up: every kernel is compiled and cuBLAS has
its workspace before a capture, where neither may happen), then the capture records
the same forward pass without running it. Memory the forward pass allocates during a
capture comes from a pool of this object's own (`cupy.cuda.MemoryPool`, via
`using_allocator`), which nothing else allocates from: the addresses baked into a
graph are never handed to another array. The graphs share that pool (only one
replays at a time, on one stream), and each keeps its logits array referenced.

device="cpu" has no graphs: the engine runs every step eagerly. The pure parts (the
buckets, the padding) are tested on the CPU, and so is the replay logic, with a
stand-in capture that records the forward pass as a Python call on the same static
buffers and the same capture-time BatchInfo.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .batch import BatchInfo


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16 up to
    max_batch, and max_batch itself. A batch is padded by at most 15 rows."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def pick_bucket(buckets: list[int], b: int) -> int | None:
    """The smallest bucket that holds b sequences, or None when b is larger than all (eager)."""
    return next((size for size in buckets if size >= b), None)


def pad_decode_batch(tokens: np.ndarray, batch: BatchInfo, size: int,
                     max_blocks: int, max_context: int) -> tuple[np.ndarray, BatchInfo]:
    """A decode-only batch of b sequences (host arrays) -> the same batch padded to `size` rows,
    with block tables `max_blocks` wide: the layout the captured graph reads.
      rows b..size-1: token 0 at position 0, slot -1 (no KV write), context length 1,
                      block table all page 0 (read, never written), token_seq = its own row;
      logits_rows = 0..size-1 (every row gets logits; the caller keeps the first b);
      max_context = max_context (the model's max_ctx: the decode grid of the graph).
    tokens [b] int32 -> [size] int32."""
    # exercise 3.5 begin
    b = len(tokens)
    assert batch.num_decode == b == batch.block_tables.shape[0], "only decode-only batches are captured"
    assert b <= size and batch.block_tables.shape[1] <= max_blocks

    def pad(a, fill):                                  # [b] -> [size]
        out = np.full(size, fill, np.int32)
        out[:b] = a
        return out

    tables = np.zeros((size, max_blocks), np.int32)    # [size, max_blocks]
    tables[:b, :batch.block_tables.shape[1]] = batch.block_tables
    padded = BatchInfo(
        num_decode=size,
        positions=pad(batch.positions, 0),
        slot_mapping=pad(batch.slot_mapping, -1),
        token_seq=np.arange(size, dtype=np.int32),
        block_tables=tables,
        context_lens=pad(batch.context_lens, 1),
        query_start=np.arange(size + 1, dtype=np.int32),
        logits_rows=np.arange(size, dtype=np.int32),
        tile_start=np.zeros(0, np.int32),
        tile_count=np.zeros(0, np.int32),
        max_context=max_context,
    )
    return pad(tokens, 0), padded
    # exercise 3.5 end


# the static inputs, in the order they sit in StaticInputs' one buffer: name -> ints per row
# (query_start has one more entry; block_tables, last, is max_blocks per row)
LAYOUT = ("tokens", "positions", "slot_mapping", "token_seq", "context_lens", "logits_rows", "rows",
          "query_start", "block_tables")


@dataclass
class StaticInputs:
    """The arrays a captured graph reads, on the model's device, sized for the largest bucket.
    A bucket of B rows uses the first B rows of each (contiguous slices).
    They are views of one int32 buffer on the device (`device`), and fill() writes a step's
    numbers into its host twin (`host`, page-locked on a GPU) and then copies the used part
    over in one transfer: one DMA per replay instead of one pageable copy per array (each of
    those stages through a driver buffer and waits for the host). On the CPU, host is device."""
    tokens: object            # [Bmax] int32
    positions: object         # [Bmax] int32
    slot_mapping: object      # [Bmax] int32
    token_seq: object         # [Bmax] int32
    block_tables: object      # [Bmax, max_blocks] int32
    context_lens: object      # [Bmax] int32
    query_start: object       # [Bmax + 1] int32
    logits_rows: object       # [Bmax] int32
    empty: object             # [0] int32 (a decode batch has no prefill tiles)
    rows: object = None       # [Bmax] int32: the real batch's logits_rows (the rows the caller keeps)
    device: object = None     # [n] int32: the one buffer the arrays above are views of
    host: object = None       # [n] int32 numpy: its host twin (page-locked memory on a GPU)
    host_views: dict = None   # name -> the host twin's view of that array
    pinned: object = None     # the page-locked allocation behind host (kept alive)
    copied: object = None     # a CUDA event after the last copy: host may be rewritten once it is done

    @classmethod
    def allocate(cls, xp, max_batch: int, max_blocks: int) -> "StaticInputs":
        B = max_batch
        sizes = {name: B for name in LAYOUT}
        sizes["query_start"], sizes["block_tables"] = B + 1, B * max_blocks
        n = sum(sizes.values())
        device = xp.zeros(n, dtype=np.int32)
        pinned = None
        if isinstance(device, np.ndarray):                 # numpy (or a stand-in of a device array)
            host = device.view(np.ndarray)
        else:
            pinned = xp.cuda.alloc_pinned_memory(n * 4)
            host = np.ndarray(n, np.int32, buffer=pinned)   # (what cupyx.empty_pinned does)
            host[...] = 0
        views, host_views, at = {}, {}, 0
        for name in LAYOUT:
            views[name], host_views[name] = device[at:at + sizes[name]], host[at:at + sizes[name]]
            at += sizes[name]
        views["block_tables"] = views["block_tables"].reshape(B, max_blocks)
        host_views["block_tables"] = host_views["block_tables"].reshape(B, max_blocks)
        return cls(**views, empty=xp.zeros(0, dtype=np.int32), device=device, host=host,
                   host_views=host_views, pinned=pinned)

    def view(self, size: int, max_context: int) -> BatchInfo:
        """The BatchInfo of a bucket: views of the first `size` rows (what the graph reads)."""
        return BatchInfo(num_decode=size, positions=self.positions[:size],
                         slot_mapping=self.slot_mapping[:size], token_seq=self.token_seq[:size],
                         block_tables=self.block_tables[:size], context_lens=self.context_lens[:size],
                         query_start=self.query_start[:size + 1], logits_rows=self.logits_rows[:size],
                         tile_start=self.empty, tile_count=self.empty, max_context=max_context)

    def fill(self, tokens: np.ndarray, batch: BatchInfo, rows: np.ndarray | None = None) -> None:
        """Copy a padded host batch (pad_decode_batch) into the first rows, and the rows of the
        logits to keep into `rows`: writes into the host twin, then one copy to the device."""
        size = len(tokens)
        if self.copied is not None:
            self.copied.synchronize()                      # the previous copy has read the host twin
        h = self.host_views
        for name, src in [("tokens", tokens), ("positions", batch.positions), ("slot_mapping", batch.slot_mapping),
                          ("token_seq", batch.token_seq), ("context_lens", batch.context_lens),
                          ("logits_rows", batch.logits_rows), ("query_start", batch.query_start)]:
            h[name][:len(src)] = src
        if rows is not None:
            h["rows"][:len(rows)] = rows
        bt = batch.block_tables
        h["block_tables"][:size, :bt.shape[1]] = bt
        # the used part: everything before the block tables, and the bucket's rows of them
        used = int(h["block_tables"].ctypes.data - self.host.ctypes.data) // 4 + size * bt.shape[1]
        assert bt.shape[1] == h["block_tables"].shape[1], "pad_decode_batch makes the tables max_blocks wide"
        self._upload(used)

    def _upload(self, n: int) -> None:
        """host[:n] -> device[:n]: one asynchronous copy from page-locked memory (none on the CPU)."""
        if self.pinned is None:
            return
        import cupy
        stream = cupy.cuda.get_current_stream()
        self.device[:n].set(self.host[:n], stream=stream)
        if self.copied is None:
            self.copied = cupy.cuda.Event(disable_timing=True)
        self.copied.record(stream)


class CupyCapture:
    """The real capture: record `fn()` on a non-blocking stream into a cupy.cuda.graph.Graph,
    with allocations from a private pool. `replay(graph)` launches it on the current stream."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.pool = cupy.cuda.MemoryPool()            # only captures allocate from it

    def __call__(self, fn):
        cp = self.cupy
        cp.cuda.get_current_stream().synchronize()    # the warm-up step is done
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            self.stream.begin_capture()               # relaxed mode (CuPy's default): the pool may cudaMalloc
            try:
                out = fn()
            except BaseException:
                # end the capture, but raise fn's error: the "capture invalidated" error that
                # end_capture() gives after a failed launch only hides the cause
                try:
                    self.stream.end_capture()
                except Exception:
                    pass
                raise
            graph = self.stream.end_capture()
        return graph, out

    def replay(self, graph) -> None:
        graph.launch(stream=self.cupy.cuda.get_current_stream())


class DecodeGraphs:
    """The captured decode steps of one model: `run(tokens, batch)` -> logits [b, V] float32,
    or None when this step must run eagerly (the caller then calls model.forward)."""

    def __init__(self, model, max_batch: int, capture=None):
        self.model = model
        self.xp = model.xp
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = (model.max_ctx + model.cache.page_size - 1) // model.cache.page_size
        self.static = StaticInputs.allocate(self.xp, self.buckets[-1], self.max_blocks)
        self.capture = capture if capture is not None else CupyCapture()
        self.graphs: dict[int, tuple[object, object]] = {}   # bucket -> (graph, its logits [B, V])
        self.num_replays = self.num_eager = 0
        self.error: str | None = None                # why capturing failed (then every step is eager)

    @staticmethod
    def capturable(model) -> bool:
        """MoE routing syncs with the host (model.moe): such a model runs every step eagerly."""
        return not any(lw.experts for lw in model.w.layers)

    def can_run(self, batch: BatchInfo) -> bool:
        S = batch.block_tables.shape[0]
        return (self.error is None and batch.num_decode == S and S <= self.buckets[-1]
                and batch.max_context <= self.model.max_ctx)

    def run(self, tokens: np.ndarray, batch: BatchInfo):
        """tokens [b] and batch on the host (decode-only, can_run) -> logits [b', V] of
        batch.logits_rows, on the model's device."""
        b = len(tokens)
        size = pick_bucket(self.buckets, b)
        ptokens, pbatch = pad_decode_batch(tokens, batch, size, self.max_blocks, self.model.max_ctx)
        self.static.fill(ptokens, pbatch, batch.logits_rows)       # one host-to-device copy
        info = self.static.view(size, self.model.max_ctx)
        static_tokens = self.static.tokens[:size]
        rows = self.static.rows[:len(batch.logits_rows)]
        if size in self.graphs:
            graph, logits = self.graphs[size]
            try:
                self.capture.replay(graph)
                self.num_replays += 1
                # a copy of the rows asked for: the next replay overwrites the graph's logits
                return logits[rows]
            except Exception as e:  # (CuPy may instantiate a graph at its first launch)
                self._give_up(e)
        # warm-up (or eager from now on): this step on the static buffers; then record it
        logits = self.model.forward(static_tokens, info)
        self.num_eager += 1
        if self.error is None:
            try:
                self.graphs[size] = self.capture(lambda: self.model.forward(static_tokens, info))
            except Exception as e:  # a CUDA or CuPy error: this engine goes on eagerly, and says why
                self._give_up(e)
        return logits[rows]

    def _give_up(self, e: Exception) -> None:
        """A capture or replay failed: keep the reason, drop the graphs, warn once."""
        import warnings
        self.error = f"{type(e).__name__}: {str(e)[:300]}"
        self.graphs.clear()
        warnings.warn(f"a CUDA graph capture or replay failed ({self.error}); every step runs eagerly now")
