"""Where one stage-1 forward pass spends its time, op by op.

    OMP_WAIT_POLICY=PASSIVE python -m bench profile --quant int4 --threads 2            # decode
    OMP_WAIT_POLICY=PASSIVE python -m bench profile --quant bf16 --tokens 512           # prefill
    # the core's kernels
    OMP_WAIT_POLICY=PASSIVE python -m bench profile --kernels plain --activations fp32
    # the peaks first, then a prefill pass beside them
    python -m bench profile --peaks --save docs/figures/stage1_prefill_profile.json
    python -m bench profile --quant int4 --tokens 512 \
        --save docs/figures/stage1_prefill_profile.json

On bench cpu's Qwen3-0.6B-shape model (or --model): first what an empty parallel region
costs (what the one-region step saves once per op), then --steps forward passes after a
warm-up, every matmul (with its GB/s) and every op of stage1_cpu/kernels.py wrapped in a
timer (~1 us a call); "python" is the rest: the forward pass's own Python, slicing and
allocation. A dense decode step normally runs in one parallel region
(stage1_cpu/fast/decode_step.py), which has no ops to wrap: it is timed whole, alternating
token by token with the per-op path (the same logits), then the per-op path op by op.
A prefill on the fast path splits each matmul into the rounding of the activations and the
integer GEMM (repack and tiles), whose multiply-adds per second are shown against the peak
of the instruction its tile issues (`--peaks` measures them, and `--peaks --save` keeps them).
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
from llvmlite import ir
from numba import prange
from numba.core import cgutils
from numba.extending import intrinsic

from bench.common import machine_description
from bench.cpu import CACHE, SHAPES, prepare_models
from stage1_cpu import kernels, quant
from stage1_cpu.engine import LLMEngine
from stage1_cpu.fast import OneRegionModel, cpu, gemm, simd, tiles
from stage1_cpu.fast import decode_step as ds

SAVED = Path(__file__).resolve().parent.parent / "docs" / "figures" / "stage1_prefill_profile.json"


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


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model folder (default: the benchmark's 0.6B-shape model)")
    ap.add_argument("--quant", default="int4", choices=("none", "bf16", "int8", "int4"),
                    help="stage 1's --quant (default int4)")
    ap.add_argument("--activations", default="auto", choices=("auto", "int8", "fp32"),
                    help="stage 1's --activations (default auto)")
    ap.add_argument("--kernels", default="auto", choices=("auto", "plain", "fast"),
                    help="stage 1's --kernels (default auto)")
    ap.add_argument("--threads", type=int, default=2, help="numba threads (default 2)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens a pass: 1 = decode (default 1)")
    ap.add_argument("--steps", type=int, default=20, help="passes timed (+ a warm-up; default 20)")
    ap.add_argument("--save", type=Path, default=None,
                    help="add this pass to a JSON file (bench report reads it)")
    ap.add_argument("--peaks", action="store_true",
                    help="instead: measure the G MAC/s of the instructions the GEMM's tiles issue "
                    "(--save keeps them for this machine's passes, which show each GEMM against "
                    "them)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.peaks:
        peaks_main(args)
        return
    folder = (Path(args.model) if args.model
              else prepare_models(SHAPES["0.6b"], CACHE, quants=())["hf"])
    engine = LLMEngine(folder, quant=args.quant, threads=args.threads, max_ctx=2048, progress=False,
                       kernels=args.kernels, activations=args.activations)
    model = engine.model
    T = args.tokens
    model.forward(np.arange(128), 0)                     # a context to decode after
    versus = None
    if isinstance(model, OneRegionModel):                # the fast path: decode steps in one region
        if T <= 8:
            print_step_parts(model, T, args.steps)
        versus = one_region_against_per_op(model, args.steps) if T == 1 else None
        model = model.per_op                             # and the same steps op by op below
    timers = Timers()
    try:
        timers.wrap_ops(model)
        total = time_passes(model, T, args.steps, timers)
        policy = os.environ.get("OMP_WAIT_POLICY", "unset")
        print(f"stage 1, {folder.name}, --quant {args.quant} --activations {args.activations}, "
              f"{args.threads} threads, OMP_WAIT_POLICY={policy}; an empty parallel region costs "
              f"{parallel_start_cost() * 1e6:.1f} us (median, numba threading layer "
              f"{numba.threading_layer()})")
        if versus is not None:
            print_versus(versus, args.steps)
        print(f"one forward pass of {T} token{'s' * (T > 1)}: {total * 1e3:.2f} ms "
              f"(mean of {args.steps})")
        rows, accounted = timers.rows(T, args.steps, instruction_peaks(args.save or SAVED))
        python = dict(what="python", ms=(total - accounted) * 1e3, calls=0)   # the rest of a pass
        print(f"  {'python':28s} {python['ms']:8.2f} ms")
        if args.save:
            save_pass(args, T, total, rows + [python])
    finally:                # the modules as they were, for whatever runs next in this process
        timers.restore()


def peaks_main(args) -> None:
    """--peaks: the instructions' G MAC/s on all threads; with --save, kept for this machine."""
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    peaks = measure_peaks(numba.get_num_threads())
    print(f"{machine_description()}, {numba.get_num_threads()} threads: "
          + ", ".join(f"{k} {v:.1f} G MAC/s" for k, v in peaks.items()))
    if args.save:
        saved = this_machines(args.save)
        rb, tt = tiles.SHAPES[("int8.q16", 4)]          # prefill's tile: int16 activations
        saved.update(peaks_gmac_s=peaks, tile=[8 * rb, tt], peaks_date=time.strftime("%Y-%m-%d"))
        args.save.write_text(json.dumps(saved, indent=1) + "\n")


def one_region_against_per_op(model, steps: int) -> dict[str, list[float]]:
    """The whole step in one parallel region (decode_step.py) against the per-op path, alternating
    token by token so that both see the same machine -> {path: seconds of each step}, without the
    warm-up. model: the fast path's (fast.OneRegionModel), its context already fed."""
    versus: dict[str, list[float]] = {"one region": [], "per op": []}
    paths = {"one region": model.decode_step, "per op": model.per_op}
    for i in range(steps + 3):
        for name, path in paths.items():
            t0 = time.perf_counter()
            path.forward(np.array([5]), 128 + i)
            versus[name].append(time.perf_counter() - t0)
    return {name: ts[3:] for name, ts in versus.items()}


def print_versus(versus: dict[str, list[float]], steps: int) -> None:
    print(f"decode step, alternating the two paths token by token ({steps} each):")
    for name, ts in versus.items():
        print(f"  {name:10s}  median {np.median(ts) * 1e3:7.2f} ms  {1 / np.median(ts):6.1f} tok/s"
              f"   (best {min(ts) * 1e3:.2f} ms)")
    ratio = np.median(versus["per op"]) / np.median(versus["one region"])
    print(f"  one region / per op: {ratio:.2f}x")
    print("the same step op by op (model.forward's kernels, one parallel region each):")


def time_passes(model, T: int, steps: int, timers: Timers) -> float:
    """Seconds of one forward pass of T tokens (a decode step after the context when T is 1,
    else the prompt from position 0), the mean of `steps` after a warm-up; the timers count
    only those."""
    ids = np.arange(T) % model.config.vocab_size
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
    timers.spent.clear()
    timers.calls.clear()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def print_step_parts(model, T: int, steps: int) -> None:
    """Where the one-region step of T tokens spends its time: the step is data (decode_step.prog),
    so it runs again with parts of its program alone (the values are wrong, the work is not):
    the matrix phases of the layers, the lm_head's, attention, the small ops, and none at all
    (starting the region, Python). What the parts do not add up to is the waiting between
    phases and what one part overlaps with another. model: the fast path's (fast.OneRegionModel)."""
    step, full = model.decode_step, model.decode_step.prog
    x = model.w.embed.rows(np.arange(T) % model.config.vocab_size)
    parts = {"whole step": np.ones(len(full), bool), **step_parts(full),
             "nothing (region, Python)": np.zeros(len(full), bool)}
    best = dict.fromkeys(parts, float("inf"))
    try:
        for _ in range(steps):           # the parts interleaved: each sees the same machine
            for name, keep in parts.items():
                step.prog = np.ascontiguousarray(full[keep])
                t0 = time.perf_counter()
                step.step(x, 200, all_logits=T > 1)
                best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        step.prog = full
    rest = best["whole step"] - sum(v for k, v in best.items() if k != "whole step")
    print(f"the one-region step of {T} token{'s' * (T > 1)}, by part (best of {steps}, ms):")
    for name, sec in [*best.items(), ("the rest (waits, overlap)", rest)]:
        print(f"  {name:28s} {sec * 1e3:8.2f}")


def step_parts(prog: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of a step's program by part: each row in exactly one part."""
    op = prog[:, ds.OP]
    matrix = np.isin(op, [ds.MATMUL, ds.EXPERTS])
    return {"layers' matrices": matrix & (prog[:, ds.LOGITS] == 0),
            "lm_head": matrix & (prog[:, ds.LOGITS] == 1),
            "attention": op == ds.ATTENTION, "small ops": ~matrix & (op != ds.ATTENTION)}


# every op of the namespace forward() calls (the fast path's replaces attention)
OPS = ("rmsnorm", "rope", "attention", "silu_mul", "route", "mix", "gated_add")


class Timers:
    """Wall time and calls per label of every wrapped function. Each label gets its own time less
    that of the timed calls it makes (a matmul less its GEMM); a call inside one of its own label
    (FastWeight.matmul -> Weight.matmul) is part of it."""

    def __init__(self):
        self.spent: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.children, self.active = 0.0, set()
        self.nbytes: dict[str, int] = {}       # a matmul's label -> the bytes of its matrix
        self.macs: dict[str, int] = {}         # a GEMM's label -> its multiply-adds
        self.originals = []                    # (owner, name, what it was): put back by restore()

    def timed(self, label_of, fn):
        def wrapper(*a, **k):
            label = label_of(*a)
            if label in self.active:
                return fn(*a, **k)
            outer, self.children = self.children, 0.0
            self.active.add(label)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                took = time.perf_counter() - t0
                self.active.discard(label)
                self.spent[label] += took - self.children
                self.calls[label] += 1
                self.children = outer + took
        return wrapper

    def wrap(self, owner, name: str, label_of) -> None:
        self.originals.append((owner, name, getattr(owner, name)))
        setattr(owner, name, self.timed(label_of, getattr(owner, name)))

    def restore(self) -> None:
        for owner, name, fn in reversed(self.originals):
            setattr(owner, name, fn)

    def matmul_label(self, w) -> str:
        label = f"matmul [{w.out_features}, {w.in_features}]"
        self.nbytes[label] = w.nbytes
        return label

    def gemm_label(self, x, xs, xcorr, xsum, data, scales, mins, out, workers, *kinds) -> str:
        # named as PEAK_OF names the kinds: weights x activations (int8.q16, the default,
        # is gemm_int8)
        name = GEMM_NAMES[[k is not None for k in kinds].index(True)]
        label = f"{name} [{out.shape[1]}, {x.shape[1]}]"
        self.macs[label] = x.shape[0] * out.shape[1] * x.shape[1]
        return label

    def wrap_ops(self, model) -> None:
        """Timers on every matmul (whichever Weight class runs it: the fast path's FastWeight has
        its own), the fast prefill's two halves (rounding the activations, then the GEMM: repack
        and tiles), and every op of the model's kernels and of the plain kernels' module, which the
        fast ones fall back to."""
        classes, todo = [], [quant.Weight]
        while todo:
            cls = todo.pop()
            classes.append(cls)
            todo += cls.__subclasses__()
        for cls in classes:
            if "matmul" in vars(cls):
                self.wrap(cls, "matmul", lambda w, x: self.matmul_label(w))
        for name in ("round_prompt16", "round_prompt8"):
            self.wrap(gemm, name, lambda *a: "round activations")
        self.wrap(gemm, "gemm_tiled", self.gemm_label)
        for name in OPS:
            self.wrap(kernels, name, lambda *a, n=name: n)
        if model.kernels is not kernels:
            timed = {n: self.timed(lambda *a, n=n: n, getattr(model.kernels, n)) for n in OPS}
            model.kernels = types.SimpleNamespace(**timed)

    def rows(self, T: int, steps: int, peaks: dict) -> tuple[list[dict], float]:
        """Print one line per label, the slowest first -> (the rows, as --save keeps them; the
        seconds of a pass they account for)."""
        accounted, rows = 0.0, []
        for label, seconds in sorted(self.spent.items(), key=lambda kv: -kv[1]):
            per_step = seconds / steps
            accounted += per_step
            each = seconds / self.calls[label]
            row = dict(what=label, ms=per_step * 1e3, calls=self.calls[label] // steps)
            if label in self.macs:           # a GEMM: its multiply-adds against its instruction's
                row["gmac_s"] = self.macs[label] / each / 1e9
                kind = PEAK_OF[(label.split()[0], bool(tiles.VNNI))]
                row["of_peak"] = row["gmac_s"] / peaks[kind] if kind in peaks else None
                rate = f", {row['gmac_s']:5.1f} G MAC/s" + (
                    f" ({row['of_peak']:.0%} of {kind}'s peak)" if row["of_peak"]
                    else " (no peaks: --peaks --save)")
            elif label in self.nbytes and T < quant.PREFILL_MIN_T:
                rate = f", {self.nbytes[label] / each / 1e9:5.1f} GB/s"
            else:
                rate = ""
            rows.append(row)
            print(f"  {label:28s} {per_step * 1e3:8.2f} ms  {row['calls']:4d} calls, "
                  f"{each * 1e6:8.0f} us each{rate}")
        return rows, accounted


def save_pass(args, T: int, total: float, rows: list[dict]) -> None:
    """This pass into --save's file, in place of an earlier one of the same format and T."""
    saved = this_machines(args.save)
    others = [x for x in saved["passes"] if (x["quant"], x["tokens"]) != (args.quant, T)]
    saved["passes"] = others + [dict(
        quant=args.quant, tokens=T, activations=args.activations, threads=args.threads,
        ms=total * 1e3, policy=os.environ.get("OMP_WAIT_POLICY", "default"),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rows=rows)]
    args.save.write_text(json.dumps(saved, indent=1) + "\n")
    print(f"added to {args.save}")


# gemm_tiled's kinds (int8 . int8, int8 . int16, int4 . int8, int4 . int16), as the profile
# names them
GEMM_NAMES = ("gemm_int8_q8", "gemm_int8", "gemm_int4", "gemm_int4_16")
# a GEMM kernel and whether the CPU has VNNI -> the instruction its tile issues per
# multiply-add step
PEAK_OF = {("gemm_int8", False): "maddwd+add", ("gemm_int4_16", False): "maddwd+add",
           ("gemm_int4", False): "maddubs",
           ("gemm_int8", True): "dpwssd", ("gemm_int4_16", True): "dpwssd",
           ("gemm_int4", True): "dpbusd",
           ("gemm_int8_q8", True): "dpbusd", ("gemm_int8_q8", False): "maddubs"}


# independent accumulators a thread: with 16 registers (AVX2) 8 of them and the shared vector w, so
# that none waits in memory; with 32, 12, more than vpdpbusd's latency x its rate
CHAINS = 12 if tiles.REGISTERS == 32 else 8


def _peak_codegen(quads: bool):
    """The body of _peak_pairs / _peak_quads: n steps, each CHAINS multiply-adds, chain c's on
    vector (step + c) % 64 of a (32 bytes each, in L1) and a fixed one w (a[64]), into its
    accumulator, by the instruction the GEMM's tile issues: pairs, vpmaddwd + vpaddd (vpdpwssd on
    VNNI); quads, vpmaddubsw + vpaddw (vpdpbusd on VNNI). The sums go to out [CHAINS x 8] int32, so
    none is optimised away."""
    def codegen(context, builder, sig, args):
        a, n, out = args
        ap = builder.bitcast(context.make_array(sig.args[0])(context, builder, a).data,
                             simd.BYTES32.as_pointer())
        op = builder.bitcast(context.make_array(sig.args[2])(context, builder, out).data,
                             simd.INTS8.as_pointer())
        acc_ty = simd.SHORTS16 if quads and not simd.VNNI else simd.INTS8
        accs = [cgutils.alloca_once_value(builder, ir.Constant(acc_ty, None))
                for _ in range(CHAINS)]
        w = builder.load(builder.gep(ap, [ir.Constant(simd.I64, 64)]), align=1)
        maddubs = simd._declare(builder, "llvm.x86.avx2.pmadd.ub.sw",
                                simd.SHORTS16, [simd.BYTES32] * 2)
        with cgutils.for_range(builder,
                               context.cast(builder, n, sig.args[1], numba.types.int64)) as loop:
            for c, acc in enumerate(accs):
                at = builder.and_(builder.add(loop.index, ir.Constant(simd.I64, c)),
                                  ir.Constant(simd.I64, 63))
                x = builder.load(builder.gep(ap, [at]), align=1)
                old = builder.load(acc)
                if quads and not simd.VNNI:
                    new = builder.add(old, builder.call(maddubs, [x, w]))
                else:
                    new = (simd._vpdpbusd(builder, x, w, old) if quads
                           else simd._vpdpwssd(builder, old, x, w))
                builder.store(new, acc)
        for c, acc in enumerate(accs):
            builder.store(builder.bitcast(builder.load(acc), simd.INTS8),
                          builder.gep(op, [ir.Constant(simd.I64, c)]), align=4)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _peak_pairs(typingctx, a, n, out):
    return numba.types.void(a, n, out), _peak_codegen(quads=False)


@intrinsic
def _peak_quads(typingctx, a, n, out):
    return numba.types.void(a, n, out), _peak_codegen(quads=True)


def _on_every_thread(peak):
    """peak (_peak_pairs or _peak_quads) on each of out's rows, one thread a row."""
    @numba.njit(parallel=True)
    def run(a, n, out):
        for w in prange(out.shape[0]):
            peak(a, n, out[w])
    return run


_peaks_pairs, _peaks_quads = _on_every_thread(_peak_pairs), _on_every_thread(_peak_quads)


def measure_peaks(threads: int, steps: int = 20_000_000) -> dict:
    """G multiply-adds per second of the instructions the GEMM's tiles issue, on all threads at
    once: CHAINS independent chains a thread, best of 5 -> {name: G MAC/s}, the names PEAK_OF gives
    them. x86 with an int8 dot product only (cpu.INT8 "avx2" or "vnni")."""
    if cpu.INT8 not in ("avx2", "vnni"):
        raise SystemExit("bench profile --peaks: x86 with AVX2 only (this CPU's int8 dot "
                         f"product: {cpu.INT8})")
    a = np.random.default_rng(0).integers(0, 100, size=65 * 32, dtype=np.int8)
    out = np.zeros((threads, CHAINS * 8), dtype=np.int32)
    peaks = {}
    # the pairs tile's instruction, then the quads'
    vnni = bool(tiles.VNNI)
    for name, run, macs in ((PEAK_OF[("gemm_int8", vnni)], _peaks_pairs, 16),
                            (PEAK_OF[("gemm_int4", vnni)], _peaks_quads, 32)):
        run(a, 1000, out)                                    # compiles
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            run(a, steps, out)
            best = min(best, time.perf_counter() - t0)
        peaks[name] = threads * steps * CHAINS * macs / best / 1e9
    return peaks


def this_machines(path: Path) -> dict:
    """The saved passes and peaks of `path` where this machine wrote them; another machine's go."""
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if saved.get("machine") == machine_description():
        return saved
    return dict(machine=machine_description(), passes=[])


def instruction_peaks(path: Path = SAVED) -> dict:
    """G MAC/s of each instruction on all threads, as `--peaks --save` measured them on this
    machine."""
    return this_machines(path).get("peaks_gmac_s", {})


if __name__ == "__main__":
    main()
