"""The stage-3 engine on device="cpu" (the numpy twins) against transformers, and its prefix cache.

The oracle is transformers in float32 on the *same bf16-rounded weights*: then the only
difference left is stage 3's bf16 activations and KV cache, which is what is measured.

Tolerance, and why. Each bf16 store rounds a value by at most 2^-9 (0.2 %) of itself;
a layer stores about seven activations (h, qkv, q/k/v after the norm and RoPE, the
attention output, wo's output, the SwiGLU product, the MLP output), so after a
two-layer model the logits carry a relative noise of about 0.5-1 % of their scale
(the roundings add like random errors; the residual stream itself is fp32). The test
allows 2.5 % of the largest |logit| at any position, and also requires the RMS error to
be within 2x of what transformers' own bf16 run has against the same fp32 oracle: our
bf16 may not be sloppier than the reference implementation's. It also requires the
error to be above 1e-4 of the scale, so a test that silently ran in fp32 fails.

Greedy tokens are compared step by step only while the oracle's top-two margin is
clear of the noise: above 0.2, twice the largest logit error seen (about 0.1), since
a flip needs one logit to move up and the other down. From the first near-tie on,
bf16 may legitimately pick the other token. Tiny random models have small margins,
so each family gets a prompt whose first five steps are clear (the test checks it).
"""
from __future__ import annotations

import numpy as np
import pytest

from bench.testbed.models import BF16_MARGIN, hf_on_bf16_weights, make_model
from common.engine import Request
from common.sampling import SamplingParams
from stage3_optimized.batch import build_batch
from stage3_optimized.engine import LLMEngine
from stage3_optimized.sequence import Sequence

FAMILIES = ["qwen3", "qwen3_moe", "llama", "qwen2", "qwen2_moe"]
PROMPT = [5, 9, 3, 17, 22, 100, 7, 8, 40, 41, 300, 12, 250]
GREEDY_PROMPTS = {"qwen3": PROMPT, "qwen3_moe": [1, 2, 3], "llama": PROMPT, "qwen2": PROMPT,
                  "qwen2_moe": [250, 12, 300]}


def engine(folder, **kw):
    args = dict(max_ctx=96, slots=4, token_budget=64, page_size=4, num_pages=80, device="cpu",
                progress=False)
    args.update(kw)
    return LLMEngine(folder, **args)


def all_logits(eng: LLMEngine, ids: list[int]) -> np.ndarray:
    """Logits of every position [T, V] from one prefill of the stage-3 model."""
    s = Sequence.from_request(Request("x", ids, SamplingParams(temperature=0)), 0)
    eng.block_manager.allocate(s, len(ids))
    seqs, tokens, info = build_batch([s], [len(ids)], eng.page_size)
    out = eng.model.forward(tokens, info, all_logits=True)
    eng.block_manager.free_pages(s)
    return out


def run(
    eng: LLMEngine, prompts: list[list[int]], steps: int, tag: str = ""
) -> dict[str, list[int]]:
    """Greedy, EOS ignored; request ids tag + index. -> {id: tokens}"""
    for i, p in enumerate(prompts):
        eng.add_request(
            Request(
                f"{tag}{i}", p, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
            )
        )
    out = {f"{tag}{i}": [] for i in range(len(prompts))}
    while eng.has_work():
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
    assert eng.num_free_pages() == eng.num_total_pages(), "a KV page leaked"
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_close_to_transformers_fp32_on_bf16_weights(family):
    import torch
    folder = make_model(family)
    got = all_logits(engine(folder), PROMPT)                          # [T, V] float32
    with torch.no_grad():
        ref = hf_on_bf16_weights(folder)(torch.tensor([PROMPT])).logits[0].numpy()
        ref_bf16 = (
            hf_on_bf16_weights(folder, "bfloat16")(torch.tensor([PROMPT])).logits[0].float().numpy()
        )
    scale = np.abs(ref).max()
    err = np.abs(got - ref)
    rms, rms_hf = np.sqrt(np.mean(err ** 2)), np.sqrt(np.mean((ref_bf16 - ref) ** 2))
    assert scale > 1.0                                                # real logits, not zeros
    assert err.max() <= 0.025 * scale, f"max error {err.max():.4f} vs scale {scale:.3f}"
    assert rms <= 2.0 * rms_hf, f"rms error {rms:.4f}, transformers' bf16 has {rms_hf:.4f}"
    assert err.max() > 1e-4 * scale, "no bf16 rounding at all: is the engine still fp32?"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers_until_a_near_tie(family):
    import torch
    folder = make_model(family)
    steps = 12
    hf = hf_on_bf16_weights(folder)
    prompt = GREEDY_PROMPTS[family]
    ids, expect, margins = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
            top2 = np.sort(logits)[-2:]
            margins.append(top2[1] - top2[0])
            expect.append(int(logits.argmax()))
            ids.append(expect[-1])
    # the tokens before the first near-tie
    clear = next((i for i, m in enumerate(margins) if m < BF16_MARGIN), steps)
    assert clear >= 5, f"the prompt gives a near-tie at step {clear}; choose another prompt"
    got = run(engine(folder), [prompt], steps)["0"]
    assert len(got) == steps
    # up to and including the first near-tie's own step the context is still the oracle's
    assert got[:clear] == expect[:clear], f"margins {np.round(margins, 3).tolist()}"


# ---- the prefix cache in the engine ----

def test_shared_prefix_gives_the_same_tokens_as_cache_off():
    folder = make_model("qwen3")
    system = list(range(30, 53))                                      # 23 tokens: 5 full pages of 4
    prompts = [system + [7, 8, 9], system + [60, 61], system + [70, 71, 72, 73, 74],
               system[:10] + [5]]
    off = engine(folder, enable_prefix_caching=False)
    expect = run(off, prompts, 6)
    on = engine(folder)
    first = run(on, prompts[:1], 6, tag="a")                          # fills the cache
    later = run(on, prompts[1:], 6, tag="b")                          # all three find pages of it
    assert first["a0"] == expect["0"]
    assert [later[f"b{i}"] for i in range(3)] == [expect["1"], expect["2"], expect["3"]]
    assert on.num_cached_tokens("a0") == 0 and off.num_cached_tokens("1") == 0
    assert on.num_cached_tokens("b0") == 20 and on.num_cached_tokens("b1") == 20   # 5 system pages
    # two full pages of system[:10]
    assert on.num_cached_tokens("b2") == 8
    assert on.prefix_cache_hit_rate() > 0.3


def test_full_hit_recomputes_the_last_page_and_answers_the_same():
    folder = make_model("llama")
    prompt = list(range(100, 116))                                   # 16 tokens: exactly 4 pages
    eng = engine(folder)
    first = run(eng, [prompt], 5, tag="a")["a0"]
    again = run(eng, [prompt], 5, tag="b")["b0"]
    assert again == first and len(first) == 5
    # 3 pages hit, the 4th recomputed
    assert eng.num_cached_tokens("b0") == 12
    # the first request's output pages are cached too: its prompt + output as a new prompt hits
    # 4 pages
    # 20 tokens: 5 pages, the 5th holds the last
    longer = prompt + first[:4]
    assert run(eng, [longer], 3, tag="c")["c0"] == run(engine(folder, enable_prefix_caching=False),
                                                        [longer], 3)["0"]
    assert eng.num_cached_tokens("c0") == 16


def test_eviction_under_memory_pressure_leaks_nothing_and_keeps_tokens():
    """A pool of 14 pages of 4 for 8 requests with three shared heads: cached pages are
    evicted and sequences preempted all the time; the tokens stay those of a cache-off run."""
    folder = make_model("qwen3_moe", mlp_only_layers=[1])
    rng = np.random.default_rng(3)
    heads = [rng.integers(3, 500, size=n).tolist() for n in (9, 13, 17)]
    prompts = [
        heads[i % 3] + rng.integers(3, 500, size=int(rng.integers(1, 6))).tolist() for i in range(8)
    ]
    kw = dict(num_pages=14, slots=3, token_budget=16, max_ctx=40)
    expect = run(engine(folder, enable_prefix_caching=False, **kw), prompts, 7)
    eng = engine(folder, **kw)
    got = run(eng, prompts, 7)
    assert got == expect
    assert eng.block_manager.num_hit_tokens > 0 and eng.num_preemptions > 0
    # cached pages survive the end ...
    assert eng.block_manager.cached_free
    assert sum(eng.block_manager.ref_count) == 0                      # ... held by nobody


def test_device_sampling_picks_the_host_samplers_tokens_for_a_seed():
    """Temperature / top-k / top-p rows go through kernels.sample (here its twin) with a uniform
    number from each request's own seeded generator; the host Sampler (stage 2's path) with the
    same seed must pick the same tokens. A penalty row stays on the host either way."""
    folder = make_model("qwen3")

    def run(device_sampling: bool):
        eng = engine(folder)
        eng.device_sampling = device_sampling
        params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=1, max_tokens=8,
                                 ignore_eos=True),
                  SamplingParams(temperature=1.2, seed=2, max_tokens=8, ignore_eos=True),
                  SamplingParams(temperature=0.7, top_p=0.5, seed=3, max_tokens=8, ignore_eos=True),
                  SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=4, max_tokens=8,
                                 ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
        for i, p in enumerate(params):
            eng.add_request(Request(str(i), PROMPT[: 5 + i], p))
        out = {str(i): [] for i in range(len(params))}
        while eng.has_work():
            for ev in eng.step():
                out[ev.request_id].append(ev.token_id)
        return out

    device, host = run(True), run(False)
    assert device == host
    greedy = run(True)["4"]
    # a real draw, not a repeated argmax
    assert device["4"] == greedy and len(set(device["1"])) > 3
