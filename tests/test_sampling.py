"""common/sampling.py: the reference sampler every stage uses."""
import json

import numpy as np
import pytest

from common.sampling import SamplingParams, Sampler, apply_penalties, filter_logits

rng = np.random.default_rng(0)
LOGITS = rng.normal(size=64).astype(np.float32) * 3


def draws(params, n=3000):
    s = Sampler(params)
    return np.array([s(LOGITS, [], []) for _ in range(n)])


def test_greedy_is_argmax():
    assert Sampler(SamplingParams(temperature=0))(LOGITS, [], []) == int(np.argmax(LOGITS))


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    a = draws(SamplingParams(temperature=1.0, seed=7), 200)
    b = draws(SamplingParams(temperature=1.0, seed=7), 200)
    c = draws(SamplingParams(temperature=1.0, seed=8), 200)
    assert (a == b).all() and not (a == c).all()
    assert len(set(a.tolist())) > 5


def test_top_k_never_picks_outside_the_k_best():
    best = set(np.argsort(-LOGITS)[:5].tolist())
    picked = set(draws(SamplingParams(temperature=2.0, top_k=5, seed=1)).tolist())
    assert picked <= best and len(picked) == 5


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = np.exp(LOGITS - LOGITS.max())
    p /= p.sum()
    order = np.argsort(-p)
    cum = np.cumsum(p[order])
    allowed = set(order[: int(np.searchsorted(cum, 0.8) + 1)].tolist())
    picked = set(draws(SamplingParams(temperature=1.0, top_p=0.8, seed=2)).tolist())
    assert picked <= allowed and len(picked) >= max(1, len(allowed) - 1)


def test_min_p_drops_tokens_below_the_threshold():
    p = np.exp(LOGITS - LOGITS.max())
    p /= p.sum()
    allowed = set(np.nonzero(p >= 0.1 * p.max())[0].tolist())
    picked = set(draws(SamplingParams(temperature=1.0, min_p=0.1, seed=3)).tolist())
    assert picked <= allowed and len(picked) >= 2


def test_filters_mark_excluded_tokens_minus_inf():
    out = filter_logits(LOGITS, SamplingParams(temperature=0.5, top_k=3))
    assert np.isfinite(out).sum() == 3
    assert set(np.nonzero(np.isfinite(out))[0]) == set(np.argsort(-LOGITS)[:3].tolist())
    np.testing.assert_allclose(out[np.isfinite(out)], LOGITS[np.isfinite(out)] / 0.5, rtol=1e-6)


def test_penalties_change_logits_as_defined():
    logits = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    rep = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1])
    np.testing.assert_allclose(rep, [1.0, -4.0, 1.0, 0.5])       # positive / p, negative * p, unseen unchanged
    pf = apply_penalties(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                         prompt_ids=[2], output_ids=[0, 0, 3])
    np.testing.assert_allclose(pf, [2.0 - 0.5 - 0.5, -2.0, 1.0, 0.5 - 0.5 - 0.25])   # prompt tokens untouched


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-3),
                                 dict(min_p=2), dict(max_tokens=0), dict(presence_penalty=3),
                                 dict(repetition_penalty=0), dict(stop=[""])])
def test_invalid_params_are_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_generation_config_gives_defaults_and_requests_override(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    p = SamplingParams.from_generation_config(tmp_path, top_k=None, temperature=0.3)
    assert (p.temperature, p.top_p, p.top_k) == (0.3, 0.95, 20)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert SamplingParams.from_generation_config(tmp_path).temperature == 0.0
    with pytest.raises(TypeError, match="unknown sampling parameter"):
        SamplingParams.from_generation_config(tmp_path, temprature=1.0)
