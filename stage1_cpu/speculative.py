"""Speculative decoding: one stream, several tokens a step (docs/stage1.md, section 15).

Loaded only with --speculative ngram or --draft-model (options.build_engine): a reader of the
core never needs it. SpeculativeEngine is the stage-1 LLMEngine with its decode step changed:

    1. draft    a proposer guesses the next k tokens: draft.py's prompt lookup, or a
                DraftModel (a smaller model with the same tokenizer and a KV cache of its own)
    2. verify   the last token and its k drafts go through Model.forward as one step of
                T = k+1 tokens (all_logits): row i is the distribution after draft i. Decode on
                a CPU is bound by memory, and this step reads the weights once, as one token does
                (the fast path: one parallel region on register tiles, bit for bit T steps of one)
    3. accept   the drafts in order, by the rule that keeps the output exactly what plain decoding
                would make (greedy: token for token; sampling: the same distribution); the first
                rejected draft is replaced by a draw that corrects for it, and when all k pass,
                row k gives one token more
    4. cut      the cache and cached_ids keep what was accepted; the rejected drafts' K/V stay
                past the cache's end, where attention never reads and the next step writes

So one forward makes 1 to k+1 tokens. How many to draft (DraftLength) follows what pays: fewer
after rejections, more after acceptances, none while drafts cost more than they bring.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from common.engine import TokenEvent
from common.models import resolve_model
from common.sampling import NO_TOKEN, SamplingParams, apply_penalties, filter_logits
from common.tokenizer import Tokenizer, TokenizerError

from .draft import PromptLookup, SpeculationStats
from .engine import LLMEngine

if TYPE_CHECKING:
    from .engine import _Running

# --draft-tokens' default: a verify step of T = k+1 <= 8 tokens is one step of the fast path's
# one region (decode_step.MAX_TOKENS; the core: its decode kernels, T < quant.PREFILL_MIN_T), each
# weight read once for all T tokens, the activations rounded as decode rounds them: the bytes of
# one token and the arithmetic of T (docs/stage1.md, section 15)
DRAFT_TOKENS = 7
KEEP_STATS = 4096          # finished requests whose stats the server can still ask for


def probs(logits: np.ndarray, params: SamplingParams, prompt_ids: list[int],
          output_ids: list[int]) -> np.ndarray:
    """The distribution plain sampling draws from (common/sampling.py: penalties, temperature,
    top-k / top-p / min-p, softmax) [V] float64."""
    x = filter_logits(apply_penalties(logits, params, prompt_ids, output_ids),
                      params).astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def accept_draft(p: np.ndarray, q: np.ndarray, x: int,
                 rng: np.random.Generator) -> tuple[bool, int]:
    """The speculative sampling rule for one drafted token x, drawn from q [V], against the model's
    distribution p [V] at that position -> (accepted, the token to emit).

    Keep x with probability min(1, p[x] / q[x]); otherwise emit a draw from max(0, p - q),
    normalised. A token t then comes out with probability
        q[t] min(1, p[t] / q[t])  +  P(reject) (p[t] - q[t])+ / sum (p - q)+
            =  min(p[t], q[t]) + (p[t] - q[t])+  =  p[t]
    since P(reject) = 1 - sum min(p, q) = sum (p - q)+: exactly plain sampling's distribution."""
    # exercise 1.14 begin
    if rng.random() * q[x] < p[x]:              # u < p[x] / q[x], without dividing by q[x]
        return True, x
    residual = np.maximum(p - q, 0.0)           # where the model wants more than the draft offered
    return False, int(rng.choice(len(p), p=residual / residual.sum()))
    # exercise 1.14 end


class DraftLength:
    """How many tokens to draft next: the k that makes the most tokens per second, from running
    estimates updated every step:
        a       the chance that a draft is accepted; drafts are checked in order, so k drafts make
                1 + a + a^2 + ... + a^k tokens (the last one the replacement or the bonus token)
        cost    seconds of a step of T = k+1 tokens, and of drafting one token
    k = 0 is plain decoding: one token per step at the cost of T = 1. A T not measured yet costs
    what its measured neighbours say (a line between them, or on from the largest; with T = 1
    alone, the napkin's: one token's bytes, a little more compute a token). Drafts grow by
    doubling: a step is at most twice the longest one measured, so a machine where drafts do not
    pay costs one short step to find out, not a long one. The first forward of all is a warm-up
    (compiling, first-touch pages) and is not counted. Each request starts from the prior
    acceptance: what was accepted depends on the text.

    The engine times steps of 1, 2, 4 and k_max + 1 tokens before its first request (calibrate),
    so that request drafts from its first step at the length that pays, not after a few steps of
    growing.

    It never loses by much, on a quiet machine or a busy one, because the estimates follow the
    machine as it is now: two steps in a row that each took far more (or both far less) than their
    estimates say the machine changed (another program took a core, or gave it back), and every
    other estimate is dropped (one such step alone is noise: it only moves its running mean; after
    a slow one the next step is plain, to find out), and a step whose estimate is older than RETRY
    steps replaces it;
    plain decoding's cost is measured again every RETRY steps while drafting; and while drafting
    does not pay, one short draft (k = 1) is tried after RETRY plain steps, then after twice as
    many each time it still does not pay: a loss of about one step in RETRY at first, less later."""

    PRIOR = (1.5, 0.5)          # a = 0.75 before any draft is checked: try drafting
    KEEP = 0.8                  # each step keeps 80 % of acceptance counts: a window of ~5 steps
    JUMP = 1.5                  # a step this many times off its estimate: the machine changed
    # drafts must promise this much more than plain decoding: an estimate of the acceptance from a
    # few steps swings with one lucky guess, and a draft that is rejected costs a longer step
    GAIN = 1.1
    # steps between plain decoding's timings, and before drafting is tried again
    RETRY = 32

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.acc, self.rej = self.PRIOR
        # T -> seconds of a forward of T tokens (running mean)
        self.cost: dict[int, float] = {}
        self.seen: dict[int, int] = {}          # T -> the step that last measured it
        # +1 / -1: the last step took far more / less than estimated
        self.off = 0
        self.draft_cost = 0.0                   # seconds to draft one token (running mean)
        self.steps = 0
        # plain steps in a row; when to try drafting
        self.plain_run, self.retry_after = 0, self.RETRY

    def new_request(self) -> None:
        self.acc, self.rej = self.PRIOR

    def calibrate(self, costs: dict[int, float]) -> None:
        """Seconds of steps of T tokens, timed before any request: the estimates to start from.
        Plain decoding's is averaged with the plain steps that follow, as a measured one is; a
        longer step's counts as old, so the first step of its size replaces it (a request's
        steps sit later in the context). The steps after these are no warm-up."""
        self.cost, self.steps = dict(costs), 1
        self.seen = {T: 1 if T == 1 else -self.RETRY for T in costs}

    @property
    def rate(self) -> float:
        return self.acc / (self.acc + self.rej)

    def estimate(self, T: int) -> float:
        """Seconds of a step of T tokens, from the measured steps (at least one)."""
        if T in self.cost:
            return self.cost[T]
        below, above = [t for t in self.cost if t < T], [t for t in self.cost if t > T]
        if below and above:                     # on the line between the nearest two
            lo, hi = max(below), min(above)
            return self.cost[lo] + (self.cost[hi] - self.cost[lo]) * (T - lo) / (hi - lo)
        if above:
            hi = min(above)
            return self.cost[hi] * self.napkin(T) / self.napkin(hi)
        lo = max(below)
        if len(below) > 1:                      # on from the largest, at the slope of the top two
            lo2 = max(t for t in below if t != lo)
            slope = max(0.0, (self.cost[lo] - self.cost[lo2]) / (lo - lo2))
        else:
            slope = 0.05 * self.cost[lo] / self.napkin(lo)
        return self.cost[lo] + slope * (T - lo)

    def speed(self, k: int) -> float:
        """Expected tokens per second with k drafts."""
        a = min(self.rate, 0.999)
        return (1 - a ** (k + 1)) / (1 - a) / (self.estimate(k + 1) + k * self.draft_cost)

    def choose(self, room: int) -> int:
        """The k to draft, at most k_max and room."""
        ks = range(0, max(0, min(self.k_max, room)) + 1)
        if (len(ks) == 1 or 1 not in self.cost or self.steps - self.seen[1] >= self.RETRY
                or self.off > 0):
            # plain decoding: the only choice, or its cost as it is now (after a surprisingly
            # slow step: did the machine change?)
            return 0
        reach = 2 * max(self.cost) - 1          # drafts grow by doubling the longest step measured
        speeds = {k: self.speed(k) for k in ks if k <= reach}
        best = max(speeds, key=speeds.get)
        if best > 0 and speeds[best] > self.GAIN * speeds[0]:
            self.plain_run, self.retry_after = 0, self.RETRY
            return best
        self.plain_run += 1
        if self.plain_run < self.retry_after:
            return 0
        # one short draft, then wait longer
        self.plain_run, self.retry_after = 0, 2 * self.retry_after
        return 1

    @staticmethod
    def napkin(T: int) -> float:
        """A forward of T tokens against one of 1, before it is measured: the same bytes, a little
        more compute per token."""
        return 1 + 0.05 * (T - 1)

    def update(self, T: int, verify_s: float, drafted: int, accepted: int, draft_s: float) -> None:
        """One step: a forward of T tokens took verify_s, after drafting `drafted` tokens in
        draft_s, of which `accepted` were kept."""
        self.steps += 1
        if self.steps > 1:                      # the first forward of all is a warm-up
            expected = self.estimate(T) if self.cost else verify_s
            off = (verify_s > expected * self.JUMP) - (verify_s < expected / self.JUMP)
            # twice in a row far from the estimates: the machine changed
            if off and self.off == off:
                self.cost = {}
            self.off = off
            old = self.cost.get(T)
            if old is not None and self.steps - self.seen[T] > self.RETRY:
                old = None                      # measured long ago: this step replaces it
            self.cost[T] = verify_s if old is None else 0.7 * old + 0.3 * verify_s
            self.seen[T] = self.steps
        if drafted:
            self.draft_cost = 0.7 * self.draft_cost + 0.3 * draft_s / drafted
            self.acc = self.KEEP * self.acc + accepted
            self.rej = self.KEEP * self.rej + (accepted < drafted)
        else:
            # not drafting: drift back to the prior, to try again later
            self.acc += 0.05 * (self.PRIOR[0] - self.acc)
            self.rej += 0.05 * (self.PRIOR[1] - self.rej)

    def observe(self, hit: bool) -> None:
        """A draft that was not verified, checked against the token made anyway (prompt lookup
        costs nothing to ask): its acceptance, had it been drafted."""
        self.acc = self.KEEP * self.acc + hit
        self.rej = self.KEEP * self.rej + (not hit)


class DraftModel:
    """A smaller model with the target's tokenizer, drafting k tokens one decode step at a time:
    an LLMEngine of its own (weights, Model, KV cache, cached_ids) driven directly. Each call first
    brings its cache up to the context, re-using the longest common prefix as LLMEngine._start does
    between requests: that drops what the target rejected last step, and feeds what it made."""

    def __init__(self, folder: str | Path, **kw):
        self.engine = LLMEngine(folder, **kw)

    def check_matches(self, target: LLMEngine) -> None:
        """A clear error unless the draft speaks the target's token ids."""
        V, Vd = target.config.vocab_size, self.engine.config.vocab_size
        why = f"its vocabulary has {Vd} tokens, the model's {V}" if V != Vd else None
        try:
            a, b = ((Tokenizer(target.folder), Tokenizer(self.engine.folder)) if why is None
                    else (None, None))
            if why is None and any(a.id_to_token(i) != b.id_to_token(i)
                                   for i in range(max(a.vocab_size, b.vocab_size))):
                why = "its tokenizer gives the same ids to other tokens"
        except TokenizerError:
            # folders of token ids only (no tokenizer.json): the sizes decide
            pass
        if why:
            raise ValueError(f"--draft-model {self.engine.folder} cannot draft for "
                             f"{target.folder}: {why}. A draft model must share the model's "
                             "tokenizer (e.g. a smaller model of the same family)")

    def propose(self, prompt: list[int], output: list[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        """-> (k drafted tokens, the distributions q [k, V] they were drawn from, or None where
        each is the argmax: at temperature 0 the drafts are greedy, else drawn with the
        request's sampling)."""
        e, ids = self.engine, prompt + output
        n = 0
        limit = min(len(e.cached_ids), len(ids) - 1)
        while n < limit and e.cached_ids[n] == ids[n]:
            n += 1
        del e.cached_ids[n:]
        # what the draft has not seen, a chunk at a time
        for i in range(n, len(ids), e.prefill_chunk):
            logits = e._feed(ids[i:i + e.prefill_chunk])
        drafts, qs = [], []
        for i in range(k):
            if not np.isfinite(logits.max()):        # a draft without finite logits drafts no more
                break
            if params.temperature == 0.0:
                x = int(np.argmax(apply_penalties(logits, params, prompt, output + drafts)))
            else:
                qs.append(probs(logits, params, prompt, output + drafts))
                x = int(rng.choice(len(qs[-1]), p=qs[-1]))
            drafts.append(x)
            if i + 1 < k:
                logits = e._feed([x])
        return drafts, np.array(qs) if qs else None


class SpeculativeEngine(LLMEngine):
    """LLMEngine, its decode step verifying drafts (the module's docstring)."""

    def __init__(self, folder: str | Path, draft: DraftModel | None = None,
                 draft_tokens: int | None = None, **kw):
        super().__init__(folder, **kw)
        k = DRAFT_TOKENS if draft_tokens is None else draft_tokens
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"--draft-tokens must be a positive integer, got {k!r}")
        if draft is not None:
            draft.check_matches(self)
        self.draft, self.lookup = draft, PromptLookup()
        self.length = DraftLength(k)
        # by request id, the last KEEP_STATS
        self.stats: OrderedDict[str, SpeculationStats] = OrderedDict()
        self.last_speculation: SpeculationStats | None = None
        self.more: list[TokenEvent] = []

    @classmethod
    def from_args(cls, folder: Path, args, kw: dict, quant_for) -> "SpeculativeEngine":
        """options.build_engine's: --speculative, --draft-model (in the format
        quant_for(folder, args) gives it), --draft-tokens, and LLMEngine's options kw, which the
        draft model shares."""
        if args.speculative and args.draft_model:
            raise ValueError("--speculative ngram and --draft-model are two draft sources: "
                             "choose one")
        draft = None
        if args.draft_model:
            path = resolve_model(args.draft_model)
            draft = DraftModel(path, **dict(kw, quant=quant_for(path, args)))
        return cls(folder, draft=draft, draft_tokens=args.draft_tokens, **kw)

    def describe_kernels(self) -> str:
        source = f"draft model {self.draft.engine.folder.name}" if self.draft else "prompt lookup"
        return (f"{super().describe_kernels()} · speculative: {source}, "
                f"up to {self.length.k_max} drafts")

    def reset(self) -> None:
        super().reset()
        if self.draft is not None:              # the draft model's cache goes too
            self.draft.engine.reset()

    def speculation(self, request_id: str) -> SpeculationStats | None:
        """A request's stats (the server's usage.speculative_decoding)."""
        return self.stats.get(request_id)

    # ---- the decode step ----
    def step(self) -> list[TokenEvent]:
        self.more = []
        events = super().step()                 # prefill, then _decode below: its first event ...
        return events + self.more               # ... and the other tokens its verify step made

    def _start(self, req) -> None:
        if not self.length.steps and not self.cached_ids:
            self._calibrate()
        super()._start(req)
        self.last_speculation = self.stats[req.id] = SpeculationStats()
        self.length.new_request()
        while len(self.stats) > KEEP_STATS:
            self.stats.popitem(last=False)
        # the draft model's own draws (temperature > 0), apart from the request's generator
        self.draft_rng = np.random.default_rng(
            None if req.params.seed is None else [req.params.seed, 1])

    def _calibrate(self) -> None:
        """Before the first request: time steps of 1, 2, 4 and up to k_max + 1 tokens, a round to
        warm up, then the median of three (one step's time swings by a fifth) ->
        DraftLength.calibrate. Their tokens sit in the first positions of an empty cache, which
        the prompt's prefill writes over: nothing a prompt could reuse."""
        sizes = sorted({T for T in (1, 2, 4, self.length.k_max + 1)
                        if T <= min(self.length.k_max + 1, self.max_ctx)})
        ids, times = np.zeros(sizes[-1], dtype=np.int64), {T: [] for T in sizes}
        for _ in range(4):
            for T in sizes:
                t0 = time.perf_counter()
                self.model.forward(ids[:T], 0, all_logits=T > 1)
                times[T].append(time.perf_counter() - t0)
        self.length.calibrate({T: float(np.median(t[1:])) for T, t in times.items()})

    def _decode(self, r: _Running) -> TokenEvent:
        """The first token comes from the prefill's logits, as in LLMEngine; each later step feeds
        the last token with its drafts and makes one token or more."""
        if not r.output_ids:
            events = self._emit(r, [r.sampler(r.logits, r.req.prompt_ids, r.output_ids)])
        else:
            t0 = time.perf_counter()
            events = self._verify(r)
            self.last_decode_s += time.perf_counter() - t0
            self.last_decode_tokens += len(events)
        self.more = events[1:]
        return events[0]

    def _verify(self, r: _Running) -> list[TokenEvent]:
        prompt, out, params = r.req.prompt_ids, r.output_ids, r.req.params
        # the drafts must fit the context and the token limit (a step without drafts needs neither)
        k = self.length.choose(min(self.max_ctx - len(self.cached_ids) - 2,
                                   params.max_tokens - len(out) - 1))
        t0 = time.perf_counter()
        q = None
        if k == 0:
            drafts = []
        elif self.draft is not None:
            drafts, q = self.draft.propose(prompt, out, k, params, self.draft_rng)
        else:
            drafts = self.lookup.propose(prompt + out, k)
        t1 = time.perf_counter()

        # 2. one forward: the last token (made last step, not fed yet) and the drafts, [T, V]
        tokens = [out[-1]] + drafts
        logits = self.model.forward(np.asarray(tokens, dtype=np.int64), len(self.cached_ids),
                                    all_logits=bool(drafts))
        self.cached_ids.extend(tokens)
        logits = logits.reshape(len(tokens), -1)
        t2 = time.perf_counter()

        # 3. row i decides draft i (None: row k, after all k drafts, makes the bonus token)
        made: list[int] = []
        for i, x in enumerate(drafts + [None]):
            if q is None or x is None:
                # plain decoding's own draw from row i (greedy: the argmax). Against a draft picked
                # without chance (q one-hot at x) this *is* the rule: the draw equals x with
                # probability p[x] = min(1, p[x] / q[x]), and a draw that is not x follows
                # max(0, p - q) normalised, p without x. It also draws what plain decoding draws:
                # the same seed, the same tokens
                y = r.sampler(logits[i], prompt, out + made)
                accepted = y == x
            else:
                p = probs(logits[i], params, prompt, out + made)
                accepted, y = (False, NO_TOKEN) if not np.isfinite(p).all() else \
                    accept_draft(p, q[i], x, r.sampler.rng)
            made.append(y)
            if not accepted:
                break
        # would prompt lookup have guessed it? It costs nothing to ask
        if not drafts and self.draft is None:
            guess = self.lookup.propose(prompt + out, 1)
            if guess:
                self.length.observe(guess[0] == made[0])
        events = self._emit(r, made)

        # 4. the cache keeps what plain decoding would have fed: the prompt and every token but the
        # last (out is r.output_ids, the new tokens in it now)
        del self.cached_ids[len(prompt) + len(out) - 1:]
        s = self.last_speculation
        s.steps, s.tokens, s.drafted, s.accepted = (s.steps + 1, s.tokens + len(events),
                                                    s.drafted + len(drafts),
                                                    s.accepted + len(made) - 1)
        self.length.update(len(tokens), t2 - t1, len(drafts), len(made) - 1, t1 - t0)
        return events

    def _emit(self, r: _Running, tokens: list[int]) -> list[TokenEvent]:
        """The tokens as events, each ended as LLMEngine._decode ends one; none after the first
        that ends it."""
        p, events = r.req.params, []
        for token in tokens:
            if token == NO_TOKEN:               # no finite logits: an error, and no cache to reuse
                events.append(TokenEvent(r.req.id, -1, "error"))
                self.running, self.cached_ids = None, []
                break
            r.output_ids.append(token)
            finish = None
            if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
                finish = "stop"
            elif (len(r.output_ids) >= p.max_tokens
                  or len(r.req.prompt_ids) + len(r.output_ids) >= self.max_ctx):
                finish = "length"
            events.append(TokenEvent(r.req.id, token, finish))
            if finish:
                self.running = None
                break
        return events
