"""The stage-3 Engine: stage 2's continuous batching, made fast lesson by lesson.

Changed from stage 2 (docs/lessons/stage3):
  * The block manager shares the pages of common prefixes (block_manager.py). The engine's
    part is small: after each forward pass it registers the pages that became full
    (`block_manager.register`), so the next request with the same prefix finds them, and it
    remembers how many prompt tokens each request found cached (`num_cached_tokens`, for the
    server's usage). `enable_prefix_caching=False` turns the cache off.
  * Requests without penalties or min_p get their next token from the sampling kernel, so S
    ids cross to the host instead of S rows of logits; a degenerate row (a NaN or +inf
    logit, or all -inf) ends its request with an error event.
  * The model's buffers are allocated once, for the largest step (token_budget tokens,
    `slots` sequences).
  * A step's inputs travel to the device in one copy (buffers.StepInputs).
  * On the GPU a step where every sequence decodes one token replays a CUDA graph of the
    forward pass and the sampling (cuda_graphs.py) instead of launching its ~200 kernels one
    by one; `enforce_eager=True` turns that off, and prefill steps, MoE models and
    device="cpu" always run eagerly.

One step, as in stage 2:

    scheduler.schedule()   which sequences, how many tokens each (budget, slots, pages, cache hits)
    build_batch()          their tokens packed into one array + a BatchInfo, and the
                           sampling parameters of the sequences that sample
    inputs.upload()        all of it to the device in one copy
    model.forward()        one pass for the whole batch -> logits of the sequences that sample,
    kernels.sample()       then their next tokens, on the device
                           (or both as the replay of a captured decode graph)
    register full pages    the prefix cache learns what this step computed
    the ids to the host    one copy; requests with penalties sample their logits row on the
                           host (common/sampling.py)
    finish / free          stop, length or abort: the sequence's pages go back at once

device="cuda" keeps weights and the page pool on the GPU (CuPy) and launches the kernels
in cuda/; device="cpu" keeps everything in numpy and runs their twins, so the whole
engine is tested on a machine without a GPU.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from common.config import ModelConfig
from common.engine import Request, TokenEvent, check_prompt
from . import kernels
from .batch import SamplingInputs, build_batch
from .block_manager import BlockManager
from .buffers import StepInputs
from .cuda_graphs import DecodeGraphs
from .kv_cache import KVCache
from .model import Model
from .scheduler import Scheduler
from .sequence import Sequence
from .weights import load_weights

DEVICES = ("cuda", "cpu")


def array_module(device: str):
    """numpy for "cpu"; cupy for "cuda", with a message that says what to do when it is missing."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; "
                         "choose 'cuda' (NVIDIA GPU with CuPy) or 'cpu'")
    if device == "cpu":
        return np
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # ImportError, or CUDARuntimeError when no GPU / driver
        raise RuntimeError(f"device='cuda' needs CuPy and an NVIDIA GPU ({type(e).__name__}: {e}); "
                           "install it with `pip install cupy-cuda13x` (CUDA 13), or run with "
                           "--device cpu (the numpy twins, slow but complete)") from None
    return cupy


class LLMEngine:
    def __init__(self, folder: str | Path, max_ctx: int = 4096, slots: int = 256,
                 token_budget: int = 8192, page_size: int = 256, num_pages: int | None = None,
                 kv_memory: int | None = None, device: str = "cuda", progress: bool = True,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False):
        self.folder = Path(folder)
        self.config = cfg = ModelConfig.from_folder(folder)
        if max_ctx < 2:
            raise ValueError("--max-ctx must be at least 2")
        if page_size < 1:
            raise ValueError(f"--page-size must be positive, got {page_size}")
        self.max_ctx = max_ctx
        self.device = device
        self.xp = xp = array_module(device)
        self.weights = load_weights(folder, cfg, xp, progress)
        self.page_size = page_size
        num_pages = self._pool_pages(num_pages, kv_memory)
        self.model = Model(self.weights, max_ctx, num_pages, page_size,
                           max_tokens=token_budget, max_seqs=slots)
        # every step's inputs in one upload: up to token_budget tokens of up to `slots` sequences
        self.inputs = StepInputs(xp, token_budget, slots, (max_ctx + page_size - 1) // page_size)
        self.block_manager = BlockManager(num_pages, page_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, slots, token_budget)
        self.eos_ids = set(self.config.eos_token_ids)
        self.arrivals = itertools.count()
        self.aborted: list[str] = []                 # reported by the next step()
        # counters for benchmarks and the server's stats
        self.num_steps = 0
        self.num_prefill_tokens = self.num_decode_tokens = 0
        self.forward_s = 0.0
        # request id -> prompt tokens hit
        self.cached_tokens: OrderedDict[str, int] = OrderedDict()
        # False: every row to the host Sampler (stage 2's way)
        self.device_sampling = True
        # decode steps as CUDA graphs, one per batch-size bucket up to `slots` sequences
        self.graphs = None
        if device == "cuda" and not enforce_eager and DecodeGraphs.capturable(self.model):
            self.graphs = DecodeGraphs(self.model, self.inputs, slots)

    def _pool_pages(self, num_pages: int | None, kv_memory: int | None) -> int:
        """Pages in the pool: given, or what kv_memory bytes hold, or most of the free GPU memory
        (1 GiB on cpu)."""
        per_page = KVCache.bytes_per_page(self.config, self.page_size)
        if num_pages is None:
            if kv_memory is None:
                if self.device == "cpu":
                    kv_memory = 2**30                       # 1 GiB of host memory for the twins
                else:
                    # what is free once the weights are in, less room for one step's activations
                    kv_memory = int((self._free_gpu_bytes() - 4 * 2**30) * 0.9)
            num_pages = kv_memory // per_page
        need = (self.max_ctx + self.page_size - 1) // self.page_size
        if num_pages < need:
            raise ValueError(
                f"the KV cache pool holds {num_pages} pages of {self.page_size} positions "
                f"({per_page / 2**20:.1f} MiB each) but one sequence of --max-ctx {self.max_ctx} "
                f"needs {need}; give it more memory (--kv-memory) or lower --max-ctx")
        return num_pages

    def _free_gpu_bytes(self) -> int:
        """Bytes this engine can still allocate on the GPU. CuPy's memory pool keeps the
        blocks that earlier arrays (an earlier engine in this process, say) have given back:
        the driver counts them as used, so mem_info alone would leave a second engine no
        room for its pool. Hand the unreferenced blocks back first, and count the ones the
        pool still caches (free for our allocations) as free."""
        import gc
        gc.collect()                                 # an earlier engine's arrays, if unreferenced
        pool = self.xp.get_default_memory_pool()
        pool.free_all_blocks()
        free, _total = self.xp.cuda.Device().mem_info
        return free + pool.free_bytes()

    # ---- leak checks and stats ----
    def num_free_pages(self) -> int:
        return self.block_manager.num_free_pages()

    def num_total_pages(self) -> int:
        return self.block_manager.num_pages

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def num_cached_tokens(self, request_id: str) -> int:
        """Prompt tokens of a request that came from the prefix cache (0 when unknown):
        the server's usage.prompt_tokens_details.cached_tokens. Kept for the last
        4096 requests, so a finished request can still be asked."""
        return self.cached_tokens.get(request_id, 0)

    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens found in the cache / prompt tokens looked up, since the start."""
        bm = self.block_manager
        return bm.num_hit_tokens / max(bm.num_lookup_tokens, 1)

    # ---- the Engine protocol ----
    def add_request(self, req: Request) -> None:
        check_prompt(req.prompt_ids, self.max_ctx, self.config.vocab_size)
        if self.scheduler.find(req.id) is not None:
            raise ValueError(f"request id {req.id!r} is already running; ids must be unique")
        self.scheduler.add(Sequence.from_request(req, next(self.arrivals)))

    def abort(self, request_id: str) -> None:
        seq = self.scheduler.find(request_id)
        if seq is not None:
            self.scheduler.finish(seq)               # its pages are free from this moment
            self.aborted.append(request_id)

    def has_work(self) -> bool:
        return bool(self.scheduler.has_work() or self.aborted)

    def step(self) -> list[TokenEvent]:
        events = [TokenEvent(rid, -1, "abort") for rid in self.aborted]
        self.aborted = []
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            return events
        seqs, tokens, batch = build_batch(scheduled.seqs, scheduled.num_tokens, self.page_size)
        # what each request found cached (its first admission)
        for seq in seqs:
            if seq.num_preemptions == 0:
                self.cached_tokens[seq.id] = seq.num_cached_tokens
        while len(self.cached_tokens) > 4096:
            self.cached_tokens.popitem(last=False)

        # the sequences whose whole prompt is in after this step sample their next token
        counts = np.diff(batch.query_start).tolist()
        sampling = [seq for seq, n in zip(seqs, counts)
                    if seq.num_computed + n == len(seq.token_ids)]
        params = self._sampling_inputs(sampling)

        # one forward pass for everybody, then the sampling kernel: logits and ids on the device
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.can_run(batch):
            # a decode step: one replay
            logits, ids = self.graphs.run(tokens, batch, params)
        else:
            # one copy
            dev_tokens, dev_batch, dev_params = self.inputs.upload(tokens, batch, params)
            # [S', V] on the device
            logits = self.model.forward(dev_tokens, dev_batch)
            ids = None
            if self.device_sampling and any(self._plain(s) for s in sampling):
                ids = kernels.sample(logits, dev_params.temperature, dev_params.top_k,
                                     dev_params.top_p, dev_params.u,
                                     out=self.model.buffers.next_tokens[:len(sampling)])
        self.num_steps += 1

        for seq, n in zip(seqs, counts):
            if n == 1:
                self.num_decode_tokens += 1
            else:
                self.num_prefill_tokens += n
            seq.num_computed += n
            # its newly full pages join the prefix cache
            self.block_manager.register(seq)
        assert len(sampling) == logits.shape[0]
        chosen = self._pick(sampling, logits, ids)
        self.forward_s += time.perf_counter() - t0

        for seq, token in zip(sampling, chosen):
            if token < 0:
                # a degenerate logits row (a NaN or +inf, or all -inf: kernels.sample gives -1):
                # no token to append or embed; the request ends with an error, the others go on,
                # and no later request reuses the pages it computed
                self.block_manager.forget(seq)
                self.scheduler.finish(seq)
                events.append(TokenEvent(seq.id, -1, "error"))
                continue
            seq.token_ids.append(token)
            p = seq.req.params
            finish = None
            if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
                # the event carries the stop token; it is not answer text
                finish = "stop"
            elif len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_ctx:
                finish = "length"
            if finish is not None:
                self.scheduler.finish(seq)            # pages back to the free list now
            events.append(TokenEvent(seq.id, token, finish))
        return events

    def _plain(self, seq: Sequence) -> bool:
        """Sampled on the device: no penalties, no min_p (those need the host Sampler)."""
        p = seq.req.params
        return (p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                and not p.min_p)

    def _sampling_inputs(self, seqs: list[Sequence]) -> SamplingInputs:
        """The sampling kernel's parameters for each sequence that samples (host arrays).
        Each request's uniform number comes from its own seeded generator, the one its host
        Sampler would use: numpy's choice(p=...) draws one uniform and takes the first token
        whose running sum passes it, which is what the kernel does, so a seed picks the same
        tokens on both paths (up to fp32 rounding at a boundary). Greedy rows, and rows the
        host samples, draw nothing here: their generators stay where the host path leaves them."""
        device = [self.device_sampling and self._plain(s) for s in seqs]
        ps = [s.req.params for s in seqs]
        u = [s.sampler.rng.random() if d and p.temperature != 0 else 0.0
             for s, p, d in zip(seqs, ps, device)]
        return SamplingInputs(temperature=np.array([p.temperature for p in ps], np.float32),
                              top_k=np.array([p.top_k for p in ps], np.int32),
                              top_p=np.array([p.top_p for p in ps], np.float32),
                              u=np.array(u, np.float32))

    def _pick(self, seqs: list[Sequence], logits, ids) -> list[int]:
        """The next token of each sequence that samples, from the device's ids (one copy of S'
        ints) or, for requests with penalties or min_p (and every request when
        device_sampling is off, stage 2's way), from its logits row on the host with its own
        Sampler (common/sampling.py). A degenerate row (NaN, +inf, or every logit -inf)
        gives -1 on either path: step() turns it into an error for that request."""
        xp = self.xp
        device = ids is not None and self.device_sampling
        tokens = kernels.to_host(ids).tolist() if device else [0] * len(seqs)
        rest = [i for i, s in enumerate(seqs) if not (device and self._plain(s))]
        if rest:
            host = kernels.to_host(logits[xp.asarray(np.array(rest, np.int32))])   # [S'', V]
            # as the device path answers them
            bad = kernels.ops.degenerate_rows(host)
            for row, i, degenerate in zip(host, rest, bad.tolist()):
                s = seqs[i]
                tokens[i] = -1 if degenerate else s.sampler(row, s.prompt_ids, s.output_ids)
        return [int(t) for t in tokens]
