"""bench/prefill_pair.py: the round-by-round ratios, and its worker's line protocol on a real engine."""
import math

import pytest
from models import make_model

from bench import prefill_pair


def test_summary_is_the_median_of_the_rounds_ratios_not_the_ratio_of_medians():
    # rounds' ratios 2.0, 1.5, 1.2: median 1.5; the medians' ratio would be 200 / 100 = 2.0
    s1 = {128: [200.0, 150.0, 300.0], 512: [90.0, 90.0, 90.0]}
    ll = {128: [100.0, 100.0, 250.0], 512: [60.0, 45.0, 100.0]}
    rows = prefill_pair.summarize(s1, ll, {128: 1.6, 512: 1.5})
    r128, r512 = rows
    assert (r128["len"], r128["stage1"], r128["llama"]) == (128, 200.0, 100.0)
    assert r128["ratio"] == pytest.approx(1.5) and (r128["lo"], r128["hi"]) == (pytest.approx(1.2), 2.0)
    assert (r128["met"], r128["rounds"], r128["target"]) == (1, 3, 1.6)
    assert r512["ratio"] == pytest.approx(1.5) and r512["met"] == 2          # 1.5, 2.0 >= 1.5; 0.9 not
    assert prefill_pair.summarize({32: [1.0]}, {32: [2.0]}, {})[0]["met"] is None   # no target, no verdict


def test_worker_answers_each_prompt_and_says_why_when_it_cannot_start(tmp_path):
    folder = make_model("qwen3")
    spec = {"engine": "stage1", "fmt": "int8", "path": str(folder), "vocab": 512, "max_ctx": 128, "threads": 1,
            "prompt_lens": [8, 20], "kernels": "plain", "activations": "fp32"}
    w = prefill_pair.Worker("stage 1", spec, "PASSIVE", {})
    try:
        assert "--kernels plain" in w.isa
        speeds = [w.prefill(8, seed=1), w.prefill(20, seed=2), w.prefill(20, seed=3)]
        assert all(math.isfinite(v) and v > 0 for v in speeds)
    finally:
        w.close()
    assert w.proc.returncode == 0
    bad = dict(spec, path=str(tmp_path / "no-such-model"))
    with pytest.raises(RuntimeError, match="exited"):
        prefill_pair.Worker("stage 1", bad, "PASSIVE", {})
