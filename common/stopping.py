"""Stop strings, matched on the detokenized text across token boundaries.

A stop string such as "\\n\\nUser:" can be split over several tokens ("\\n",
"\\nUser", ":"), so it is matched on text, not ids. While streaming, the tail of
the text that could still be the start of a stop string is held back; once the
next piece shows it is not, it is released. The stop string itself and anything
after it are never returned.
"""
from __future__ import annotations


class StopChecker:
    def __init__(self, stops: list[str] | None = None):
        self.stops = [s for s in (stops or []) if s]
        self.pending = ""       # text held back: it may be the start of a stop string
        self.stopped = False    # a stop string was seen; everything after it is dropped

    def feed(self, text: str) -> str:
        """New text -> the part that is safe to return now ("" once stopped)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.pending += text
        # the earliest complete stop string wins
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        # hold back the longest tail that is a prefix of some stop string
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """The output ended without a stop string: release what was held back."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class AnswerText:
    """One request's TokenEvents -> its answer text, safe to show: detokenized, without the token of
    a "stop" event (an end-of-turn id such as <|im_end|>, never text: common/engine.py), and cut at
    the first stop string. The server, the chat and generate read an engine's output through it."""

    def __init__(self, detokenizer, stops: list[str] | None = None):
        self.detok, self.stopper = detokenizer, StopChecker(stops)
        # tokens the engine produced (the end-of-turn one too); text shown
        self.n_tokens, self.text = 0, ""
        # set once it has ended: the engine's, or "stop" for a stop string
        self.finish_reason = None

    done = property(lambda self: self.finish_reason is not None)

    def feed(self, ev) -> str:
        """One event -> the new text that is safe to show."""
        self.n_tokens += ev.token_id >= 0
        text = (self.detok.add(ev.token_id) if ev.token_id >= 0 and ev.finish_reason != "stop"
                else "")
        out = self.stopper.feed(text + (self.detok.flush() if ev.finish_reason else ""))
        if self.stopper.stopped or ev.finish_reason:
            out += self.stopper.flush()            # what was held back ("" after a stop string)
            self.finish_reason = "stop" if self.stopper.stopped else ev.finish_reason
        self.text += out
        return out
