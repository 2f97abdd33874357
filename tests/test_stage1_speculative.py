"""Speculative decoding in stage 1 (stage1_cpu/speculative.py, stage1_cpu/draft.py): the output is
plain decoding's, greedy token for token and sampled in distribution, whichever drafts come.

Plain decoding, the reference, is LLMEngine on the same weights. A verify step of T = k+1 < 8
tokens runs the decode kernels (quant.PREFILL_MIN_T), which give each position bit for bit the
logits of a one-token step, so there greedy output must be equal with no exception. From T = 8
on a verify step runs the prefill path, whose logits differ from decode's by a stated bound
(PREFILL_BOUND); there a difference is allowed only at a near-tie of plain's top two logits.
"""
from __future__ import annotations

import itertools
import json
import shutil
import sys
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from bench.speculative import lookup_steps, stage1_run
from bench.testbed.models import make_model
from common.config import ModelConfig
from common.engine import Request
from common.sampling import SamplingParams, apply_penalties
from course.exercises.stage1 import P_FAIL, chi_square_p
from stage1_cpu import speculative
from stage1_cpu.draft import PromptLookup, SpeculationStats
from stage1_cpu.engine import LLMEngine
from stage1_cpu.fast import available as fast_unavailable
from stage1_cpu.model import build_model
from stage1_cpu.speculative import DraftModel, SpeculativeEngine

# The verify step's logits against decode's, max |difference| / max |logit| of the row, where a
# step of 8 tokens or more takes the prefill path: the plain kernels' BLAS tiles sum in another
# order (measured ~5e-7 on these models); the fast kernels round a prompt's activations to int16
# where decode rounds them to int8 (measured ~1e-2). A wrong verify is off by O(1).
PREFILL_BOUND = {"plain": 1e-5, "fast": 3e-2}
MAX_CTX = 256


def folder_for(family: str, **kw):
    # initializer_range 0.05: greedy text that falls into loops now and then, so prompt lookup has
    # runs to find and runs to miss (at 0.2 it rarely repeats, at 0.02 it repeats one token)
    return make_model(family, initializer_range=0.05, **kw)


def run(engine, prompt, n, rid="r", **params) -> list[int]:
    params = dict(dict(temperature=0.0, max_tokens=n, ignore_eos=True), **params)
    engine.add_request(Request(rid, list(prompt), SamplingParams(**params)))
    out = []
    while engine.has_work():
        out += [e.token_id for e in engine.step() if e.request_id == rid]
    return out


def plain_greedy(engine: LLMEngine, prompt, n, **params) -> tuple[list[int], list[np.ndarray]]:
    """Plain greedy tokens, and the logits each came from (row j: token j's)."""
    rows, forward = [], engine.model.forward
    engine.model.forward = lambda *a, **k: rows.append(forward(*a, **k)) or rows[-1]
    try:
        return run(engine, prompt, n, **params), rows
    finally:
        engine.model.forward = forward


def compare_greedy(plain, rows, spec, prompt, bound, params) -> str | None:
    """None when spec equals plain; a report when they part at a near-tie of plain's top two
    logits (margin below bound x max |logit|); an assertion error at any other difference."""
    if spec == plain:
        return None
    j = next(i for i, (a, b) in enumerate(zip(plain, spec)) if a != b)
    logits = apply_penalties(rows[j], SamplingParams(temperature=0.0, **params), prompt, plain[:j])
    top2 = np.sort(logits)[-2:]
    margin, allowed = float(top2[1] - top2[0]), bound * float(np.abs(logits).max())
    assert margin < allowed, (f"token {j}: speculative {spec[j]}, plain {plain[j]}, and plain's "
                              f"top two logits are {margin:.3g} apart, not a near-tie "
                              f"(bound {allowed:.3g})")
    return f"near-tie at token {j}: top-2 margin {margin:.2e} < bound {allowed:.2e}"


@pytest.fixture(scope="module")
def prompts():
    """Per family: random ids, and the same followed by the model's own greedy text, which loops:
    greedy, prompt lookup finds what comes next there; with penalties against repeating, it
    fails."""
    out = {}
    for family in ("qwen3", "qwen3_moe"):
        ids = np.random.default_rng(3).integers(3, 500, 16).tolist()
        own = run(LLMEngine(folder_for(family), max_ctx=MAX_CTX,
                            progress=False, kernels="plain"), ids, 64)
        out[family] = {"random": ids, "own": ids + own}
    return out


def kernels_or_skip(kernels: str) -> str:
    if kernels == "fast" and fast_unavailable():
        pytest.skip(f"no fast path on this CPU: {fast_unavailable()}")
    return kernels


# ------------------------------------------------------------------ the draft sources

def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    lookup = PromptLookup()
    ids = [5, 1, 2, 3, 9, 8, 4, 3, 6, 1, 2, 3, 7, 5, 0, 1, 2, 3]
    # [1, 2, 3] occurred at 1 and 9: the latest wins (the first would give [9, 8])
    assert lookup.propose(ids, 2) == [7, 5]
    # n = 3 before n = 1: the latest [3] alone is at 11, followed by [7, 5, 0]; [4, 3] matches
    # nothing longer
    # tail [8, 4, 3] -> only "3" matches, at 3
    assert lookup.propose(ids[:8], 3) == [9, 8, 4]
    # what follows runs into the present: a loop
    assert lookup.propose(ids, 8) == [7, 5, 0, 1, 2, 3, 7, 5]
    assert lookup.propose([4, 1, 2, 1, 2, 1], 5) == [2, 1, 2, 1, 2]
    assert lookup.propose([1, 2, 3, 4], 3) == [] and lookup.propose([7], 3) == []
    assert lookup.propose(ids, 0) == []
    # a 1-token match is too short
    assert PromptLookup(max_n=2, min_n=2).propose([1, 2, 9, 5, 2], 2) == []


def test_prompt_lookup_keeps_its_index_as_the_context_grows_and_restarts_on_a_new_one():
    """One PromptLookup over growing contexts (a request's steps: 1 to 4 tokens more each), and
    now and then another context (a new request), proposes what a search of the whole context
    for the latest longest match proposes, at every call."""
    def search(ids, k, max_n=3):
        for n in range(min(max_n, len(ids) - 1), 0, -1):
            starts = [i for i in range(len(ids) - n) if ids[i:i + n] == ids[len(ids) - n:]]
            if starts:
                start, out = starts[-1] + n, []
                while len(out) < k:
                    out.append(ids[start + len(out)] if start + len(out) < len(ids)
                               else out[len(out) - (len(ids) - start)])
                return out
        return []

    rng, lookup, calls, hits = np.random.default_rng(0), PromptLookup(), 0, 0
    for _ in range(60):
        ids, L = rng.integers(0, 6, 70).tolist(), 1
        while L < len(ids):
            k = int(rng.integers(1, 9))
            got = lookup.propose(ids[:L], k)
            assert got == search(ids[:L], k), (ids[:L], k)
            calls, hits, L = calls + 1, hits + bool(got), L + int(rng.integers(1, 5))
    assert calls > 1000 and hits > calls // 2


# ------------------------------------------------------------------ greedy: token for token

@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("kernels", ["plain", "fast"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("source", ["ngram", "draft model"])
def test_greedy_output_is_plain_greedy_token_for_token(family, kernels, fmt, source, prompts):
    kw = dict(quant=fmt, max_ctx=MAX_CTX, progress=False, kernels=kernels_or_skip(kernels))
    folder = folder_for(family)
    other = "int4" if fmt == "int8" else "int8"
    # the drafts succeed: prompt lookup in the model's own loops, or the same weights in the other
    # format (under penalties, which it applies too: they then decide tokens inside a step); they
    # fail: prompt lookup under penalties that break the loops, or a draft model of other weights
    penalties = dict(presence_penalty=0.5, repetition_penalty=1.3)
    cases = [("succeed", penalties if source == "draft model" else {},
              DraftModel(folder, **dict(kw, quant=other))),
             ("fail", penalties if source == "ngram" else {},
              DraftModel(folder_for(family, seed=1), **kw))]
    prompt = prompts[family]["own"]
    # fresh engines: each prefills the whole prompt in one step
    for name, params, draft in cases:
        plain = LLMEngine(folder, **kw)
        spec = SpeculativeEngine(folder, draft=draft if source == "draft model" else None, **kw)
        # every verify length on the decode kernels, T = 2..7
        lengths = itertools.cycle(range(1, 7))
        spec.length.choose = lambda room: min(next(lengths), room)
        want, _ = plain_greedy(plain, prompt, 40, **params)
        got = run(spec, prompt, 40, **params)
        assert got == want, (name, spec.last_speculation)
        s = spec.last_speculation
        # the first token comes from the prefill
        assert s.tokens == 39 and s.drafted > 0, s
        if name == "succeed":
            assert s.accepted >= 0.2 * s.drafted and s.tokens >= 1.5 * s.steps, s
        else:
            assert s.accepted < 0.1 * s.drafted, s
    # the cache holds exactly what plain decoding fed: the same ids, the same K/V, bit for bit
    n = len(plain.cached_ids)
    assert spec.cached_ids == plain.cached_ids == prompt + want[:-1]
    assert np.array_equal(spec.model.cache.data[:, :, :, :n], plain.model.cache.data[:, :, :, :n])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("kernels,fmt", [("plain", "int8"), ("fast", "int8"), ("fast", "int4")])
def test_long_drafts_on_the_prefill_path_differ_only_at_near_ties(family, kernels, fmt, prompts):
    """--draft-tokens 10: verify steps of up to 11 tokens, on the prefill path from 9 on."""
    kw = dict(quant=fmt, max_ctx=MAX_CTX, progress=False, kernels=kernels_or_skip(kernels))
    plain = LLMEngine(folder_for(family), **kw)
    spec = SpeculativeEngine(folder_for(family), draft_tokens=10, **kw)
    # always the longest drafts: the prefill path
    spec.length.choose = lambda room: min(10, room)
    steps, forward = [], spec.model.forward
    spec.model.forward = lambda tokens, *a, **k: (steps.append(len(tokens)),
                                                  forward(tokens, *a, **k))[1]
    reports = []
    for name in ("own", "random"):
        prompt = prompts[family][name]
        want, rows = plain_greedy(plain, prompt, 48)
        got = run(spec, prompt, 48)
        reports.append(compare_greedy(want, rows, got, prompt, PREFILL_BOUND[kernels], {}))
        assert max(steps) >= 9, "no verify step reached the prefill path"
    print(family, kernels, fmt, reports)


# ------------------------------------------------------------------ sampling

def test_seeded_sampling_with_prompt_lookup_draws_plain_samplings_tokens(prompts):
    """A draft picked without chance is checked by plain sampling's own draw: the same seed gives
    the same tokens as plain decoding, with every filter and penalty."""
    folder = folder_for("qwen3")
    # a low temperature, so that the draws follow the model's loops now and then, and drafts
    # are kept
    params = dict(temperature=0.2, top_k=40, top_p=0.95, min_p=0.05, presence_penalty=0.05, seed=11)
    plain = LLMEngine(folder, max_ctx=MAX_CTX, progress=False, kernels="plain")
    spec = SpeculativeEngine(folder, max_ctx=MAX_CTX, progress=False, kernels="plain")
    prompt = prompts["qwen3"]["own"]
    want = run(plain, prompt, 48, **params)
    assert run(spec, prompt, 48, **params) == want and len(set(want)) > 8
    assert spec.last_speculation.accepted > 0
    assert run(plain, prompt, 48, **dict(params, seed=12)) != want


def naive_rule(p, q, x, rng):
    """Accept when a token drawn from p equals the draft; on a mismatch draw from max(0, p - q)."""
    if int(rng.choice(len(p), p=p)) == x:
        return True, x
    residual = np.maximum(p - q, 0.0)
    return False, int(rng.choice(len(p), p=residual / residual.sum()))


V_SMALL, RUNS = 8, 500
SAMPLING = dict(temperature=1.0, top_k=5, presence_penalty=0.4)


@pytest.fixture(scope="module")
def small_vocab():
    """A model and a draft model (other weights) over 8 tokens, and the exact distribution of the
    first three sampled tokens [V, V, V] after a prompt, from the model's own logits."""
    folder = make_model("qwen3", vocab_size=V_SMALL, seed=2)
    draft_folder = make_model("qwen3", vocab_size=V_SMALL, seed=3)
    prompt = [3, 5, 1, 6, 4]
    model = build_model(LLMEngine(folder, progress=False, kernels="plain").weights, 64)
    params = SamplingParams(**SAMPLING)
    joint = np.zeros((V_SMALL,) * 3)

    def p_next(out):
        return speculative.probs(model.forward(np.array(prompt + out), 0), params, prompt, out)
    p1 = p_next([])
    for a in np.flatnonzero(p1):
        p2 = p_next([int(a)])
        for b in np.flatnonzero(p2):
            joint[a, b] = p1[a] * p2[b] * p_next([int(a), int(b)])
    return folder, draft_folder, prompt, joint


def sample_counts(small_vocab, rule, monkeypatch) -> tuple[np.ndarray, SpeculationStats]:
    """RUNS seeded requests of 4 tokens, every verify step with 2 drafts drawn from the draft model
    -> counts of the first three tokens [V, V, V], and the drafts' stats."""
    folder, draft_folder, prompt, _ = small_vocab
    monkeypatch.setattr(speculative, "accept_draft", rule)
    kw = dict(max_ctx=64, progress=False, kernels="plain")
    engine = SpeculativeEngine(folder, draft=DraftModel(draft_folder, **kw), draft_tokens=2, **kw)
    engine.length.choose = lambda room: min(2, room)
    counts, total = np.zeros((V_SMALL,) * 3, dtype=np.int64), SpeculationStats()
    for seed in range(RUNS):
        out = run(engine, prompt, 4, rid=f"s{seed}", **SAMPLING, seed=seed)
        counts[tuple(out[:3])] += 1
        total += engine.last_speculation
    return counts, total


@pytest.mark.timeout(900)
def test_speculative_sampling_keeps_the_distribution_and_the_naive_rule_does_not(small_vocab,
                                                                                 monkeypatch):
    """The first three tokens of 500 seeded runs, each verify step drafting 2 tokens from a draft
    model of other weights (q is not one-hot), against the model's exact joint distribution:
    Pearson's chi-square at P_FAIL = 1e-6 (a right rule fails for one seed set in a million).
    The standard rule passes; accepting when a draw from p equals the draft does not."""
    joint = small_vocab[3]
    counts, stats = sample_counts(small_vocab, speculative.accept_draft, monkeypatch)
    assert counts[joint == 0].sum() == 0                       # nothing top-k drops is ever made
    p_value, df = chi_square_p(counts, joint)
    assert df >= 20 and p_value > P_FAIL, (p_value, df)
    assert 0.2 < stats.accepted / stats.drafted < 0.9, stats   # drafts are both kept and replaced
    counts, _ = sample_counts(small_vocab, naive_rule, monkeypatch)
    p_naive, _ = chi_square_p(counts, joint)
    assert p_naive < P_FAIL, p_naive
    print(f"standard rule: p = {p_value:.3f} over {df + 1} cells; naive rule: p = {p_naive:.1e}")


# ------------------------------------------------------------------ the engine around it

def test_draft_length_follows_what_pays():
    """More drafts after acceptances, fewer after rejections, none while they do not pay; a verify
    step here costs 10 ms plus 1 ms a token (the bytes of one token, the compute of T)."""
    length = speculative.DraftLength(6)
    cost = lambda T: 0.010 + 0.001 * (T - 1)                      # noqa: E731
    assert length.choose(10) == 0                                  # plain decoding's cost first ...
    # (the first forward compiles: not counted)
    length.update(1, 5.0, 0, 0, 0.0)
    assert length.choose(10) == 0 and 1 not in length.cost
    length.update(1, cost(1), 0, 0, 0.0)
    # ... then drafts, doubling while they pay
    seen = [length.choose(10)]
    for _ in range(4):
        # every draft kept
        length.update(seen[-1] + 1, cost(seen[-1] + 1), seen[-1], seen[-1], 0.0)
        seen.append(length.choose(10))
    assert seen == [1, 3, 6, 6, 6], seen
    assert length.choose(3) == 3                                   # never more than fit
    for _ in range(8):
        length.update(7, cost(7), 6, 1, 0.0)                       # one of six kept
    assert 0 < length.choose(10) < 6
    for _ in range(16):
        # none kept (one in ten would pay for T = 2)
        length.update(2, cost(2), 1, 0, 0.0)
    # (plain decoding, timed again meanwhile)
    length.update(1, cost(1), 0, 0, 0.0)
    assert length.choose(10) == 0
    for _ in range(8):
        # prompt lookup would have guessed right
        length.observe(True)
    assert length.choose(10) > 0
    for _ in range(16):
        length.update(2, cost(2), 1, 0, 0.0)
    length.update(1, cost(1), 0, 0, 0.0)
    # a new text: the prior chance again
    length.new_request()
    assert length.choose(10) > 0
    # a draft model as slow as the model
    slow = speculative.DraftLength(6)
    for T in (1, 1, 2, 3, 5, 7):
        slow.update(T, cost(T), T - 1, (T - 1) * 3 // 4, 0.010 * (T - 1))
    assert slow.choose(10) == 0


def test_drafts_must_promise_a_tenth_more_than_plain_decoding():
    """A draft pays when its expected tokens per second beat plain decoding's by DraftLength.GAIN:
    at a step of 2 costing 1.15 steps, 21 % acceptance promises 5 % more (an estimate that one
    lucky guess can make) and plain decoding goes on; 50 % promises 30 % more, and it drafts."""
    length = speculative.DraftLength(1)
    for T, s in ((1, 5.0), (1, 0.010), (2, 0.0115)):     # the first forward: a warm-up
        length.update(T, s, T - 1, 0, 0.0)
    length.acc, length.rej = 0.21, 0.79
    assert length.speed(1) > length.speed(0) and length.choose(10) == 0
    length.acc, length.rej = 0.5, 0.5
    assert length.choose(10) == 1


def simulate(cost, accept, steps=600, k_max=6, seed=0, noise=0.0):
    """A request of `steps` steps driven by DraftLength, on a planted machine: cost(T, i) the
    seconds of a step of T tokens at step i, each draft kept with probability accept(i) (prompt
    lookup: the next token is checked against a guess when not drafting) -> (tokens per second, the
    same for plain decoding over the same steps, tokens per second from step 200 on, plain's
    there)."""
    rng = np.random.default_rng(seed)
    length = speculative.DraftLength(k_max)
    made = seconds = plain_s = 0.0
    half_made = half_s = half_plain = 0.0
    for i in range(steps):
        k = length.choose(1000)
        kept = 0
        while kept < k and rng.random() < accept(i):
            kept += 1
        s = cost(k + 1, i) * (1 + noise * rng.uniform(-1, 1))
        length.update(k + 1, s, k, kept, 0.0)
        if k == 0:
            length.observe(bool(rng.random() < accept(i)))
        made, seconds, plain_s = made + kept + 1, seconds + s, plain_s + cost(1, i)
        if i >= 200:
            half_made, half_s = half_made + kept + 1, half_s + s
            half_plain += cost(1, i)
    return made / seconds, steps / plain_s, half_made / half_s, (steps - 200) / half_plain


@pytest.mark.parametrize("noise", [0.0, 0.3])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_drafting_never_loses_to_plain_decoding(noise, seed):
    """Planted machines, step by step (noise: each step +-30 % at random, as on a busy machine):
    - verify steps slower than the tokens they bring (a draft costs 1.5 steps; 15 % accepted, what
      the busy laptop saw): within 3 % of plain decoding, having stopped drafting;
    - verify steps nearly free (the one-region step of T tokens) and 83 % accepted: well
      above plain;
    - a third of the way in, the machine gets busy (another program takes a core: a step of one
      token costs twice as much, a draft 0.6 of those) and the text stops repeating (15 %
      accepted): after it, within 3 % of plain's (7 % with the noise, 94-99 % over these seeds:
      both estimates change at once, and the steps that find it out are noisy too);
    - the machine frees up: drafting comes back, well above plain's after it."""
    slow = lambda T, i: 0.01 * (1 + 1.5 * (T - 1))                         # noqa: E731
    cheap = lambda T, i: 0.01 * (1 + 0.05 * (T - 1))                       # noqa: E731
    busy_later = lambda T, i: cheap(T, i) if i < 200 else 0.02 * (1 + 0.6 * (T - 1))   # noqa: E731
    free_later = lambda T, i: slow(T, i) if i < 200 else cheap(T, i)      # noqa: E731
    kw = dict(noise=noise, seed=seed)
    speed, plain, _, _ = simulate(slow, lambda i: 0.15, **kw)
    assert speed >= 0.97 * plain, (speed, plain)
    speed, plain, _, _ = simulate(cheap, lambda i: 0.83, **kw)
    assert speed >= 2.5 * plain, (speed, plain)
    _, _, after, plain_after = simulate(busy_later, lambda i: 0.83 if i < 200 else 0.15, **kw)
    assert after >= (0.97 if noise == 0 else 0.93) * plain_after, (after, plain_after)
    _, _, after, plain_after = simulate(free_later, lambda i: 0.83, **kw)
    assert after >= 2.0 * plain_after, (after, plain_after)


def planted_clock(monkeypatch, cost):
    """A plain engine, and a speculative one whose clock (speculative.time.perf_counter) moves
    only by cost(T) seconds per forward of T tokens -> (plain, speculative, the clock [seconds])."""
    folder = folder_for("qwen3")
    kw = dict(max_ctx=MAX_CTX, progress=False, kernels="plain")
    plain, spec = LLMEngine(folder, **kw), SpeculativeEngine(folder, **kw)
    clock = [0.0]
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: clock[0])
    forward = spec.model.forward

    def timed(tokens, pos, all_logits=False):
        clock[0] += cost(len(tokens))
        return forward(tokens, pos, all_logits=all_logits)
    monkeypatch.setattr(spec.model, "forward", timed)
    return plain, spec, clock


def test_the_engine_times_its_verify_steps_and_stops_drafting_where_they_do_not_pay(monkeypatch,
                                                                                    prompts):
    """The engine's own timing feeds DraftLength: a planted clock makes every verify step of T > 1
    tokens cost 3 steps of one. The request's clock time per token ends within 3 % of plain
    decoding's (the few steps that try drafting again included), and its tokens are plain's."""
    # the planted cost of a step
    plain, spec, clock = planted_clock(monkeypatch, lambda T: 0.010 if T == 1 else 0.030)
    prompt = prompts["qwen3"]["own"]
    want, _ = plain_greedy(plain, prompt, 200)
    clock[0] = 0.0
    assert run(spec, prompt, 200) == want
    s = spec.last_speculation
    # the prefill made the first token; each later step costs its planted time
    assert clock[0] - 0.030 <= 1.03 * 0.010 * (s.tokens), (clock[0], s)
    assert s.drafted > 0, "it never tried drafting"


def test_the_engine_times_its_steps_before_the_first_request_and_drafts_from_the_first_step(
        monkeypatch, prompts):
    """Before its first request the engine times steps of 1, 2, 4 and 8 tokens (a planted clock:
    T tokens cost 10 ms + 1 ms a token more), so that request's first verify step drafts already:
    without the timing its first steps would be plain, as DraftLength grows from what it has
    measured. The tokens stay plain greedy's."""
    plain, spec, _ = planted_clock(monkeypatch, lambda T: 0.010 + 0.001 * (T - 1))
    steps, update = [], spec.length.update
    monkeypatch.setattr(spec.length, "update",
                        lambda T, *a: steps.append((T, a[1])) or update(T, *a))
    assert spec.length.cost == {}
    prompt = prompts["qwen3"]["own"]
    assert run(spec, prompt, 60) == plain_greedy(plain, prompt, 60)[0]
    assert steps[0][1] > 0 and steps[0][0] > 1, steps[:3]     # (T, drafted): it drafted at once
    # the calibration's timings, then the request's own steps' running means
    assert {1, 2, 4, 8} <= set(spec.length.cost), spec.length.cost
    assert spec.length.cost[8] == pytest.approx(0.017)
    assert spec.length.cost[1] == pytest.approx(0.010)


def with_tokenizer():
    """A model with Qwen3's tokenizer, the one the other test files build (made once a session)."""
    return make_model("qwen3", tokenizer=True)


def test_a_draft_model_must_share_the_tokenizer(tmp_path):
    kw = dict(max_ctx=MAX_CTX, progress=False, kernels="plain")
    with pytest.raises(ValueError, match="vocabulary has 8 tokens, the model.s 512.*share the "
                                         "model.s tokenizer"):
        SpeculativeEngine(folder_for("qwen3"),
                          draft=DraftModel(make_model("qwen3", vocab_size=8), **kw), **kw)
    target = with_tokenizer()
    swapped = tmp_path / "swapped"
    shutil.copytree(target, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [k for k, v in vocab.items() if v in (300, 301)]
    vocab[a], vocab[b] = vocab[b], vocab[a]                    # two tokens trade ids
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    # what check_matches reads
    engine = SimpleNamespace(config=ModelConfig.from_folder(target), folder=target)
    with pytest.raises(ValueError, match="same ids to other tokens"):
        DraftModel(swapped, **kw).check_matches(engine)
    DraftModel(target, **kw).check_matches(engine)                    # the same tokenizer: fine


def test_the_options_build_it_and_refuse_bad_combinations(capsys):
    from stage1_cpu.generate import main
    folder = with_tokenizer()
    args = ["--model", str(folder), "--kernels", "plain", "--prompt", "Say something",
            "--max-tokens", "40", "--ignore-eos", "--temperature", "0"]
    assert main(args + ["--speculative", "ngram"]) == 0
    err = capsys.readouterr().err
    assert "speculative: prompt lookup" in err and "tokens/step" in err, err
    # drafts it makes for certain
    assert main(args + ["--draft-model", str(folder)]) == 0
    err = capsys.readouterr().err
    assert f"speculative: draft model {folder.name}" in err and "% of drafts accepted" in err, err
    assert main(args + ["--speculative", "ngram", "--draft-model", str(folder)]) == 2
    assert "choose one" in capsys.readouterr().err
    assert main(args + ["--speculative", "ngram", "--draft-tokens", "0"]) == 2
    assert "--draft-tokens must be a positive integer" in capsys.readouterr().err


def test_chat_and_server_show_the_stats(capsys):
    from common.chat import run_chat
    from common.chat_template import ChatTemplate
    from common.server import create_app
    from common.tokenizer import Tokenizer
    from test_server import LiveServer
    folder = with_tokenizer()
    tok, template = Tokenizer(folder), ChatTemplate.from_folder(folder)
    engine = SpeculativeEngine(folder, max_ctx=MAX_CTX, progress=False, kernels="plain")
    run_chat(engine, tok, template, SamplingParams(temperature=0.0), max_tokens=20,
             lines=["Hello there"])
    err = capsys.readouterr().err
    assert engine.last_speculation.line() in err and "tokens/step" in err, err

    server = LiveServer(create_app(engine, tok, template, "tiny", folder=folder, max_ctx=MAX_CTX))
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "one two three one "
                                                                       "two three one two",
                                                                "max_tokens": 16, "temperature": 0},
                       timeout=60)
        usage = r.json()["usage"]
        s = usage["speculative_decoding"]
        assert r.status_code == 200 and s["tokens"] == usage["completion_tokens"] - 1, usage
        assert s["steps"] >= 1 and s["drafted_tokens"] >= s["accepted_tokens"] >= 0, s
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_bench_runs_end_at_the_end_of_turn_and_time_the_decode_apart():
    """bench cpu --speculative's stage-1 run: a request ends as a user's does, on the model's end
    of turn (kept, as the engine's event keeps it), and its decode is timed after the first token
    (the prefill's step made it). A run that ignored the end of turn makes all 8 tokens."""
    engine = SpeculativeEngine(folder_for("qwen3"), max_ctx=MAX_CTX, progress=False,
                               kernels="plain")
    ids = np.random.default_rng(5).integers(3, 500, 16).tolist()
    eight = stage1_run(engine, ids, 8)
    assert len(eight["tokens"]) == 8 and 0 < eight["decode_seconds"] < eight["seconds"]
    engine.eos_ids = {eight["tokens"][2]} - set(eight["tokens"][:2])
    assert engine.eos_ids, "the third token also comes earlier: pick another prompt"
    assert stage1_run(engine, ids, 8)["tokens"] == eight["tokens"][:3]


def test_lookup_steps_counts_the_steps_prompt_lookup_would_take_on_a_text():
    """bench cpu --speculative's ceiling of drafting on plain's own text: the answer repeats the
    prompt, so its 4 tokens after the first are one step at k = 7 (the draft runs past the text's
    end); two at k = 2 (6 7, then 9 after the match of 6 7 8); a text with nothing to look up
    takes a step a token."""
    prompt = [5, 6, 7, 8, 9]
    assert lookup_steps(prompt, [5, 6, 7, 8, 9], 7) == 1
    assert lookup_steps(prompt, [5, 6, 7, 8, 9], 2) == 2
    assert lookup_steps([1, 2, 3], [4, 5, 6], 7) == 2
