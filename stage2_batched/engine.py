"""The stage-2 Engine: continuous batching over a paged KV cache, on a GPU or its CPU twin.

Changed from stage 1: stage 1 runs one request at a time from a FIFO queue with
its own contiguous cache; here every step() batches all runnable sequences:

    scheduler.schedule()   which sequences, how many tokens each (budget, slots, pages)
    build_batch()          their tokens packed into one array + a BatchInfo
    model.forward()        one pass for the whole batch -> logits of the sequences that sample
    sampler, per request   the next token, on the host (common/sampling.py)
    finish / free          stop, length or abort: the sequence's pages go back at once

device="cuda" keeps weights and the page pool on the GPU (CuPy) and launches the
kernels in cuda/; device="cpu" keeps everything in numpy and runs their twins, so
the whole engine is tested on a machine without a GPU.
"""
from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np

from common.config import ModelConfig
from common.engine import Request, TokenEvent, check_prompt
from common.sampling import NO_TOKEN
from . import kernels
from .batch import build_batch
from .block_manager import BlockManager
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
                 kv_memory: int | None = None, device: str = "cuda", progress: bool = True):
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
        self.model = Model(self.weights, max_ctx, num_pages, page_size)
        self.block_manager = BlockManager(num_pages, page_size)
        self.scheduler = Scheduler(self.block_manager, slots, token_budget)
        self.eos_ids = set(self.config.eos_token_ids)
        self.arrivals = itertools.count()
        self.aborted: list[str] = []                 # reported by the next step()
        # counters for benchmarks and the server's stats
        self.num_steps = 0
        self.num_prefill_tokens = self.num_decode_tokens = 0
        self.forward_s = 0.0

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

        # one forward pass for everybody; logits come back only for the sequences that sample
        t0 = time.perf_counter()
        xp = self.xp
        logits = self.model.forward(xp.asarray(tokens), batch.to(xp))      # [S', V] on the device
        self.num_steps += 1

        sampling = []
        for seq, n in zip(seqs, np.diff(batch.query_start).tolist()):
            if n == 1:
                self.num_decode_tokens += 1
            else:
                self.num_prefill_tokens += n
            seq.num_computed += n
            if seq.num_computed == len(seq.token_ids):   # all in: its next token is sampled now
                sampling.append(seq)
        assert len(sampling) == logits.shape[0]
        chosen = self._sample(sampling, logits)
        self.forward_s += time.perf_counter() - t0

        for seq, token in zip(sampling, chosen):
            if token < 0:
                # a degenerate logits row (a NaN or +inf, or all -inf: _sample gives NO_TOKEN):
                # no token to append or embed; the request ends with an error, the others go on
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

    def _sample(self, seqs: list[Sequence], logits) -> list[int]:
        """The next token of each sequence from its logits row [S', V].
        Greedy requests without penalties need only the argmax: it is taken on the device
        and S' ids cross to the host instead of S' * V logits. Every other request copies its
        row to the host and runs its own Sampler (common/sampling.py), as stage 1 does. A row with
        no distribution (a NaN or +inf logit, or every logit -inf) gives NO_TOKEN either way."""
        plain = [s.req.params.temperature == 0 and s.req.params.repetition_penalty == 1.0
                 and not s.req.params.presence_penalty and not s.req.params.frequency_penalty
                 for s in seqs]
        tokens = [0] * len(seqs)
        if any(plain):
            rows = [i for i, p in enumerate(plain) if p]
            picked = logits[self.xp.asarray(rows)]                           # [S'', V]
            finite = self.xp.isfinite(picked.max(axis=-1))                 # NaN and inf have no max
            ids = kernels.to_host(self.xp.where(finite, self.xp.argmax(picked, axis=-1), NO_TOKEN))
            for i, t in zip(rows, ids.tolist()):
                tokens[i] = int(t)
        rest = [i for i, p in enumerate(plain) if not p]
        if rest:
            host = kernels.to_host(logits[self.xp.asarray(rest)])         # [S'', V]
            for row, i in zip(host, rest):
                s = seqs[i]
                tokens[i] = s.sampler(row, s.prompt_ids, s.output_ids)
        return tokens
