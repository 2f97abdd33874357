"""python -m bench serve: streamed load on OpenAI-compatible servers, as vLLM's serving benchmark measures it
(a fixed concurrency or a Poisson rate -> requests/s, output tok/s, TTFT p50/p90/p99, TPOT p50/p99, ITL p99,
errors by kind, the server's peak RSS), and a soak of our batching servers. Saves JSON (docs/figures/serve_*.json;
`python -m bench report` writes docs/server.md's tables from it).

  --url URL [--model NAME]  one running server, at each --concurrency (or --rate)
  (default)                 stage 1's server and llama_cpp.server on one GGUF file, then stages 2 and 3 on their
                            CPU twins (a tiny Qwen3), each under each --omp-wait-policy: stage 1 / llama.cpp per figure
  --soak                    stages 2 and 3 on CPU, tiny qwen3 and qwen3_moe: 64 streaming clients, shared prefixes,
                            10 % leave mid-stream, 5 % malformed bodies, a page pool that forces preemption; every
                            answer checked against the same request asked alone; then the pages, the queue, the RSS
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.common import machine_description
from bench.report import SERVE, serve_table
from bench.testbed.serve_load import Server, drive, ours, rss_mib, soak, soak_ok, tiny
from common.models import resolve_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "figures"
# synthetic prompts: each word with its leading space one token below 8,192, so that tiny() takes them too
WORDS = "the a of time light house quick green model token seven under city water paper music".split()


def summary(recs: list[dict], wall: float) -> dict:
    """The run's figures (times in ms, percentiles as numpy's); None where there are no data."""
    ok = [r for r in recs if r["error"] is None]
    ms = lambda xs, p: float(np.percentile(xs, p)) * 1000 if xs else None    # noqa: E731
    ttft, itl = [r["ttft"] for r in ok if r["ttft"]], [x for r in ok for x in r["itl"]]
    tpot = [(r["latency"] - r["ttft"]) / (r["n"] - 1) for r in ok if r["n"] > 1 and r["ttft"]]
    return dict(requests=len(recs), completed=len(ok), req_s=len(ok) / wall, out_tok_s=sum(r["n"] for r in ok) / wall,
                ttft_p50=ms(ttft, 50), ttft_p90=ms(ttft, 90), ttft_p99=ms(ttft, 99), tpot_p50=ms(tpot, 50),
                tpot_p99=ms(tpot, 99), itl_p99=ms(itl, 99), errors=Counter(r["error"] for r in recs if r["error"]))


# ---------------------------------------------------------------- stage 1 against llama.cpp's server
FIGURES = ["req_s", "out_tok_s", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p99"]


def body(prompt: dict, model: str = "m", ignore_eos: bool = True) -> dict:
    """A greedy streamed completion; its usage chunk counts the tokens (a text chunk may hold several)."""
    return {"model": model, **prompt, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            **({"ignore_eos": True} if ignore_eos else {})}


def measure(cmd: list[str], prompts: list[dict], levels: list[int], policy: str) -> dict:
    """One server under one OpenMP policy: started, warmed up (2 requests), the prompts at each concurrency."""
    server = Server(cmd, policy, "/v1/models" if cmd[0] == "llama_cpp.server" else "/healthz")   # ours: loaded
    try:
        asyncio.run(drive(server.url, [(body(p), 0) for p in prompts[:2]]))
        runs = {str(c): summary(*asyncio.run(drive(server.url, [(body(p), 0) for p in prompts], c))) for c in levels}
        return {"policy": policy, "peak_rss_mib": rss_mib(server.proc.pid), **runs}
    finally:
        server.close()


def serving_rows(servers: dict[str, list[dict]], levels: list[int]) -> list[dict]:
    """Each server's figures at its best policy (the highest rate, the lowest time), then stage 1 ÷ llama.cpp:
    a rate's ratio stage 1 / llama.cpp, a time's llama.cpp / stage 1, so above 1 stage 1 is better either way."""
    best = lambda runs, c, k: (max if k.endswith("_s") else min)(   # noqa: E731
        [r[str(c)][k] for r in runs if r[str(c)][k] is not None] or [None])
    rows = [dict(server=name, clients=c, **{k: best(runs, c, k) for k in FIGURES}, peak_rss_mib=max(
        r["peak_rss_mib"] for r in runs), errors=sum(sum(r[str(c)]["errors"].values()) for r in runs))
        for name, runs in servers.items() for c in levels]
    s1, ll = servers.get("stage 1"), servers.get("llama.cpp")
    ratio = lambda a, b, k: a and b and (a / b) ** (1 if k.endswith("_s") else -1)   # noqa: E731
    return rows + [dict(server="stage 1 ÷ llama.cpp (above 1: stage 1 better)", clients=c, **{
        k: ratio(best(s1, c, k), best(ll, c, k), k) for k in FIGURES}) for c in (levels if s1 and ll else [])]


def meta(command: str) -> dict:
    return dict(machine=machine_description(), date=time.strftime("%Y-%m-%d"), command=command,
                load_1min=os.getloadavg()[0], threads=os.cpu_count())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--url", help="a running server (nothing is started)")
    add("--model", default="m", help="with --url: the name of the model it serves (default %(default)s)")
    add("--gguf", type=Path, help="stage 1's and llama.cpp's model (default: the default model's GGUF file)")
    add("--concurrency", default="1,4,16", help="clients at once, a run each (default %(default)s)")
    add("--rate", type=float, help="Poisson arrivals per second instead of a fixed concurrency")
    add("--requests", type=int, help="per run (default 32); --soak: per stage and model (default 1250)")
    add("--prompt-words", default="32,256", help="synthetic prompts: MIN,MAX words, seeded (default %(default)s)")
    add("--prompts", type=Path, help="a saved set instead: a JSON list of {prompt, max_tokens}")
    add("--max-tokens", type=int, default=64, help="synthetic prompts: tokens asked for (default %(default)s)")
    add("--omp-wait-policy", default="PASSIVE,default", help="each server under each (default %(default)s)")
    add("--soak", action="store_true", help="the soak of stages 2 and 3 (above)")
    add("--save", type=Path, help="where the JSON goes (default docs/figures/serve_compare.json or serve_soak.json; "
        "with --url: printed only)")
    args = ap.parse_args(argv)
    res = meta("python -m bench serve " + " ".join(sys.argv[1:] if argv is None else argv))
    rng, (lo, hi), levels = random.Random(0), map(int, args.prompt_words.split(",")), args.concurrency.split(",")
    prompts = json.loads(args.prompts.read_text()) if args.prompts else [{"prompt": "".join(
        " " + w for w in rng.choices(WORDS, k=rng.randint(lo, hi))), "max_tokens": args.max_tokens}
        for _ in range(args.requests or 32)]
    if args.url:                                 # any server: vLLM's, llama.cpp's, ours already running
        jobs = [(body(p, args.model, ignore_eos=False), 0) for p in prompts]
        res["rows"] = [dict(server=args.url, clients=c, **summary(*asyncio.run(drive(args.url, jobs, int(c),
                                                                                        args.rate)))) for c in levels]
    elif args.soak:
        tiny("qwen3"), tiny("qwen3_moe")          # written once, before the four runs at once (each its own server)
        with ThreadPoolExecutor(4) as pool:
            res["rows"] = list(pool.map(lambda sf: print(json.dumps(r := soak(*sf, args.requests or 1250))) or r, [
                (st, fam) for st in ("stage2_batched", "stage3_optimized") for fam in ("qwen3", "qwen3_moe")]))
        res["note"] = f"{sum(r['requests'] for r in res['rows'])} requests; " + (
            "every run passed" if all(map(soak_ok, res["rows"])) else "A RUN FAILED")
    else:
        import llama_cpp                                        # the peer (the bench extra)
        gguf, n = args.gguf or next(resolve_model(None).glob("*.gguf")), str(os.cpu_count())
        servers = {"stage 1": ours("stage1_cpu", gguf, "--max-ctx", "2048"),
                   "llama.cpp": ["llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", "PORT",
                                 "--model_alias", "m", "--n_ctx", "2048", "--n_threads", n, "--n_threads_batch", n,
                                 "--interrupt_requests", "False"],
                   "stage 2 (CPU twin, tiny Qwen3)": ours("stage2_batched", tiny(), "--max-ctx", "512"),
                   "stage 3 (CPU twin, tiny Qwen3)": ours("stage3_optimized", tiny(), "--max-ctx", "512")}
        res["runs"] = {name: [measure(cmd, prompts, [int(c) for c in levels], policy) for policy in
                              args.omp_wait_policy.split(",")] for name, cmd in servers.items()}
        res |= dict(gguf=str(gguf), peer_version=llama_cpp.__version__, rows=serving_rows(res["runs"], levels))
    print(serve_table(res))
    if args.url and not args.save:
        return 0
    save = args.save or RESULTS / SERVE["serve-soak" if args.soak else "serve-compare"][0]
    save.write_text(json.dumps(res, indent=1) + "\n")
    print(f"saved {save}; `python -m bench report` writes docs/server.md's table from it")
    return 0 if not args.soak or all(map(soak_ok, res["rows"])) else 1


if __name__ == "__main__":
    sys.exit(main())
