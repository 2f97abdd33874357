"""Where one stage-1 forward pass spends its time, op by op.

    OMP_WAIT_POLICY=PASSIVE python -m bench profile --quant int4 --threads 2            # decode
    OMP_WAIT_POLICY=PASSIVE python -m bench profile --quant bf16 --tokens 512           # prefill
    OMP_WAIT_POLICY=PASSIVE python -m bench profile --kernels plain --activations fp32  # the core's kernels
    python -m bench profile --quant int4 --tokens 512 --save docs/figures/stage1_prefill_profile.json

On bench cpu's Qwen3-0.6B-shape model (or --model): first what an empty parallel region
costs (what the one-region step saves once per op), then --steps forward passes after a
warm-up, every matmul (with its GB/s) and every op of stage1_cpu/kernels.py wrapped in a
timer (~1 us a call); "python" is the rest: the forward pass's own Python, slicing and
allocation. A dense decode step normally runs in one parallel region
(stage1_cpu/fast/decode_step.py), which has no ops to wrap: it is timed whole, alternating
token by token with the per-op path (the same logits), then the per-op path op by op.
A prefill on the fast path splits each matmul into the rounding of the activations and the
integer GEMM (repack and tiles), whose multiply-adds per second are shown against the peak
of the instruction its tile issues (saved by bench's micro-benchmark, stage1_prefill_gemm.json).
--save adds the pass to a JSON file (one entry per format and T), which `bench report` reads.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import time
import types
from pathlib import Path

import numba
import numpy as np
from numba import prange

from bench.common import machine_description
from bench.cpu import CACHE, SHAPES, prepare_models
from stage1_cpu import kernels, quant
from stage1_cpu.fast import gemm
from stage1_cpu.engine import LLMEngine


@numba.njit(parallel=True, cache=True)
def _empty_region(out):
    for i in prange(out.shape[0]):
        out[i] = i


def parallel_start_cost() -> float:
    """Median seconds to start and join an empty parallel region (100 calls): about a
    microsecond when idle threads spin (OpenMP's default), tens of microseconds with
    OMP_WAIT_POLICY=PASSIVE, where the sleeping thread must be woken (on a VM, its vCPU
    too). stage1_cpu/kernels.py's parallel thresholds are set against it."""
    out = np.zeros(2)
    _empty_region(out)
    ts = []
    for _ in range(100):
        t0 = time.perf_counter()
        _empty_region(out)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the benchmark's 0.6B-shape model)")
    ap.add_argument("--quant", default="int4", choices=("none", "bf16", "int8", "int4"))
    ap.add_argument("--activations", default="auto", choices=("auto", "int8", "fp32"))
    ap.add_argument("--kernels", default="auto", choices=("auto", "plain", "fast"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1, help="tokens per forward pass: 1 = decode")
    ap.add_argument("--steps", type=int, default=20, help="forward passes timed (after a warm-up)")
    ap.add_argument("--save", type=Path, default=None, help="add this pass to a JSON file (bench report reads it)")
    args = ap.parse_args(argv)

    folder = Path(args.model) if args.model else prepare_models(SHAPES["0.6b"], CACHE, quants=())["hf"]
    engine = LLMEngine(folder, quant=args.quant, threads=args.threads, max_ctx=2048, progress=False,
                       kernels=args.kernels, activations=args.activations)
    model = engine.model

    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    children, active = [0.0], set()   # each label gets its own time less that of the timed calls it
    #                                    makes (a matmul less its GEMM); a call inside one of its own
    #                                    label (FastWeight.matmul -> Weight.matmul) is part of it

    def timed(label_of, fn):
        def wrapper(*a, **k):
            label = label_of(*a)
            if label in active:
                return fn(*a, **k)
            outer, children[0] = children[0], 0.0
            active.add(label)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                took = time.perf_counter() - t0
                active.discard(label)
                spent[label] += took - children[0]
                calls[label] += 1
                children[0] = outer + took
        return wrapper

    nbytes = {}                    # a matmul's label -> the bytes of its matrix

    def matmul_label(w) -> str:
        label = f"matmul [{w.out_features}, {w.in_features}]"
        nbytes[label] = w.nbytes
        return label

    T = args.tokens
    ids = np.arange(T) % model.config.vocab_size
    model.forward(np.arange(128), 0)                     # a context to decode after
    versus = None
    if T == 1 and model.decode_step is not None:
        # the whole step in one parallel region (decode_step.py) against the per-op path,
        # alternating token by token so that both see the same machine; then the per-op
        # path below shows where a step's time goes
        one = model.decode_step
        versus = {"one region": [], "per op": []}
        for i in range(args.steps + 3):
            for name in versus:
                model.decode_step = one if name == "one region" else None
                t0 = time.perf_counter()
                model.forward(np.array([5]), 128 + i)
                versus[name].append(time.perf_counter() - t0)
        versus = {name: ts[3:] for name, ts in versus.items()}     # without the warm-up
        model.decode_step = None

    # every matmul, whichever Weight class runs it (the fast path's FastWeight has its own)
    classes, todo = [], [quant.Weight]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo += cls.__subclasses__()
    originals = []                 # (owner, name, what it was): put back when the profile ends

    def wrap(owner, name: str, label_of) -> None:
        originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, timed(label_of, getattr(owner, name)))

    for cls in classes:
        if "matmul" in vars(cls):
            wrap(cls, "matmul", lambda w, x: matmul_label(w))
    # the fast prefill's two halves: rounding the activations, then the GEMM (repack and tiles)
    for name in ("round_prompt16", "round_prompt8"):
        wrap(gemm, name, lambda *a: "round activations")
    macs = {}                      # a GEMM's label -> its multiply-adds
    for name in ("gemm_int8", "gemm_int8_q8", "gemm_int4", "gemm_int4_16"):
        def gemm_label(x, *a, n=name):
            label = f"{n} [{a[-2].shape[1]}, {x.shape[1] * x.shape[2]}]"
            macs[label] = x.shape[0] * a[-2].shape[1] * x.shape[1] * x.shape[2]
            return label
        wrap(gemm, name, gemm_label)
    # every op of the namespace forward() calls (the fast path's replaces attention), and the
    # plain kernels' module, which the fast ones fall back to
    ops = ("rmsnorm", "rope", "attention", "silu_mul", "route", "mix", "gated_add")
    for name in ops:
        wrap(kernels, name, lambda *a, n=name: n)
    if model.k is not kernels:
        model.k = types.SimpleNamespace(**{n: timed(lambda *a, n=n: n, getattr(model.k, n)) for n in ops})

    try:
        pos = 128

        def step():
            nonlocal pos
            if T == 1:
                model.forward(np.array([5]), pos)
                pos += 1
            else:
                model.forward(ids, 0)

        for _ in range(3):
            step()                                           # warm-up: compilation, allocation
        spent.clear()
        calls.clear()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        total = (time.perf_counter() - t0) / args.steps

        print(f"stage 1, {folder.name}, --quant {args.quant} --activations {args.activations}, "
              f"{args.threads} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; an empty "
              f"parallel region costs {parallel_start_cost() * 1e6:.1f} us (median, numba threading layer "
              f"{numba.threading_layer()})")
        if versus is not None:
            print(f"decode step, alternating the two paths token by token ({args.steps} each):")
            for name, ts in versus.items():
                print(f"  {name:10s}  median {np.median(ts) * 1e3:7.2f} ms  {1 / np.median(ts):6.1f} tok/s"
                      f"   (best {min(ts) * 1e3:.2f} ms)")
            print(f"  one region / per op: {np.median(versus['per op']) / np.median(versus['one region']):.2f}x")
            print("the same step op by op (model.forward's kernels, one parallel region each):")
        print(f"one forward pass of {T} token{'s' * (T > 1)}: {total * 1e3:.2f} ms (mean of {args.steps})")
        peaks = instruction_peaks()
        accounted, rows = 0.0, []
        for label, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
            per_step = seconds / args.steps
            accounted += per_step
            each = seconds / calls[label]
            row = dict(what=label, ms=per_step * 1e3, calls=calls[label] // args.steps)
            if label in macs:                                # a GEMM: its multiply-adds against its instruction's
                row["gmac_s"] = macs[label] / each / 1e9
                kind = PEAK_OF[(label.split()[0], bool(gemm.VNNI))]
                row["of_peak"] = row["gmac_s"] / peaks[kind] if kind in peaks else None
                rate = f", {row['gmac_s']:5.1f} G MAC/s" + (f" ({row['of_peak']:.0%} of {kind}'s peak)" * bool(row["of_peak"]))
            else:
                rate = f", {nbytes[label] / each / 1e9:5.1f} GB/s" if label in nbytes and T < quant.PREFILL_MIN_T else ""
            rows.append(row)
            print(f"  {label:28s} {per_step * 1e3:8.2f} ms  {row['calls']:4d} calls, {each * 1e6:8.0f} us each{rate}")
        print(f"  {'python':28s} {(total - accounted) * 1e3:8.2f} ms")
        if args.save:
            saved = json.loads(args.save.read_text()) if args.save.is_file() else {}
            if saved.get("machine") != machine_description():
                saved = dict(machine=machine_description(), passes=[])      # another machine's passes go
            saved["passes"] = [x for x in saved["passes"] if (x["quant"], x["tokens"]) != (args.quant, T)] + [dict(
                quant=args.quant, tokens=T, activations=args.activations, threads=args.threads, ms=total * 1e3,
                policy=os.environ.get("OMP_WAIT_POLICY", "default"), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                rows=rows + [dict(what="python", ms=(total - accounted) * 1e3, calls=0)])]
            args.save.write_text(json.dumps(saved, indent=1) + "\n")
            print(f"added to {args.save}")
    finally:                       # the modules as they were, for whatever runs next in this process
        for owner, name, fn in reversed(originals):
            setattr(owner, name, fn)


# a GEMM kernel and whether the CPU has VNNI -> the instruction its tile issues per multiply-add step
PEAK_OF = {("gemm_int8", False): "maddwd+add", ("gemm_int4_16", False): "maddwd+add", ("gemm_int4", False): "maddubs",
           ("gemm_int8", True): "dpwssd", ("gemm_int4_16", True): "dpwssd", ("gemm_int4", True): "dpbusd",
           ("gemm_int8_q8", True): "dpbusd"}


def instruction_peaks() -> dict:
    """G MAC/s of each instruction on all threads, from the saved micro-benchmark run when it was this
    machine's (docs/figures/stage1_prefill_gemm.json: independent chains of one instruction per thread)."""
    path = Path(__file__).resolve().parent.parent / "docs" / "figures" / "stage1_prefill_gemm.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    return saved.get("peaks_gmac_s", {}) if saved.get("machine") == machine_description() else {}


if __name__ == "__main__":
    main()
