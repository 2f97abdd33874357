"""The whole contract between the outer layer (text, HTTP, chat) and a stage.

The two layers meet at token ids and nothing else: a stage never sees text and
the server never sees a tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from common.sampling import SamplingParams


@dataclass
class Request:
    id: str                      # unique per request; used by abort() and in TokenEvent
    prompt_ids: list[int]        # the rendered, tokenized prompt
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class TokenEvent:
    request_id: str
    # the token produced this step (-1 when none: abort, or an error before any token)
    token_id: int
    finish_reason: str | None    # None while running, then "stop" | "length" | "abort" | "error"
    # With "stop" the event carries the token that stopped the sequence (an eos id or
    # one of stop_token_ids): it is not part of the answer text. With "length" the
    # token is an ordinary output token. With "abort" token_id is -1, and with "error" too
    # (the engine could not produce a token for this request, e.g. its logits were NaN).


class Engine(Protocol):
    max_ctx: int                 # longest prompt + output one sequence may hold

    def add_request(self, req: Request) -> None:
        """Queue a request. Raises ValueError (with a message for the user) for a
        prompt that cannot fit (empty, or longer than max_ctx)."""

    def abort(self, request_id: str) -> None:
        """Stop a queued or running request; its resources are freed at once and
        the next step() reports it with finish_reason "abort". Unknown ids are ignored."""

    def step(self) -> list[TokenEvent]:
        """Run one scheduling step and return the tokens it produced."""

    def has_work(self) -> bool:
        """True while any request is queued or running."""


def check_prompt(prompt_ids: list[int], max_ctx: int, vocab_size: int) -> None:
    """Validation every engine applies in add_request (a clear message for the user)."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty: send at least one token")
    if len(prompt_ids) >= max_ctx:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens but the context holds {max_ctx}; "
            "shorten the prompt or start the engine with a larger --max-ctx")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
