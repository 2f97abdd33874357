"""python -m stage3_optimized.serve / .generate / .chat on device="cpu": the common layer over
the stage-3 engine. The server reports prefix-cache hits in usage.prompt_tokens_details,
and its answers are those of a cache-off stage-3 engine (the cache changes no token)."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from bench.testbed.models import make_model
from common.engine import Request, TokenEvent
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}


def cache_off_greedy(folder, ids, steps):
    from stage3_optimized.engine import LLMEngine
    eng = LLMEngine(folder, max_ctx=256, slots=2, token_budget=64, page_size=16, num_pages=40,
                    device="cpu", progress=False, enable_prefix_caching=False)
    eng.add_request(
        Request("x", ids, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
    )
    out = []
    while eng.has_work():
        out += [ev.token_id for ev in eng.step()]
    return out


def test_serve_reports_cached_tokens_and_the_same_answers():
    folder = make_model("qwen3", tokenizer=True)
    proc = subprocess.Popen([sys.executable, "-m", "stage3_optimized.serve", "--model", str(folder),
                             "--device", "cpu", "--addr", "127.0.0.1:0", "--max-ctx", "256",
                             "--slots", "4", "--token-budget", "64", "--page-size", "16",
                             "--kv-memory", "0.05", "--served-model-name", "tiny",
                             "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=ENV)
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert m, line + (proc.stdout.read() if proc.poll() is not None else "")
        url = f"http://127.0.0.1:{m.group(1)}"
        deadline = time.time() + 120
        while httpx.get(url + "/healthz", timeout=60).status_code != 200:
            assert proc.poll() is None and time.time() < deadline, "the server did not come up"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        # 40 tokens: 2 full pages of 16
        system = [(11 * j) % 5000 + 100 for j in range(40)]
        first, second = system + [7, 8], system + [900, 901, 902]

        def complete(ids):
            r = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.usage, r.choices[0].text

        u1, t1 = complete(first)
        u2, t2 = complete(second)
        assert u1.prompt_tokens_details.cached_tokens == 0
        assert u2.prompt_tokens_details.cached_tokens == 32 and u2.prompt_tokens == 43
        tok = Tokenizer(folder)
        assert t1 == tok.decode(cache_off_greedy(folder, first, 5)) and t1
        assert t2 == tok.decode(cache_off_greedy(folder, second, 5)) and t2
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_generate_sends_n_copies_and_the_copies_hit_the_cache():
    folder = make_model("qwen3", tokenizer=True)
    r = subprocess.run([sys.executable, "-m", "stage3_optimized.generate", "--model", str(folder),
                        "--device", "cpu", "--raw",
                        "--prompt", "the quick brown fox jumps over the lazy dog " * 3,
                        "--max-tokens", "4", "--ignore-eos", "--temperature", "0", "--n", "3",
                        "--page-size", "4", "--kv-memory", "0.02", "--max-ctx", "128",
                        "--slots", "1"],
                       cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    m = re.search(
        r"\[3 x (\d+) prompt tokens \((\d+) from the prefix cache\), 12 generated", r.stderr
    )
    assert m, r.stderr
    n, cached = int(m.group(1)), int(m.group(2))
    # --slots 1: the copies run one after another, so copies 2 and 3 find the full pages
    assert cached == 2 * ((n - 1) // 4 * 4) and cached > 0
    assert r.stdout.strip()


def test_no_prefix_caching_flag_reaches_the_engine():
    from stage3_optimized import options
    ap = argparse.ArgumentParser()
    options.add_args(ap)
    ap.add_argument("--max-ctx", type=int, default=64)
    on, off = ap.parse_args([]), ap.parse_args(["--no-prefix-caching"])
    assert options.engine_kwargs(on)["enable_prefix_caching"] is True
    assert options.engine_kwargs(off)["enable_prefix_caching"] is False
    assert "no prefix cache" in options.describe(off)


def test_chat_help_lists_stage3_flags():
    r = subprocess.run([sys.executable, "-m", "stage3_optimized.chat", "--help"], cwd=ROOT,
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0 and "--no-prefix-caching" in r.stdout and "--page-size" in r.stdout


class _FailingEngine:
    """One token, then an "error" event (the engine could not sample: token -1)."""
    num_steps = 2

    def __init__(self, token):
        self.token, self.events, self.reqs = token, None, []

    def add_request(self, req):
        self.reqs.append(req.id)

    def has_work(self):
        return self.events is None or bool(self.events)

    def step(self):
        if self.events is None:
            self.events = [[TokenEvent(r, -1, "error") for r in self.reqs]]
            return [TokenEvent(r, self.token, None) for r in self.reqs]
        return self.events.pop()

    def num_cached_tokens(self, rid):
        return 0


def test_generate_says_an_engine_error_and_exits_1_in_stage1_and_stage3(monkeypatch, capsys):
    from common import generate as g1
    from stage3_optimized import generate as g3
    folder = make_model("qwen3", tokenizer=True)
    token = Tokenizer(folder).encode("hello")[0]
    text = Tokenizer(folder).decode([token])
    args = ["--model", str(folder), "--raw", "--prompt", "hi", "--max-tokens", "4"]
    monkeypatch.setattr(g3, "build_engine", lambda folder, a, progress: _FailingEngine(token))
    for run in (lambda: g1.main(lambda folder, a, progress: _FailingEngine(token), args),
                lambda: g3.main(args + ["--device", "cpu"])):
        assert run() == 1                          # not 0: the answer did not end by itself
        out, err = capsys.readouterr()
        assert out.strip() == text.strip()         # the token before the error, and no text for -1
        assert "error: the engine could not go on" in err
