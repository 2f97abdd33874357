"""Prefill, stage 1 against llama.cpp, interleaved: one ratio per round instead of one per run.

`python -m bench cpu` measures each engine in its own process, one after the other, and this VM's
speed moves between those minutes: stage 1's int8 ÷ Q8_0 at 128 tokens came out anywhere from 1.54×
to 2.27× in four runs of the same code (docs/benchmarks.md). Here both engines stay loaded side by
side, each in its own worker process at its own wait policy, and the parent asks them in turn for
the same fresh prompt, length by length:

    round r:  p = 32: stage 1, then llama.cpp; p = 128: the same; p = 512: the same    r even
              each pair the other way round                                        r odd

with a pause before each prompt, so that the other engine's OpenMP threads have gone to sleep (under
the default or PASSIVE policy; ACTIVE never sleeps, so it is not offered). Each round gives a ratio
per length (stage 1's tok/s ÷ llama.cpp's on the same prompt, one prefill and a pause apart); the
report gives their median and range, how many rounds met the issue-28 target, and each engine's
median tok/s. A drift of the machine over minutes moves both engines of a round together, so it
leaves the ratio where it is. What it cannot remove: noise within a round's few seconds.

    python -m bench prefill-pair --formats int8,int4 --rounds 10
    python -m bench prefill-pair --cpu-profile avx2          # stage 1 under NUMBA_CPU_NAME=haswell,
                                                             # llama.cpp from bench/build_llama_avx2.sh
Prefill is timed as in bench cpu: the prompt's forward pass and the first token's pick
(Stage1Runner / LlamaCppRunner.generate with no decode). Models: bench cpu's cached Qwen3-0.6B-shape
folder and GGUF files (built on first use).
"""
from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import load_1min, machine_description, markdown_table, worker_env

PAUSE_S = 0.5            # before each prompt: an OpenMP runtime under its default policy spins a while, then sleeps
MAX_CTX = 1024           # each engine's context
WORKER_TIMEOUT_S = 900   # for one answer: loading and warming up a model, or one prefill


def serve(spec: dict) -> None:
    """The worker: load one engine, warm every length up, then answer one JSON line per request
    on stdin ({"len": p, "seed": s}) with the prefill's seconds, until stdin closes. The answers go
    to a copy of the original stdout; anything the engines print (Python or C) goes to stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from bench.cpu import make_runner, prompt_ids
    runner = make_runner(spec, spec["threads"])
    for p in spec["prompt_lens"]:                         # JIT, buffers, the weights' pages: not counted
        runner.generate(prompt_ids(spec["vocab"], p, seed=1 + p), 0)
    print(json.dumps({"ready": True, "isa": runner.isa()}), file=answers)
    for line in sys.stdin:
        req = json.loads(line)
        _, seconds, _ = runner.generate(prompt_ids(spec["vocab"], req["len"], seed=req["seed"]), 0)
        print(json.dumps({"s": seconds}), file=answers)


class Worker:
    """One engine in its own process (bench.common.worker_env: its wait policy, its CPU profile)."""

    def __init__(self, name: str, spec: dict, policy: str, env_extra: dict, timeout: float = WORKER_TIMEOUT_S):
        env, root = worker_env(policy, env_extra)
        self.name, self.timeout = name, timeout
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.prefill_pair", "--serve", json.dumps(spec)],
                                     env=env, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        try:
            self.isa = self._reply()["isa"]
        except BaseException:
            self.close()
            raise

    def _reply(self) -> dict:
        """The worker's next answer; it has self.timeout seconds (one line per request, so nothing
        waits in the pipe's buffer beyond the line select sees)."""
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            self.close()
            raise RuntimeError(f"{self.name}: no answer in {self.timeout:.0f} s; the worker was stopped")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the worker exited ({self.proc.wait()}) before answering")
        return json.loads(line)

    def prefill(self, length: int, seed: int) -> float:
        """tok/s of one prefill of a fresh prompt."""
        try:
            self.proc.stdin.write(json.dumps({"len": length, "seed": seed}) + "\n")
        except BrokenPipeError:
            pass                                    # it died: _reply says so, with its exit status
        return length / self._reply()["s"]

    def close(self) -> None:
        """End the worker: stdin closed, then a kill if it has not exited within 60 s."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def summarize(s1: dict[int, list[float]], ll: dict[int, list[float]], target: dict) -> list[dict]:
    """Per length: the rounds' ratios (stage 1 ÷ llama.cpp, round by round), their median and range,
    the rounds that met the target, and each engine's median tok/s."""
    rows = []
    for p, mine in s1.items():
        ratios = [a / b for a, b in zip(mine, ll[p], strict=True)]
        t = target.get(p)
        rows.append({"len": p, "stage1": statistics.median(mine), "llama": statistics.median(ll[p]),
                     "ratio": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios),
                     "met": None if t is None else sum(r >= t for r in ratios), "rounds": len(ratios),
                     "target": t})
    return rows


def run_format(args, fmt: str, paths: dict, shape, log) -> tuple[list[dict], list[str]]:
    from bench.cpu import LLAMA_FORMAT, PREFILL_TARGETS, profile_env
    base = {"vocab": shape.vocab_size, "max_ctx": MAX_CTX, "threads": args.threads, "prompt_lens": args.prompt_lens}
    s1 = Worker("stage 1", dict(base, engine="stage1", fmt=fmt, path=str(paths["hf"]), activations=args.activations),
                args.stage1_policy, profile_env(args, "stage1"))
    try:
        ll = Worker("llama.cpp", dict(base, engine="llama.cpp", fmt=LLAMA_FORMAT[fmt],
                                      path=str(paths[LLAMA_FORMAT[fmt]])), args.llama_policy,
                    profile_env(args, "llama.cpp"))
    except BaseException:
        s1.close()
        raise
    speeds = {w.name: {p: [] for p in args.prompt_lens} for w in (s1, ll)}
    try:
        for r in range(args.rounds):
            for p in args.prompt_lens:                   # the same prompt for both, one after the other
                for w in ((s1, ll) if r % 2 == 0 else (ll, s1)):
                    time.sleep(PAUSE_S)
                    speeds[w.name][p].append(w.prefill(p, seed=100_000 + 1000 * r + p))
            log(f"  {fmt} round {r + 1}: " + ", ".join(
                f"{p}: {speeds['stage 1'][p][-1] / speeds['llama.cpp'][p][-1]:.2f}x" for p in args.prompt_lens))
    finally:
        try:
            s1.close()
        finally:
            ll.close()
    return summarize(speeds["stage 1"], speeds["llama.cpp"], PREFILL_TARGETS.get(fmt, {})), [s1.isa, ll.isa]


def report(args, results: dict) -> str:
    from bench.cpu import LLAMA_FORMAT
    rows = []
    for fmt, (summary, _) in results.items():
        for s in summary:
            met = "" if s["target"] is None else f"{s['met']} of {s['rounds']} (≥ {s['target']:.1f}×)"
            rows.append([f"{fmt} ÷ {LLAMA_FORMAT[fmt]}", f"prefill {s['len']}", f"{s['stage1']:.1f}",
                         f"{s['llama']:.1f}", f"**{s['ratio']:.2f}×**", f"{s['lo']:.2f}-{s['hi']:.2f}×", met])
    acts = "" if args.activations == "auto" else f" (stage 1 with --activations {args.activations})"
    if args.cpu_profile == "avx2":
        acts += ", AVX2 machine stand-in"
    out = ["## Prefill, stage 1 ÷ llama.cpp, interleaved round by round" + acts, "",
           f"- machine: {machine_description()}",
           "- command: `python -m bench prefill-pair " + " ".join(args.argv) + "`",
           (f"- {args.threads} threads; stage 1 under OMP_WAIT_POLICY={args.stage1_policy}, llama.cpp under "
            f"{args.llama_policy}; {args.rounds} rounds, the order swapped every round, {PAUSE_S} s before each "
            f"prompt; 1-minute load before {args.load[0]:.2f}, after {args.load[1]:.2f} (with its own threads)"),
           *(f"- {fmt}: " + " | ".join(isa) for fmt, (_, isa) in results.items()), "",
           markdown_table(["formats", "what", "stage 1 tok/s (median)", "llama.cpp tok/s (median)",
                           "ratio (median of rounds)", "rounds' range", "rounds at the target"], rows), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from bench.cpu import add_cpu_profile_args

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m bench prefill-pair", description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="int8,int4", help="stage-1 formats (int8 -> Q8_0, int4 -> Q4_0)")
    ap.add_argument("--prompt-lens", default="32,128,512")
    ap.add_argument("--rounds", type=int, default=10, help="even: each engine goes first equally often")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activations", default="auto", choices=["auto", "int8", "fp32"], help="stage 1's --activations")
    ap.add_argument("--stage1-policy", default="default", choices=["default", "PASSIVE"])
    ap.add_argument("--llama-policy", default="default", choices=["default", "PASSIVE"])
    add_cpu_profile_args(ap)
    ap.add_argument("--save", type=Path, default=None, help="also write the report (markdown) here")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(json.loads(args.serve))
        return 0
    from bench.cpu import (
        CACHE,
        LLAMA_FORMAT,
        QWEN3_0_6B,
        choose_llama_lib,
        llama_cpp_installed,
        prepare_models,
    )

    args.argv = argv
    args.formats = [f for f in args.formats.split(",") if f]
    args.prompt_lens = [int(p) for p in args.prompt_lens.split(",")]
    if not args.formats or set(args.formats) - set(LLAMA_FORMAT) or args.rounds < 1 or \
            not all(1 <= p <= MAX_CTX - 1 for p in args.prompt_lens):
        ap.error(f"--formats: some of {','.join(LLAMA_FORMAT)}; --rounds: positive; --prompt-lens: 1 to {MAX_CTX - 1}")
    if not llama_cpp_installed():
        print("llama-cpp-python is not installed: pip install -e .[bench]", file=sys.stderr)
        return 2
    args.llama_lib = None
    if args.cpu_profile == "avx2":
        args.llama_lib, missing, _ = choose_llama_lib(args)
        if missing:
            print(missing, file=sys.stderr)
            return 2

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    paths = prepare_models(QWEN3_0_6B, CACHE, log, [LLAMA_FORMAT[f] for f in args.formats])
    load0 = load_1min()
    results = {fmt: run_format(args, fmt, paths, QWEN3_0_6B, log) for fmt in args.formats}
    args.load = (load0, load_1min())
    text = report(args, results)
    print(text)
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
