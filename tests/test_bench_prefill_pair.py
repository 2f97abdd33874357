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


def test_rounds_pair_the_same_prompt_length_by_length_and_swap_who_goes_first(monkeypatch):
    calls = []

    class Stub:                       # stands in for a worker process: records each request
        def __init__(self, name, spec, policy, env_extra):
            self.name, self.isa, self.closed = name, name, False
            stubs.append(self)

        def prefill(self, length, seed):
            calls.append((self.name, length, seed))
            return 300.0 if self.name == "stage 1" else 200.0

        def close(self):
            self.closed = True

    stubs = []
    monkeypatch.setattr(prefill_pair, "Worker", Stub)
    monkeypatch.setattr(prefill_pair, "PAUSE_S", 0.0)
    args = prefill_pair.argparse.Namespace(threads=2, prompt_lens=[32, 128], rounds=2, activations="auto",
                                           stage1_policy="default", llama_policy="default", cpu_profile="native")
    shape = type("Shape", (), {"vocab_size": 512})()
    rows, isa = prefill_pair.run_format(args, "int8", {"hf": "hf", "Q8_0": "q8"}, shape, lambda line: None)
    who = [(name, length) for name, length, _ in calls]
    assert who == [("stage 1", 32), ("llama.cpp", 32), ("stage 1", 128), ("llama.cpp", 128),
                   ("llama.cpp", 32), ("stage 1", 32), ("llama.cpp", 128), ("stage 1", 128)]
    for r in range(2):                                         # both engines of a round: the same prompt
        for length in (32, 128):
            assert len({seed for _, n, seed in calls[4 * r:4 * r + 4] if n == length}) == 1
    assert len({seed for _, _, seed in calls}) == 4           # a fresh prompt per length and round
    assert [r["ratio"] for r in rows] == [1.5, 1.5] and [r["met"] for r in rows] == [2, 0]   # targets 1.0, 1.6
    assert all(s.closed for s in stubs) and isa == ["stage 1", "llama.cpp"]
