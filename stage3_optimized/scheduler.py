"""Continuous batching: which sequences run this step, and how many tokens each.

Changed from stage 2: admission looks in the prefix cache first. A waiting
sequence starts with the cached pages of its leading full pages (block_manager.py),
those positions count as computed, and only the rest is scheduled: a request that
shares a 2,000-token system prompt with an earlier one prefills its own question
only. A preempted sequence finds its own freed pages the same way, if nobody has
overwritten them yet, so recompute after preemption is often cheap.

As in stage 2, every step packs *all* runnable sequences into one batch, mixing
decode tokens (one per sequence) with chunks of prompts being prefilled, under
two limits:
  * token_budget: at most this many tokens per step (bounds the step's activations
    and its latency: a 10k-token prompt is prefilled in chunks, and the sequences
    that are decoding keep getting a token every step meanwhile);
  * slots: at most this many sequences admitted at once.

Order is by arrival, oldest first, both for the budget and for admission, so no
sequence starves: the oldest one always makes progress. When the free pages run
out, the *newest* running sequence is preempted: its pages are freed and it goes
back to the waiting queue, to be recomputed (prefilled again, prompt plus the
tokens it already generated) once pages are free. Recompute costs some work but
never fails a request, and the pool needs only max_ctx positions for the oldest
sequence to finish.

Pure Python: the scheduler never touches the device.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)      # in arrival order
    num_tokens: list[int] = field(default_factory=list)     # tokens fed this step, per sequence
    preempted: list[Sequence] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, slots: int, token_budget: int):
        if slots < 1:
            raise ValueError(f"--slots must be at least 1, got {slots}")
        if token_budget < slots:
            raise ValueError(f"--token-budget ({token_budget}) must be at least --slots ({slots}) "
                             "so that every running sequence can decode a token each step")
        self.bm = block_manager
        self.slots = slots
        self.token_budget = token_budget
        self.waiting: deque[Sequence] = deque()   # by arrival (preempted ones go back in order)
        self.running: list[Sequence] = []         # by arrival, oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, seq_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.id == seq_id:
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """seq is done (stop, length or abort): drop it and free its pages now."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_pages(seq)
        seq.status = Status.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_pages(seq)
        seq.num_computed = 0                      # its cache is gone: recompute from token 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # back into the waiting queue at its arrival rank (it is older than the never-admitted)
        keys = [s.arrival for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.arrival), seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.token_budget

        # 1. running sequences, oldest first: a decode token, or the next chunk of the prompt
        # exercise 2.4 begin
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:   # preempted earlier in this loop
                # (only newer ones are preempted, so all after it are too)
                break
            if budget == 0:
                break
            n = min(seq.num_uncomputed, budget)
            # make room: preempt the newest running sequence until seq's pages fit
            while not self.bm.can_allocate(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            self.bm.allocate(seq, seq.num_computed + n)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        # exercise 2.4 end

        # 2. admit waiting sequences in arrival order while slots, budget and pages last.
        # Not in a step that had to preempt: pages are short, re-admitting would thrash.
        while (self.waiting and budget > 0 and len(self.running) < self.slots
               and not batch.preempted):
            seq = self.waiting[0]
            cached, keys = self.bm.find_cached(seq)    # leading full pages already in the cache
            start = len(cached) * self.bm.page_size
            n = min(len(seq.token_ids) - start, budget)
            if not self.bm.can_admit(seq, cached, start + n):
                break                              # FIFO: nobody jumps the queue
            self.waiting.popleft()
            self.bm.admit(seq, cached, keys)       # num_computed = start: those tokens are skipped
            self.bm.allocate(seq, start + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        self.running.sort(key=lambda s: s.arrival)
        return batch
