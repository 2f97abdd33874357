"""A real server under load and faults, over loopback: a streaming OpenAI client that times every text chunk,
a server in a subprocess, and the soak. tests/test_serve_faults.py runs them briefly; `python -m bench serve`
(bench/serve.py) runs them long and against llama.cpp's server.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from common.config import ModelConfig
from common.tokenizer import Tokenizer

from .models import BF16_MARGIN, hf_on_bf16_weights, make_model

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the client
async def one(client: httpx.AsyncClient, body: dict | bytes, leave_after: int = 0,
              streaming: asyncio.Event | None = None) -> dict:
    """One streamed /v1/completions request -> its text, TTFT and the gaps between text chunks (s), tokens (the
    usage chunk's count, else text chunks), HTTP status, and error: None, "left" (after leave_after text chunks),
    "HTTP 4xx", an error event's type, a cut stream or an httpx error, with when it came
    ("after", s). `streaming` is set when the first text chunk arrives."""
    t0, last = time.perf_counter(), 0
    rec = dict(error=None, text="", itl=[], n=0, chunks=0, ttft=None, status=None, start=t0)
    try:
        async with client.stream("POST", "/v1/completions", **(
                {"content": body} if isinstance(body, bytes) else {"json": body})) as r:
            rec["status"], done = r.status_code, False
            if r.status_code != 200:
                return {**rec, "error": f"HTTP {r.status_code}", "body": (await r.aread())[:300]}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or (done := line == "data: [DONE]"):
                    continue
                obj, now = json.loads(line[6:]), time.perf_counter()
                if "error" in obj:
                    return {**rec, "error": f"error event: {obj['error'].get('type')}", "after": now - t0}
                rec["n"] = (obj.get("usage") or {}).get("completion_tokens", rec["n"])
                if text := "".join(c.get("text") or "" for c in obj.get("choices") or []):
                    rec["ttft"], rec["itl"] = rec["ttft"] or now - t0, rec["itl"] + ([now - last] if last else [])
                    rec["text"], rec["chunks"], last = rec["text"] + text, rec["chunks"] + 1, now
                    if streaming is not None:
                        streaming.set()
                    if rec["chunks"] == leave_after:
                        return {**rec, "error": "left"}     # leaving the block closes the connection
            if not done:
                return {**rec, "error": "stream cut", "after": time.perf_counter() - t0}
    except httpx.HTTPError as e:
        return {**rec, "error": type(e).__name__, "after": time.perf_counter() - t0}
    return {**rec, "n": rec["n"] or rec["chunks"], "latency": time.perf_counter() - t0}


async def drive(url: str, jobs: list, concurrency: int = 1, rate: float | None = None, seed: int = 0) -> tuple:
    """Send jobs ((body, leave_after) pairs), at most `concurrency` in flight, or as Poisson arrivals at `rate`
    per second (unbounded) -> (their records in job order, wall seconds)."""
    rng, sem = random.Random(seed), asyncio.Semaphore(len(jobs) + 1 if rate else concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30), limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=64)) as client:
        async def job(body, leave):
            async with sem:
                return await one(client, body, leave)
        t0, tasks = time.perf_counter(), []
        for body, leave in jobs:
            tasks.append(asyncio.create_task(job(body, leave)))
            await asyncio.sleep(rng.expovariate(rate) if rate else 0)
        return await asyncio.gather(*tasks), time.perf_counter() - t0


# ---------------------------------------------------------------- servers
def rss_mib(pid: int, field: str = "VmHWM") -> float:
    """A process's resident set now (VmRSS) or at its peak (VmHWM), in MiB."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


class Server:
    """`python -m CMD` on a free loopback port (PORT in CMD), ready once GET `ready` says 200; its output kept in a
    temporary file (`tail`), so a server that fails to start says why."""
    def __init__(self, cmd: list[str], policy: str = "PASSIVE", ready: str = "/healthz", timeout: float = 600):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "OPENBLAS_THREAD_TIMEOUT": "4", "PYTHONPATH": str(ROOT),
               "OMP_WAIT_POLICY": policy}
        if policy == "default":                      # unset, as users run it (bench policy_env)
            del env["OMP_WAIT_POLICY"]
        self.url, self.log, deadline = f"http://127.0.0.1:{port}", tempfile.TemporaryFile(), time.time() + timeout
        self.proc = subprocess.Popen([sys.executable, "-m", *(a.replace("PORT", str(port)) for a in cmd)], cwd=ROOT,
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        while (h := self.get(ready)).get("http") != 200:
            if self.proc.poll() is not None or time.time() > deadline or h.get("status") == "error":
                tail = self.tail
                self.close()
                raise RuntimeError(f"the server did not come up: {' '.join(cmd)}\n{tail}")
            time.sleep(0.1)

    def get(self, path: str = "/healthz") -> dict:
        """The JSON answer, with its status as "http" ({} when none came)."""
        try:
            r = httpx.get(self.url + path, timeout=5)
            return {**r.json(), "http": r.status_code}
        except (httpx.HTTPError, ValueError):
            return {}

    @property
    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-3000:]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def ours(stage: str, model: Path | str, *extra: str) -> list[str]:
    """Our server's command; stages 2 and 3 on their CPU twins."""
    return [f"{stage}.serve", "--model", str(model), "--addr", "127.0.0.1:PORT", "--served-model-name", "m",
            "--log-level", "warning", *(["--device", "cpu"] if stage != "stage1_cpu" else []), *extra]


def tiny(family: str = "qwen3") -> Path:
    """A tiny random model written by transformers (models.py), with the real Qwen3 tokenizer but the first 8,192
    of its ids: a step of 64 sequences then costs milliseconds, not the 151,936-column lm_head's second."""
    return make_model(family, tokenizer=True, vocab_size=8192)


# ---------------------------------------------------------------- the soak
MALFORMED = [b'{"model": "m", "prompt": [1, 2', b'{"model": "m", "prompt": "x", "max_tokens": "four"}', b"[]",
             b'{"model": "m", "prompt": [999999999], "max_tokens": 2}', b'{"model": "m", "max_tokens": 2}']


def soak(stage: str, family: str, requests: int, clients: int = 64, pages: int = 32, seed: int = 0) -> dict:
    """`requests` streamed greedy completions, `clients` at once, against a stage's server on CPU with a pool of
    `pages` KV pages of 16 positions (a few sequences' worth: the scheduler must preempt). Each answer is checked
    against the same request asked alone before (one left early: a prefix of it); then the pages and the RSS."""
    folder, rng = tiny(family), random.Random(seed)
    per_page = importlib.import_module(f"{stage}.kv_cache").KVCache.bytes_per_page(ModelConfig.from_folder(folder), 16)
    server = Server(ours(stage, folder, "--max-ctx", "128", "--slots", str(clients), "--token-budget", "128",
                         "--page-size", "16", "--kv-memory", f"{(pages + 0.5) * per_page / 2**30:.12f}"))
    try:
        heads = [[rng.randrange(100, 5000) for _ in range(40)] for _ in range(2)]      # two long shared prefixes
        pool = [{"model": "m", "prompt": (heads[i % 2] if i % 4 < 2 else []) + [rng.randrange(100, 5000) for _ in
                 range(rng.randint(3, 30))], "max_tokens": rng.randint(4, 16), "temperature": 0, "ignore_eos": True,
                 "stream": True} for i in range(32)]
        alone = asyncio.run(drive(server.url, [(b, 0) for b in pool]))[0]
        assert all(r["error"] is None and r["text"] for r in alone), [r["error"] for r in alone]
        asyncio.run(drive(server.url, [(b, 0) for b in pool], clients))                # warm-up
        rss0, pre0 = rss_mib(server.proc.pid, "VmRSS"), server.get()["preemptions"]
        kinds = rng.choices(["whole", "leaves", "malformed"], [85, 10, 5], k=requests)
        picks = [rng.randrange(len(pool)) for _ in kinds]
        recs, wall = asyncio.run(drive(server.url, [(rng.choice(MALFORMED), 0) if k == "malformed" else
                                                    (pool[i], rng.randint(1, 3) if k == "leaves" else 0)
                                                    for k, i in zip(kinds, picks)], clients))
        h, deadline = server.get(), time.time() + 60
        while not h.get("idle") and time.time() < deadline:                         # the last aborts land
            time.sleep(0.1)
            h = server.get()
        errors = Counter(r["error"] for r in recs if r["error"] and r["error"] != "left")
        wrong = [(i, r) for i, r in zip(picks, recs) if r["error"] in (None, "left") and not (       # a stream left
            r["text"] == alone[i]["text"] or r["error"] and alone[i]["text"].startswith(r["text"]))]  # early: a prefix
        hf = hf_on_bf16_weights(folder) if wrong and stage == "stage3_optimized" else None
        ties = {i: near_tie_text(hf, Tokenizer(folder), pool[i]["prompt"], pool[i]["max_tokens"])   # bf16: after a
                for i in {i for i, _ in wrong} if hf is not None}          # near-tie, a different answer is not wrong
        flips = [(i, r) for i, r in wrong if ties.get(i) is not None and r["text"].startswith(ties[i])
                 and alone[i]["text"].startswith(ties[i])]
        wrong = [w for w in wrong if w not in flips]
        return dict(stage=stage, family=family, requests=requests, clients=clients, req_s=requests / wall,
                    completed=sum(r["error"] is None for r in recs), left=sum(r["error"] == "left" for r in recs),
                    wrong=len(wrong), near_tie_flips=len(flips),
                    http_4xx=sum(n for e, n in errors.items() if e.startswith("HTTP 4")),
                    http_5xx=sum(n for e, n in errors.items() if e.startswith("HTTP 5") or "server_error" in e),
                    other_errors={e: n for e, n in errors.items() if not e.startswith("HTTP 4")}, idle=h.get("idle"),
                    kv_pages=h.get("kv_pages"), kv_pages_free=h.get("kv_pages_free"),
                    preemptions=h.get("preemptions", pre0) - pre0, rss_warm_mib=rss0,
                    rss_growth_pct=100 * (rss_mib(server.proc.pid, "VmRSS") / rss0 - 1),
                    sample=[pool[0]["prompt"], pool[0]["max_tokens"], alone[0]["text"]],   # transformers checks it
                    wrong_samples=[(pool[i]["prompt"], alone[i]["text"], r["text"]) for i, r in wrong[:3]])
    finally:
        server.close()


def near_tie_text(hf, tokenizer: Tokenizer, prompt: list[int], steps: int) -> str | None:
    """Stage 3 computes in bf16, so from a greedy step whose top-two margin is below BF16_MARGIN
    (hf: transformers on the bf16-rounded weights) either token is right -> the text before the
    first such step; None when all `steps` are clear (then only the one answer is right)."""
    import torch
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps,
                                              do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                              return_dict_in_generate=True)
    margins = [float(x) for x in (lg[0].topk(2).values[0] - lg[0].topk(2).values[1] for lg in out.logits)]
    tie = next((k for k, m in enumerate(margins) if m < BF16_MARGIN), None)
    return None if tie is None else tokenizer.decode(out.sequences[0, len(prompt):len(prompt) + tie].tolist())


def soak_ok(r: dict) -> bool:
    """The soak's pass: no wrong answer, no 5xx, no other error, the engine idle with every page free, preemption
    seen, the RSS within 5 % of what it was after the warm-up."""
    return (r["wrong"] == r["http_5xx"] == 0 and not r["other_errors"] and r["idle"] and r["preemptions"] > 0
            and r["kv_pages_free"] == r["kv_pages"] and r["rss_growth_pct"] < 5)
