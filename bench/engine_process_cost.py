"""What --engine-process costs per decode step: the engine in the server's process
against the same engine behind common/engine_process.py, interleaved A/B rounds.

    python -m bench.engine_process_cost stage1_cpu.serve 9                  # the default demo model
    python -m bench.engine_process_cost stage2_batched.serve 9 --model DIR --device cpu
    python -m bench.engine_process_cost null 9                              # no compute: the pipe alone

Each round times one 64-token answer on each (the median time between two of its tokens, as the
server's side receives them: an EngineLoop's sink, or EngineProcess's), alternating which goes first;
it prints the medians over the rounds, each round's difference (median, quartiles, range) and the load.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from common.engine import Request, TokenEvent
from common.engine_loop import EngineLoop
from common.engine_process import EngineProcess
from common.sampling import SamplingParams


class NullEngine:
    """One token per step, no compute: what is left is the boundary."""
    max_ctx = 1 << 20

    def __init__(self):
        self.running: dict[str, list[int]] = {}

    def add_request(self, req):
        self.running[req.id] = [req.params.max_tokens, 0]

    def abort(self, rid):
        self.running.pop(rid, None)

    def has_work(self):
        return bool(self.running)

    def step(self):
        out = []
        for rid, e in list(self.running.items()):
            e[1] += 1
            out.append(TokenEvent(rid, 100 + e[1], "length" if e[1] >= e[0] else None))
            if e[1] >= e[0]:
                del self.running[rid]
        return out


def build_null(folder, args):
    return NullEngine()


def decode_step_ms(loop, rid: str, steps: int) -> float:
    arrived, done = [], threading.Event()

    def sink(ev) -> None:
        arrived.append(time.perf_counter())
        if isinstance(ev, Exception) or ev.finish_reason is not None:
            done.set()

    loop.submit(Request(rid, [1, 450, 4996, 8253, 5389],
                        SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)), sink)
    done.wait()
    return statistics.median(b - a for a, b in zip(arrived, arrived[1:])) * 1000   # the first: after the prefill


def main() -> None:
    module, rounds, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    if module == "null":
        build, folder, args = build_null, None, None
    else:
        from common.models import resolve_model
        from common.serve_cli import add_server_args
        build = importlib.import_module(module).build_engine
        parser = argparse.ArgumentParser()
        add_server_args(parser)
        importlib.import_module(module.rsplit(".", 1)[0] + ".options").add_args(parser)
        args = parser.parse_args(argv)
        folder = Path(resolve_model(args.model))
    engines = {"in-process": EngineLoop(build(folder, args)), "engine-process": EngineProcess(build, folder, args)}
    steps = int(os.environ.get("STEPS", "64"))
    for name, engine in engines.items():
        decode_step_ms(engine, f"warm-{name}", steps)          # compiles and caches before timing
    got: dict[str, list[float]] = {name: [] for name in engines}
    loads = []
    for r in range(rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            got[name].append(decode_step_ms(engines[name], f"r{r}", steps))
        loads.append(os.getloadavg()[0])
    med = {name: statistics.median(v) for name, v in got.items()}
    for name, v in got.items():
        print(f"{name:15s} decode step median {med[name]:.3f} ms; rounds {[round(x, 3) for x in v]}")
    # each round's own difference: a load that changes between rounds moves both of its runs
    pairs = sorted((b / a - 1) * 100 for a, b in zip(got["in-process"], got["engine-process"]))
    print(f"the boundary: {(med['engine-process'] - med['in-process']) * 1000:+.0f} us per step = "
          f"{(med['engine-process'] / med['in-process'] - 1) * 100:+.2f} % (medians); per round: median "
          f"{statistics.median(pairs):+.2f} %, quartiles {pairs[len(pairs) // 4]:+.2f} .. "
          f"{pairs[(3 * len(pairs)) // 4]:+.2f} %, range {pairs[0]:+.2f} .. {pairs[-1]:+.2f} %")
    print(f"load average {min(loads):.1f}-{max(loads):.1f} (median {statistics.median(loads):.1f}) "
          f"on {os.cpu_count()} cores")
    for loop in engines.values():
        loop.stop()


if __name__ == "__main__":
    main()
