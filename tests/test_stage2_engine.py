"""Stage 2 on device="cpu": the batched, paged engine (running the numpy twins of the
CUDA kernels) produces transformers' greedy tokens, under chunked prefill, requests
arriving at different steps, preemption and aborts, and gives every page back."""
from __future__ import annotations

import numpy as np
import pytest

from bench.testbed.models import load_hf, make_model
from common.engine import Request
from common.sampling import SamplingParams
from stage2_batched.engine import LLMEngine

# prompt lengths around the page size 16: 1 token, one short of / exactly / one past a
# page, and a few hundred (chunked under a token budget of 64)
LENGTHS = [1, 2, 7, 15, 16, 17, 31, 33, 64, 90, 127, 150, 200, 257, 300, 333]
NEW_TOKENS = 8


@pytest.fixture(scope="module", autouse=True)
def one_blas_thread():
    """Tiny matmuls on a shared 2-core machine: OpenBLAS and torch threads only fight
    (measured here: 7 s -> 0.1 s for the 16-request run). Restored afterwards."""
    import ctypes
    import glob
    import os

    import torch
    lib, prev = None, None
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__) + ".libs", "libscipy_openblas*.so"))
    try:
        lib = ctypes.CDLL(libs[0])
        prev = lib.scipy_openblas_get_num_threads64_()
        lib.scipy_openblas_set_num_threads64_(1)
    except (IndexError, OSError, AttributeError):
        lib = None                       # another BLAS build: leave it as it is
    torch_prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(torch_prev)
    if lib is not None:
        lib.scipy_openblas_set_num_threads64_(prev)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def hf_reference(folder, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (one model load for all)."""
    import torch
    model = load_hf(folder)
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = model.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(ids):].tolist())
    return out


def make_prompts(lengths, vocab=512, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


_refs: dict = {}


def reference(family: str, lengths=tuple(LENGTHS), steps=NEW_TOKENS):
    key = (family, lengths, steps)
    if key not in _refs:
        folder = make_model(family)
        prompts = make_prompts(lengths)
        _refs[key] = (folder, prompts, hf_reference(folder, prompts, steps))
    return _refs[key]


def run(engine: LLMEngine, prompts, steps=NEW_TOKENS, arrive_every=1, on_step=None):
    """Add request i at step i * arrive_every; run until idle. -> ({id: tokens}, {id: finish})"""
    tokens = {str(i): [] for i in range(len(prompts))}
    finish = {}
    step = 0
    pending = list(enumerate(prompts))
    while pending or engine.has_work():
        while pending and pending[0][0] * arrive_every <= step:
            i, ids = pending.pop(0)
            engine.add_request(Request(str(i), ids, greedy(steps)))
        for ev in engine.step():
            if ev.token_id >= 0:
                tokens[ev.request_id].append(ev.token_id)
            if ev.finish_reason:
                assert ev.request_id not in finish, "a request finished twice"
                finish[ev.request_id] = ev.finish_reason
        if on_step:
            on_step(engine, step, tokens, finish)
        step += 1
        assert step < 5000, "the engine did not finish"
    return tokens, finish


def engine(family="qwen3", **kw) -> LLMEngine:
    args = dict(max_ctx=512, slots=16, token_budget=64, page_size=16, num_pages=256,
                device="cpu", progress=False)
    args.update(kw)
    return LLMEngine(make_model(family), **args)


def test_16_concurrent_requests_with_chunked_prefill_equal_transformers():
    folder, prompts, ref = reference("qwen3")
    eng = engine()
    # the budget of 64 tokens forces prompts over 64 tokens into several chunks
    budgets = []
    tokens, finish = run(eng, prompts, arrive_every=2,
                         on_step=lambda e, *_: budgets.append(e.num_prefill_tokens
                                                              + e.num_decode_tokens))
    assert max(np.diff([0] + budgets)) <= 64                   # the token budget held every step
    for i in range(len(prompts)):
        assert tokens[str(i)] == ref[i], f"request {i} (prompt of {len(prompts[i])} tokens) differs"
        assert finish[str(i)] == "length"
    assert eng.num_free_pages() == eng.num_total_pages()       # 0 pages leaked
    assert eng.num_preemptions == 0


def test_pool_too_small_preempts_and_results_stay_equal():
    folder, prompts, ref = reference("qwen3")
    # 40 pages of 16 = 640 positions for ~2000 prompt tokens: the scheduler must preempt
    eng = engine(num_pages=40, max_ctx=512)
    seen_full = []
    tokens, finish = run(eng, prompts, arrive_every=0,
                         on_step=lambda e, *_: seen_full.append(e.num_free_pages()))
    assert eng.num_preemptions > 0, "the test meant to exercise preemption"
    assert min(seen_full) < 40
    for i in range(len(prompts)):
        assert tokens[str(i)] == ref[i], f"request {i} differs after preemption"
    assert eng.num_free_pages() == eng.num_total_pages() == 40


def test_aborting_half_the_requests_frees_their_pages_at_once():
    folder, prompts, ref = reference("qwen3")
    eng = engine()
    # the 8 longest prompts: waiting, mid-prefill or decoding
    aborted = {str(i) for i in range(8, 16)}
    state = {}

    def on_step(e, step, tokens, finish):
        if step == 5:
            free_before = e.num_free_pages()
            owned = sum(len(s.block_table) for s in e.scheduler.running if s.id in aborted)
            assert owned > 0
            for rid in aborted:
                e.abort(rid)
            # freed at once, not at the next step
            assert e.num_free_pages() == free_before + owned
            state["aborted_at"] = {rid: len(tokens[rid]) for rid in aborted}
            e.abort("no-such-request")                              # unknown ids are ignored

    tokens, finish = run(eng, prompts, arrive_every=0, on_step=on_step)
    for i in range(16):
        rid = str(i)
        if rid in aborted:
            assert finish[rid] == "abort"
            assert len(tokens[rid]) == state["aborted_at"][rid]     # nothing after the abort
            assert tokens[rid] == ref[i][:len(tokens[rid])]
        else:
            assert finish[rid] == "length" and tokens[rid] == ref[i]
    assert eng.num_free_pages() == eng.num_total_pages()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_other_families_equal_transformers(family):
    lengths = (1, 17, 40, 129)
    folder, prompts, ref = reference(family, lengths)
    eng = engine(family, token_budget=32)
    tokens, _ = run(eng, prompts)
    for i in range(len(prompts)):
        assert tokens[str(i)] == ref[i], f"{family}: request {i} differs"
    assert eng.num_free_pages() == eng.num_total_pages()


def test_all_logits_of_a_packed_batch_equal_transformers():
    """The forward pass itself: two sequences' prompts in one packed batch, logits of
    every position close to transformers' (relative error). The logits are the caller's:
    they still hold after a second forward pass of as many tokens (which reuses every
    buffer of the model's Scratch) has run."""
    from bench.testbed.models import hf_logits
    from stage2_batched.batch import build_batch
    from stage2_batched.sequence import Sequence
    folder = make_model("qwen3")
    eng = engine()
    prompts = make_prompts((23, 40), seed=3)
    seqs = [Sequence.from_request(Request(str(i), p, greedy(1)), i) for i, p in enumerate(prompts)]
    for s in seqs:
        eng.block_manager.allocate(s, len(s.token_ids))
    ordered, tokens, batch = build_batch(seqs, [len(p) for p in prompts], 16)
    logits = eng.model.forward(tokens, batch, all_logits=True)         # [N, V]
    # a second step of the same N tokens: another prompt, in pages of its own
    other = Sequence.from_request(Request("other", make_prompts((63,), seed=4)[0], greedy(1)), 2)
    eng.block_manager.allocate(other, 63)
    _, other_tokens, other_batch = build_batch([other], [63], 16)
    other_logits = eng.model.forward(other_tokens, other_batch, all_logits=True)
    for (p, rows), got in [
        ((p, slice(batch.query_start[i], batch.query_start[i + 1])), logits)
        for i, p in enumerate(prompts)
    ] + [((other.token_ids, slice(None)), other_logits)]:
        ref = hf_logits(folder, p)
        err = np.abs(got[rows] - ref).max() / np.abs(ref).max()
        assert err < 1e-4, f"prompt of {len(p)} tokens: relative error {err}"


def test_stop_tokens_and_max_ctx_end_requests():
    folder, prompts, ref = reference("qwen3")
    eng = engine(max_ctx=40)
    # stop at the 3rd greedy token of prompt 2 (7 tokens); prompt 7 (33 tokens) hits max_ctx 40
    stop = ref[2][2]
    first = ref[2].index(stop)
    eng.add_request(Request("stop", prompts[2],
                            SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop],
                                           ignore_eos=True)))
    eng.add_request(Request("ctx", prompts[7], greedy(100)))
    out, fin = {"stop": [], "ctx": []}, {}
    while eng.has_work():
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
            if ev.finish_reason:
                fin[ev.request_id] = ev.finish_reason
    assert fin["stop"] == "stop" and out["stop"] == ref[2][:first + 1]
    assert fin["ctx"] == "length" and len(prompts[7]) + len(out["ctx"]) == 40
    assert out["ctx"] == ref[7][:len(out["ctx"])]
    assert eng.num_free_pages() == eng.num_total_pages()


def test_eos_stops_unless_ignore_eos():
    folder, prompts, ref = reference("qwen3")
    eng = engine()
    eos = ref[5][1]
    eng.eos_ids = {eos}                    # pretend the model's second token is its EOS
    eng.add_request(Request("a", prompts[5], SamplingParams(temperature=0, max_tokens=8)))
    eng.add_request(Request("b", prompts[5], greedy(8)))
    out, fin = {"a": [], "b": []}, {}
    while eng.has_work():
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
            fin[ev.request_id] = ev.finish_reason
    assert fin["a"] == "stop" and out["a"] == ref[5][:ref[5].index(eos) + 1]
    assert fin["b"] == "length" and out["b"] == ref[5]


def test_seeded_sampling_in_a_batch_equals_the_sampler_on_transformers_logits():
    """Non-greedy requests go through common/sampling.py's Sampler on the host, each with
    its own RNG: batched with other requests, a seeded request draws what the same Sampler
    draws from transformers' logits one token at a time."""
    from common.sampling import Sampler
    from bench.testbed.models import hf_logits
    folder, prompts, ref = reference("qwen3")
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.1,
                            seed=1234, max_tokens=6, ignore_eos=True)
    eng = engine()
    for i in (3, 8, 12):                                   # greedy neighbours in the same steps
        eng.add_request(Request(f"g{i}", prompts[i], greedy(6)))
    eng.add_request(Request("s", prompts[9], params))
    out = []
    while eng.has_work():
        out += [ev.token_id for ev in eng.step() if ev.request_id == "s"]
    sampler, expect = Sampler(params), []
    for _ in range(6):
        logits = hf_logits(folder, prompts[9] + expect)[-1]
        expect.append(sampler(logits, prompts[9], expect))
    assert out == expect
    assert eng.num_free_pages() == eng.num_total_pages()


def test_bad_requests_and_configs_get_clear_errors():
    eng = engine(max_ctx=64)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request(Request("e", [], greedy(1)))
    with pytest.raises(ValueError, match="max-ctx"):
        eng.add_request(Request("long", [5] * 64, greedy(1)))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request(Request("v", [10**6], greedy(1)))
    with pytest.raises(ValueError, match="pool"):
        engine(num_pages=3, max_ctx=64)                    # 64 positions need 4 pages of 16
    with pytest.raises(ValueError, match="token-budget"):
        engine(slots=16, token_budget=8)
    with pytest.raises(ValueError, match="device"):
        engine(device="tpu")
