"""Drafts for speculative decoding: cheap guesses of the next tokens, which an engine then
checks k+1 at a time in one forward pass (speculative.py, docs/stage1.md, section 15).

Prompt lookup (`--speculative ngram`) needs no second model. Text that quotes, edits or
summarises reuses runs of tokens it has seen: when the last n tokens of prompt + output
occurred before, the tokens that followed them then are a good guess for what follows now.
Token ids in, token ids out: it needs nothing of the model.

    ids   ... the cat sat on the mat . the cat [sat on the mat] ...
                  ^^^^^^^ an earlier "the cat": propose what followed it, "sat on the mat"

When what followed runs into the present (the text is in a loop), the copy goes on from its own
start, as an LZ77 copy overlaps itself: "a b a b a" proposes "b a b a ...".

SpeculationStats are what the chat, generate and the server show of it.
"""
from __future__ import annotations

from dataclasses import dataclass


class PromptLookup:
    """Propose the k tokens that followed the latest earlier occurrence of the context's last
    n tokens, trying n = max_n first (a longer match predicts better) and down to min_n.

    It keeps an index, n-gram -> its latest start, of every n-gram a token follows, and adds to it
    only the tokens that came since the last call: a step costs its new tokens, not a pass over
    the whole context. A context that does not extend the last one (a new request) starts it
    over."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.ids: list[int] = []                  # the context the index covers
        self.latest: dict[tuple, int] = {}        # n-gram -> the latest start a token follows

    def propose(self, ids, k: int) -> list[int]:
        """ids: prompt + output so far -> up to k drafted tokens ([] when nothing matches)."""
        if k < 1:
            return []
        ids, seen = list(ids), len(self.ids)
        if ids[:seen] != self.ids:
            self.ids, self.latest, seen = [], {}, 0
        L = len(ids)
        # n-grams ending at e <= L - 1 (a token follows them), the newest last: the latest wins,
        # and the tail itself (ending at L) is never its own match
        for e in range(max(seen, 1), L):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                self.latest[tuple(ids[e - n:e])] = e - n
        self.ids = ids
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            i = self.latest.get(tuple(ids[L - n:]))
            if i is not None:
                start = i + n
                out = ids[start:start + k]
                # it ran into the present: what followed repeats (a loop of L - start tokens)
                while len(out) < k:
                    out.append(out[len(out) - (L - start)])
                return out
        return []


@dataclass
class SpeculationStats:
    """One request's speculative decoding, counted by the engine."""
    steps: int = 0           # decode steps: one forward each, of the last token and its drafts
    tokens: int = 0          # tokens those steps produced
    drafted: int = 0         # drafted tokens the steps verified
    accepted: int = 0        # of those, how many were kept

    # a request's choices together
    def __add__(self, other: "SpeculationStats") -> "SpeculationStats":
        return SpeculationStats(self.steps + other.steps, self.tokens + other.tokens,
                                self.drafted + other.drafted, self.accepted + other.accepted)

    def line(self) -> str:
        """"2.6 tokens/step, 61 % of drafts accepted" (the chat's and generate's stats)."""
        rate = (f"{100 * self.accepted / self.drafted:.0f} % of drafts accepted" if self.drafted
                else "nothing drafted")
        return f"{self.tokens / max(self.steps, 1):.1f} tokens/step, {rate}"

    def usage(self) -> dict:
        """The server's usage extension field (usage.speculative_decoding)."""
        return {"steps": self.steps, "tokens": self.tokens, "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted,
                "tokens_per_step": round(self.tokens / max(self.steps, 1), 3),
                "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None}
