"""One request's life inside the batched engine: its tokens, its pages, its progress.

New in stage 2 (stage 1 keeps a single `_Running` record in engine.py): many
sequences are alive at once, each at its own point (waiting, mid-prefill,
decoding), so each carries its own bookkeeping. Pure Python: nothing here
touches the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from common.engine import Request
from common.sampling import Sampler


class Status(Enum):
    WAITING = "waiting"      # queued, or preempted: no pages, nothing in the cache
    RUNNING = "running"      # admitted: owns pages, gets tokens every step it is scheduled
    FINISHED = "finished"


@dataclass
class Sequence:
    req: Request
    # admission order: lower is older (preemption takes the highest)
    arrival: int
    sampler: Sampler                   # the request's own sampler (its own RNG)
    token_ids: list[int] = field(default_factory=list)   # prompt + generated so far
    num_prompt: int = 0
    num_computed: int = 0              # leading tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list) # page of positions [i*P, (i+1)*P)
    status: Status = Status.WAITING
    num_preemptions: int = 0

    @classmethod
    def from_request(cls, req: Request, arrival: int) -> "Sequence":
        return cls(req=req, arrival=arrival, sampler=Sampler(req.params),
                   token_ids=list(req.prompt_ids), num_prompt=len(req.prompt_ids))

    @property
    def id(self) -> str:
        return self.req.id

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed: the rest of the prompt, or 1 (the last sampled token) when
        decoding. After a preemption this is the whole prompt plus the output so far (recompute)."""
        return len(self.token_ids) - self.num_computed
