"""The stage-1 Engine: one sequence at a time, a FIFO queue behind it. step() prefills up
to `prefill_chunk` prompt tokens, or decodes one token; the KV cache survives between
requests, so a prompt that starts with the cached tokens (the next turn of a chat) only
prefills the new part (docs/stage1.md, section 2).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.config import ModelConfig
from common.engine import Request, TokenEvent, check_prompt
from common.sampling import NO_TOKEN, Sampler

from .jit import numba_cache
from .model import build_model
from .weights import load_weights


@dataclass
class _Running:
    req: Request
    sampler: Sampler
    fed: int = 0                                   # prompt tokens already in the cache
    output_ids: list[int] = field(default_factory=list)
    logits: np.ndarray | None = None               # [V] of the last fed position


class LLMEngine(numba_cache.WarmUp):   # warm_up(), describe_kernels(): jit/numba_cache.py
    def __init__(self, folder: str | Path, quant: str = "none", group_size: int = 32,
                 max_ctx: int = 4096, threads: int | None = None, progress: bool = True,
                 prefill_chunk: int = 512, use_numba: bool = True, kernels: str = "auto",
                 activations: str = "auto"):
        if threads:
            numba_cache.set_threads(threads)
        self.folder = Path(folder)
        self.config = cfg = ModelConfig.from_folder(folder)
        if max_ctx < 2:
            raise ValueError("--max-ctx must be at least 2")
        self.max_ctx = max_ctx
        self.weights = load_weights(folder, cfg, quant, group_size, progress, kernels, activations)
        self.model = build_model(self.weights, max_ctx, use_numba)
        self.prefill_chunk = prefill_chunk
        self.eos_ids = set(self.config.eos_token_ids)
        self.queue: deque[Request] = deque()
        self.running: _Running | None = None
        self.cached_ids: list[int] = []           # tokens whose K/V are in the cache, in order
        self.aborted: list[str] = []              # reported by the next step()
        # timing of the last finished request (the chat prints these)
        self.last_prefill_s = self.last_decode_s = 0.0
        self.last_prefill_tokens = self.last_decode_tokens = 0

    # ---- the Engine protocol ----
    def add_request(self, req: Request) -> None:
        check_prompt(req.prompt_ids, self.max_ctx, self.config.vocab_size)
        self.queue.append(req)

    def abort(self, request_id: str) -> None:
        if self.running and self.running.req.id == request_id:
            self.running = None
            self.aborted.append(request_id)
            return
        for r in list(self.queue):
            if r.id == request_id:
                self.queue.remove(r)
                self.aborted.append(request_id)

    def has_work(self) -> bool:
        return bool(self.queue or self.running or self.aborted)

    def reset(self) -> None:
        """Forget the cached conversation (the next prompt is prefilled from scratch)."""
        self.cached_ids = []

    def step(self) -> list[TokenEvent]:
        events = [TokenEvent(rid, -1, "abort") for rid in self.aborted]
        self.aborted = []
        if self.running is None and self.queue:
            self._start(self.queue.popleft())
        if self.running is not None:
            r = self.running
            if r.fed < len(r.req.prompt_ids):
                self._prefill_chunk(r)
            if r.fed == len(r.req.prompt_ids):   # prompt done: every further step makes a token
                events.append(self._decode(r))
        return events

    # ---- internals ----
    def _start(self, req: Request) -> None:
        prompt = req.prompt_ids
        # reuse the longest common prefix of the cache; at least one token must be fed
        # to get logits, so a prompt entirely in the cache re-feeds its last token
        # exercise 1.5 begin
        n = 0
        limit = min(len(self.cached_ids), len(prompt) - 1)
        while n < limit and self.cached_ids[n] == prompt[n]:
            n += 1
        self.cached_ids = self.cached_ids[:n]
        # exercise 1.5 end
        self.running = _Running(req, Sampler(req.params), fed=n)
        self.last_prefill_tokens, self.last_prefill_s = len(prompt) - n, 0.0
        self.last_decode_tokens, self.last_decode_s = 0, 0.0

    def _feed(self, tokens: list[int]) -> np.ndarray:
        logits = self.model.forward(np.asarray(tokens, dtype=np.int64), len(self.cached_ids))
        self.cached_ids.extend(tokens)
        return logits

    def _prefill_chunk(self, r: _Running) -> None:
        t0 = time.perf_counter()
        chunk = r.req.prompt_ids[r.fed:r.fed + self.prefill_chunk]
        r.logits = self._feed(chunk)
        r.fed += len(chunk)
        self.last_prefill_s += time.perf_counter() - t0

    def _decode(self, r: _Running) -> TokenEvent:
        """Sample a token from the last logits; unless that ends the request, feed it."""
        t0 = time.perf_counter()
        p = r.req.params
        token = r.sampler(r.logits, r.req.prompt_ids, r.output_ids)
        r.output_ids.append(token)
        # it ends on a stop token (the event carries it; it is not answer text), at its token
        # limit or a full context, or on logits with no token (NO_TOKEN: an error; drop the cache)
        stop = (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        full = len(r.output_ids) >= p.max_tokens or len(self.cached_ids) + 1 >= self.max_ctx
        finish = "error" if token == NO_TOKEN else "stop" if stop else "length" if full else None
        if finish is None:
            r.logits = self._feed([token])
            self.last_decode_tokens += 1
            self.last_decode_s += time.perf_counter() - t0
        else:
            self.running, self.cached_ids = None, [] if finish == "error" else self.cached_ids
        return TokenEvent(r.req.id, token, finish)
