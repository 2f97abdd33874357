"""Our servers under load and faults, in subprocesses over loopback (bench/testbed/serve_load.py):

  * the soak: 64 streaming clients against stage 2 on CPU (a tiny qwen3), with shared prefixes,
    clients that leave mid-stream, malformed bodies and a page pool small enough to preempt: every
    answer equals the same request asked alone (and transformers' greedy tokens), no 5xx, every KV
    page back and the engine idle afterwards (`python -m bench serve --soak` is the long form, with
    stage 3 and a tiny qwen3_moe too);
  * crash drills: the engine child of --engine-process SIGKILLed mid-prefill, mid-stream and idle:
    the request in flight gets an error event within 1 s, /healthz says restarting then ok, the next
    answer is right, no zombie and no leaked descriptor; then the whole server killed mid-stream:
    the client's stream ends, no hang. QS_DRILLS=20 runs 20 drills and saves their times to
    docs/figures/serve_drills.json (`python -m bench report` writes docs/server.md's table);
  * bench serve's figures and tables, on made-up records.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import time
from pathlib import Path

import httpx
import pytest

from bench import serve as bench_serve
from bench.common import machine_description
from bench.testbed.models import hf_greedy
from bench.testbed.serve_load import Server, one, ours, soak, soak_ok, tiny
from common.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
DRILLS = int(os.environ.get("QS_DRILLS", "3"))


def test_soak_every_answer_equals_the_same_request_alone_no_5xx_no_page_leaked(capsys):
    # the suite's share; bench serve --soak adds stage 3 and MoE
    stage, family = "stage2_batched", "qwen3"
    r = soak(stage, family, requests=96)
    with capsys.disabled():
        print(f"\n[soak] {json.dumps(r)}")
    # every kind of client was there
    assert r["completed"] > 64 and r["left"] > 0 and r["http_4xx"] > 0
    assert r["wrong"] == r["http_5xx"] == 0 and not r["other_errors"], r
    assert r["preemptions"] > 0, "the page pool was large enough that nothing was preempted"
    assert r["idle"] and r["kv_pages_free"] == r["kv_pages"] == 32, r
    assert soak_ok(r), r
    # the reference itself: transformers' greedy tokens (fp32, as stage 2)
    prompt, n, text = r["sample"]
    assert text == Tokenizer(tiny(family)).decode(hf_greedy(tiny(family), prompt, n))


# ---------------------------------------------------------------- crash drills
def children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir()
            for c in (t / "children").read_text().split()]


def state(pid: int) -> str:
    """A process's state letter (Z: a zombie), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "gone"


def engine_child(server: Server) -> int:
    return next(c for c in children(server.proc.pid)
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())


async def ask(server: Server, prompt: list[int], max_tokens: int,
              streaming: asyncio.Event | None = None) -> dict:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        return await one(client, {"model": "m", "prompt": prompt, "max_tokens": max_tokens,
                                  "temperature": 0, "ignore_eos": True, "stream": True},
                         streaming=streaming)


async def drill(server: Server, mode: str, rng: random.Random, ref: tuple[list[int], str]) -> dict:
    """Kill the engine child mid-prefill (a 480-token prompt, prefilled 4 tokens a step), mid-stream
    or idle. Each kill waits for an event, not for a time, so that it lands where it should on any
    machine: mid-prefill as soon as the engine holds the request (120 steps of prefill ahead),
    mid-stream as soon as the first token arrives (399 ahead)."""
    child, ended = engine_child(server), []
    task = None
    if mode != "idle":
        long, streaming = mode == "prefill", asyncio.Event()
        prompt = [rng.randrange(100, 5000) for _ in range(480 if long else 8)]
        task = asyncio.ensure_future(ask(server, prompt, 4 if long else 400, streaming))
        # when its stream ended
        task.add_done_callback(lambda _: ended.append(time.perf_counter()))
        if long:        # until the request is in the engine
            while (await asyncio.to_thread(server.get)).get("idle", True):
                await asyncio.sleep(0.002)
        else:
            await asyncio.wait_for(streaming.wait(), 60)
    os.kill(child, signal.SIGKILL)
    killed, seen = time.perf_counter(), []
    while "restarting" not in seen or seen[-1] != "ok":          # /healthz: restarting, then ok
        await asyncio.sleep(0.01)
        seen.append((await asyncio.to_thread(server.get)).get("status"))
        assert time.perf_counter() - killed < 120, f"no restart seen: {seen[-5:]}"
        if seen[-1] == "ok" and time.perf_counter() - killed > 5:
            break                                                # restarting was never seen
    restart_s = time.perf_counter() - killed
    rec = await task if task else {"error": None, "ttft": None, "after": None}
    answer = await ask(server, *ref[0])
    return dict(mode=mode, phase="idle" if task is None else "prefill" if rec["ttft"] is None or
                rec["start"] + rec["ttft"] > killed else "stream", error=rec["error"],
                error_after_s=None if task is None else ended[0] - killed,
                saw_restarting="restarting" in seen, restart_s=restart_s,
                next_ok=answer["text"] == ref[1])


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_crash_drills_the_engine_child_and_the_whole_server(capsys):
    server = Server(ours("stage2_batched", tiny(), "--engine-process", "--max-ctx", "512",
                         "--slots", "4", "--token-budget", "4", "--page-size", "16",
                         "--kv-memory", "0.05"))
    rng = random.Random(0)
    try:
        prompt = [rng.randrange(100, 5000) for _ in range(12)]
        ref = ((prompt, 8), asyncio.run(ask(server, prompt, 8))["text"])
        assert ref[1]
        fds0, kids0 = fds(server.proc.pid), len(children(server.proc.pid))
        rows = [asyncio.run(drill(server, ("prefill", "stream", "idle")[i % 3], rng, ref))
                for i in range(DRILLS)]
        # closed connections may take a moment to close
        deadline = time.time() + 10
        while fds(server.proc.pid) != fds0 and time.time() < deadline:
            time.sleep(0.1)
        fds1, kids = fds(server.proc.pid), children(server.proc.pid)
        zombies = [c for c in kids if state(c) == "Z"]
        # the whole server, killed mid-stream: the client's stream ends (with an error), it does
        # not hang
        child = engine_child(server)

        async def kill_server():
            streaming = asyncio.Event()
            task = asyncio.ensure_future(ask(server, prompt, 400, streaming))
            await asyncio.wait_for(streaming.wait(), 60)         # its first token: 399 ahead
            server.proc.kill()
            killed = time.perf_counter()
            return await asyncio.wait_for(task, 10), time.perf_counter() - killed
        cut, cut_after = asyncio.run(kill_server())
        # its engine child sees the pipe close and exits
        deadline = time.time() + 10
        while state(child) not in ("gone", "Z") and time.time() < deadline:
            time.sleep(0.05)
        child_state = state(child)
    finally:
        server.close()
    restarts = [d["restart_s"] for d in rows]
    in_time = sum(d['error_after_s'] is None or d['error_after_s'] <= 1 for d in rows)
    note = (f"{in_time}/{len(rows)} in-flight requests got their error event within 1 s; "
            f"restart median {statistics.median(restarts):.2f} s, max {max(restarts):.2f} s; "
            f"file descriptors {fds0} before, {fds1} after; {len(zombies)} zombies; "
            f"killing the whole server mid-stream ended its stream ({cut['error']}) after "
            f"{cut_after:.2f} s, and its engine child exited ({child_state}). "
            "Engine: stage 2 on CPU, tiny Qwen3, --engine-process --slots 4 --token-budget 4.")
    with capsys.disabled():
        print(f"\n[drills] {note}")
    for d in rows:
        assert d["saw_restarting"] and d["next_ok"], d
        assert d["mode"] == "idle" or (
            d["error"] == "error event: server_error" and d["error_after_s"] <= 1.0
        ), d
    assert {d["phase"] for d in rows} == {"prefill", "stream", "idle"}, rows
    assert fds1 <= fds0 and not zombies and len(kids) == kids0, (fds0, fds1, kids, zombies)
    assert cut["error"] is not None and cut_after < 5, cut
    assert child_state in ("gone", "Z"), "the engine child outlived its server"
    if "QS_DRILLS" in os.environ:                 # a run that passed: its times for docs/server.md
        (ROOT / "docs" / "figures" / "serve_drills.json").write_text(json.dumps(dict(
            machine=machine_description(), date=time.strftime("%Y-%m-%d"),
            load_1min=os.getloadavg()[0],
            command=f"QS_DRILLS={DRILLS} python -m pytest tests/test_serve_faults.py -k drills",
            rows=rows, note=note), indent=1) + "\n")


# ---------------------------------------------------------------- bench serve's figures and tables
def rec(ttft: float, gaps: list[float], error: str | None = None) -> dict:
    return dict(
        error=error, ttft=ttft, itl=gaps, n=len(gaps) + 1, latency=ttft + sum(gaps), text="x"
    )


def test_summary_figures_are_the_percentiles_of_the_records():
    recs = [rec(0.1, [0.01, 0.03]), rec(0.3, [0.02]), rec(0.2, [0.05, 0.05, 0.05]),
            rec(9.0, [], error="HTTP 429")]
    s = bench_serve.summary(recs, wall=2.0)
    assert s["completed"] == 3 and s["req_s"] == 1.5 and s["out_tok_s"] == (3 + 2 + 4) / 2
    # 0.1 0.2 0.3, not the 9 s
    assert s["ttft_p50"] == pytest.approx(200) and s["ttft_p90"] == pytest.approx(280)
    # 20, 20, 50 ms a token
    assert s["tpot_p50"] == pytest.approx(20) and s["tpot_p99"] == pytest.approx(49.4)
    assert s["itl_p99"] == pytest.approx(50) and s["errors"] == {"HTTP 429": 1}


def test_serving_rows_take_each_figure_at_its_best_policy_and_ratios_favour_the_faster():
    run = lambda policy, tok_s, ttft: {"policy": policy, "peak_rss_mib": 100.0, "1": dict(   # noqa: E731
        {k: 1.0 for k in bench_serve.FIGURES}, out_tok_s=tok_s, ttft_p50=ttft, errors={})}
    rows = bench_serve.serving_rows({"stage 1": [run("PASSIVE", 50.0, 200.0),
                                                 run("default", 40.0, 100.0)],
                                     "llama.cpp": [run("PASSIVE", 25.0, 400.0),
                                                   run("default", 20.0, 300.0)]}, ["1"])
    # the best of each, not one policy's
    assert rows[0]["out_tok_s"] == 50.0 and rows[0]["ttft_p50"] == 100.0
    # 50 / 25; 300 ms / 100 ms
    assert rows[2]["out_tok_s"] == 2.0 and rows[2]["ttft_p50"] == 3.0
