"""python -m stage2_batched.serve end to end on device="cpu": the common server over the
batched engine answers concurrent clients, and each answer is transformers' greedy
continuation of its own prompt (batching changes nothing a client can see)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from bench.testbed.models import hf_greedy, make_model

ROOT = Path(__file__).resolve().parent.parent


def test_serve_answers_concurrent_clients_with_transformers_greedy_tokens():
    folder = make_model("qwen3", tokenizer=True)
    proc = subprocess.Popen([sys.executable, "-m", "stage2_batched.serve", "--model", str(folder),
                             "--device", "cpu", "--addr", "127.0.0.1:0", "--max-ctx", "256",
                             "--slots", "4", "--token-budget", "32", "--page-size", "16",
                             "--kv-memory", "0.05", "--served-model-name", "tiny",
                             "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT),
                                 "OPENBLAS_NUM_THREADS": "1"})
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
        # prompts of 5..60 tokens: with a budget of 32 the long ones are prefilled in chunks
        # while the short ones already decode, all in the same steps
        prompts = [
            [(7 * i + 13 * j) % 5000 + 100 for j in range(n)] for i, n in enumerate((5, 19, 33, 60))
        ]

        def complete(ids):
            r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
            return r.usage.completion_tokens, r.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
        from common.tokenizer import Tokenizer
        tok = Tokenizer(folder)
        for ids, (count, text) in zip(prompts, answers):
            assert count == 6
            assert text == tok.decode(hf_greedy(folder, ids, 6)) and text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
