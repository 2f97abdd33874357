"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

Changed from stage 2: a new file; stage 2 launches every kernel of every step from
Python. A decode step of Qwen3-0.6B launches about 200 kernels even after the fusions
(model.py's docstring); each costs the host several microseconds to launch, and a small
batch's kernels finish faster than the host can issue them, so the GPU waits on
Python. A CUDA graph records the whole step once and replays it with one launch.
What a graph records is fixed: the kernels, their launch grids, their scalar arguments
and every pointer. So:

  * The step reads its inputs where the last upload put them (buffers.StepInputs: a
    bucket's fields always land at the same addresses) and writes every intermediate
    into the model's buffers (buffers.Activations): nothing in the step allocates.
    The output is the sampled ids (and the logits, for rows the host samples).
  * The sampling kernel is in the graph, after the forward pass: a replay ends with
    the next tokens on the device, and the host copies S ids back, not S * V logits.
  * A graph is captured for a batch size B; a step with b sequences replays the graph of
    the smallest bucket >= b (`pick_bucket`), its b rows first and B - b padding rows
    after them (`pad_decode_batch`). A padding row has slot -1, which the KV store
    (qk_norm_rope_store.cu and its twin) skips, so it writes no page; it reads one
    position (context length 1) of page 0, a real page it only reads, so its numbers
    stay finite; its logits and token are thrown away.
  * Host numbers that size a launch are fixed at capture: the decode attention grid is
    sized for the model's whole context (max_ctx) instead of this step's longest; the
    splits past a sequence's context return at once.
  * What a graph cannot hold runs eagerly (model.forward as it is): prefill and mixed
    steps (their shapes change every step), batches larger than the largest bucket,
    MoE models (the router copies its scores to the host to choose the experts), and
    Qwen2's q/k/v biases on more than 4 rows (cupy's elementwise add allocates).
  * The GEMMs are cuBLAS calls made through ctypes (cublas.py): CuPy's own cuBLAS
    wrapper refuses to run during a capture.

If a capture or a replay fails (an error from CUDA or CuPy), the engine warns, keeps the
message in `DecodeGraphs.error` (the benchmark reports it) and runs every later step eagerly.

A bucket's graph is captured the first time a step needs it. That first step runs
eagerly on the same buffers (the warm-up: every kernel is compiled and cuBLAS has chosen
its algorithm before the capture, where neither may happen), then the capture records
the same step without running it.

device="cpu" has no graphs: the engine runs every step eagerly. The pure parts (the
buckets, the padding) are tested on the CPU, and so is the replay logic, with a
stand-in capture that records the step as a Python call; the tests' emulated CuPy also
captures for real: it records the kernel launches and cuBLAS calls of the step and
refuses, during a capture, what CuPy refuses (bench/testbed/cuda_emulator.py).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from . import kernels
from .batch import BatchInfo, SamplingInputs
from .buffers import StepInputs


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
    assert batch.num_decode == b == batch.block_tables.shape[0], (
        "only decode-only batches are captured")
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


def pad_sampling(sampling: SamplingInputs, size: int) -> SamplingInputs:
    """The sampling parameters of b rows padded to `size`: the padding rows are greedy."""
    def pad(a, fill, dtype):                           # [b] -> [size]
        out = np.full(size, fill, dtype)
        out[:len(a)] = a
        return out
    return SamplingInputs(temperature=pad(sampling.temperature, 0.0, np.float32),
                          top_k=pad(sampling.top_k, 0, np.int32),
                          top_p=pad(sampling.top_p, 1.0, np.float32),
                          u=pad(sampling.u, 0.0, np.float32))


class CupyCapture:
    """The real capture: record `fn()` on a non-blocking stream into a cupy.cuda.graph.Graph.
    `replay(graph)` launches it on the current stream."""

    def __init__(self):
        import cupy   # here: the module imports without CuPy (device="cpu")
        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def __call__(self, fn):
        cp = self.cupy
        # the warm-up step (and its input copy) is done
        cp.cuda.get_current_stream().synchronize()
        with self.stream:
            self.stream.begin_capture()
            try:
                fn()
            except BaseException:
                # end the capture, but raise fn's error: the "capture invalidated" error that
                # end_capture() gives after a failed launch only hides the cause
                try:
                    self.stream.end_capture()
                except Exception:
                    pass
                raise
            return self.stream.end_capture()

    def replay(self, graph) -> None:
        graph.launch(stream=self.cupy.cuda.get_current_stream())


@dataclass
class Captured:
    graph: object         # what the capture returned
    logits: object        # [B, V] float32: the graph's logits buffer (a view of the model's)
    tokens: object        # [B] int32: the graph's sampled ids


class DecodeGraphs:
    """The captured decode steps of one model: `run(tokens, batch, sampling)` -> (logits [b, V],
    next tokens [b]) on the device, for a decode-only batch that `can_run`."""

    def __init__(self, model, inputs: StepInputs, max_batch: int, capture=None):
        self.model = model
        self.inputs = inputs
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = (model.max_ctx + model.cache.page_size - 1) // model.cache.page_size
        self.capture = capture if capture is not None else CupyCapture()
        self.graphs: dict[int, Captured] = {}        # bucket -> its graph and output buffers
        self.num_replays = self.num_eager = 0
        # why capturing failed (then every step is eager)
        self.error: str | None = None

    @staticmethod
    def capturable(model) -> bool:
        """MoE routing syncs with the host (model.moe): such a model runs every step eagerly."""
        return not any(lw.experts for lw in model.w.layers)

    def can_run(self, batch: BatchInfo) -> bool:
        S = batch.block_tables.shape[0]
        size = pick_bucket(self.buckets, S)
        biased = self.model.w.layers[0].bqkv is not None
        return (self.error is None and batch.num_decode == S and size is not None
                and batch.max_context <= self.model.max_ctx
                and not (biased and size > kernels.GEMV_MAX_ROWS))

    def step(self, tokens, batch: BatchInfo, sampling: SamplingInputs):
        """The recorded step: the forward pass, then the sampling kernel (device arrays)."""
        logits = self.model.forward(tokens, batch)
        ids = kernels.sample(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                             sampling.u, out=self.model.buffers.next_tokens[:len(tokens)])
        return logits, ids

    def run(self, tokens: np.ndarray, batch: BatchInfo, sampling: SamplingInputs):
        """tokens [b], batch and sampling on the host (decode-only, can_run) -> (logits [b, V],
        ids [b]) on the model's device: views of buffers the next step overwrites."""
        b = len(tokens)
        size = pick_bucket(self.buckets, b)
        ptokens, pbatch = pad_decode_batch(tokens, batch, size, self.max_blocks, self.model.max_ctx)
        inputs = self.inputs.upload(ptokens, pbatch, pad_sampling(sampling, size))   # one copy
        if size in self.graphs:
            done = self.graphs[size]
            try:
                self.capture.replay(done.graph)
                self.num_replays += 1
                return done.logits[:b], done.tokens[:b]
            except Exception as e:  # (CuPy may instantiate a graph at its first launch)
                self._give_up(e)
        # warm-up (or eager from now on): this step on the same buffers; then record it
        logits, ids = self.step(*inputs)
        self.num_eager += 1
        if self.error is None:
            try:
                graph = self.capture(lambda: self.step(*inputs))
                self.graphs[size] = Captured(graph, logits, ids)
            # a CUDA or CuPy error: this engine goes on eagerly, and says why
            except Exception as e:
                self._give_up(e)
        return logits[:b], ids[:b]

    def _give_up(self, e: Exception) -> None:
        """A capture or replay failed: keep the reason, drop the graphs, warn once."""
        self.error = f"{type(e).__name__}: {str(e)[:300]}"
        self.graphs.clear()
        warnings.warn(f"a CUDA graph capture or replay failed ({self.error}); every step "
                      "runs eagerly now")
