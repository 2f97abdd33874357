"""Where one stage-1 forward pass spends its time, op by op.

    OMP_WAIT_POLICY=PASSIVE python -m bench profile --quant int4 --threads 2            # decode
    OMP_WAIT_POLICY=PASSIVE python -m bench profile --quant bf16 --tokens 512           # prefill

Uses the benchmark's Qwen3-0.6B-shape model (built by `python -m bench cpu` into
~/.cache/qwen3-stages/bench; pass --model for any other folder). Every matmul
(by shape) and every op of stage1_cpu/kernels.py is wrapped in a timer, then
--steps forward passes run after a warm-up: T=1 at positions 128, 129, ... (decode)
or T tokens from position 0 (prefill). "python" is what is left: the forward
pass's own Python, array slicing and allocation. The wrappers cost ~1 us per call.
A decode step of a dense model normally runs in one parallel region
(stage1_cpu/fast/decode_step.py), which has no ops to wrap: it is first timed whole,
alternating token by token with the per-op path (which computes the same logits),
then the per-op path is timed op by op.

--against-bandwidth measures how far the one-region step is from the memory's
speed, and what limits it. Token after token, in turn: the read bandwidth right
then (bench.common.BandwidthProbe), the real step, and a *read-only* step: the
same phases, blocks, claims and waits (decode_step.py), but each block only
summed, never multiplied, and each attention item only reading its K/V rows.
It shows what the phase structure costs with no arithmetic at all (it is not a
strict ceiling: one plain stream per item, where the int8 kernel reads four).
The report gives both as a fraction of the bandwidth measured just before them,
grouped by it (this VM's 2-thread bandwidth moves between ~35 and ~55 GB/s).
"""
from __future__ import annotations

import argparse
import collections
import os
import time
import types
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the benchmark's 0.6B-shape model)")
    ap.add_argument("--quant", default="int4", choices=("none", "bf16", "int8", "int4"))
    ap.add_argument("--activations", default="auto", choices=("auto", "int8", "fp32"))
    ap.add_argument("--kernels", default="auto", choices=("auto", "plain", "fast"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1, help="tokens per forward pass: 1 = decode")
    ap.add_argument("--steps", type=int, default=20, help="forward passes timed (after a warm-up)")
    ap.add_argument("--against-bandwidth", action="store_true",
                    help="decode only: the one-region step and a read-only copy of it against the bandwidth")
    args = ap.parse_args(argv)

    from bench.cpu import CACHE
    from stage1_cpu import kernels, quant
    from stage1_cpu.engine import LLMEngine

    folder = Path(args.model) if args.model else CACHE / "qwen3-0.6b-shape-v1" / "hf"
    if not (folder / "config.json").exists():
        raise SystemExit(f"no model at {folder}: run `python -m bench cpu` once to build it, or pass --model")
    engine = LLMEngine(folder, quant=args.quant, threads=args.threads, max_ctx=2048, progress=False,
                       kernels=args.kernels, activations=args.activations)
    model = engine.model

    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    inside = [False]               # a timed call inside a timed call (FastWeight -> Weight.matmul) counts once

    def timed(label_of, fn):
        def wrapper(*a, **k):
            if inside[0]:
                return fn(*a, **k)
            inside[0] = True
            t0 = time.perf_counter()
            try:
                result = fn(*a, **k)
            finally:
                inside[0] = False
            label = label_of(*a)
            spent[label] += time.perf_counter() - t0
            calls[label] += 1
            return result
        return wrapper

    T = args.tokens
    ids = np.arange(T) % model.config.vocab_size
    model.forward(np.arange(128), 0)                     # a context to decode after
    if args.against_bandwidth:
        if T != 1 or model.decode_step is None:
            raise SystemExit("--against-bandwidth needs the one-region decode step (--kernels fast, --tokens 1)")
        from bench.weight_bytes import stage1_bytes
        against_bandwidth(model, stage1_bytes(engine.weights, decode=True), args)
        return
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
    for cls in classes:
        if "matmul" in vars(cls):
            cls.matmul = timed(lambda w, x: f"matmul [{w.out_features}, {w.in_features}]", cls.matmul)
    # every op of the namespace forward() calls (the fast path's replaces attention), and the
    # plain kernels' module, which the fast ones fall back to
    ops = ("rmsnorm", "rope", "attention", "silu_mul", "route", "mix", "gated_add")
    for name in ops:
        setattr(kernels, name, timed(lambda *a, n=name: n, getattr(kernels, name)))
    if model.k is not kernels:
        model.k = types.SimpleNamespace(**{n: timed(lambda *a, n=n: n, getattr(model.k, n)) for n in ops})

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
          f"{args.threads} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    if versus is not None:
        print(f"decode step, alternating the two paths token by token ({args.steps} each):")
        for name, ts in versus.items():
            print(f"  {name:10s}  median {np.median(ts) * 1e3:7.2f} ms  {1 / np.median(ts):6.1f} tok/s"
                  f"   (best {min(ts) * 1e3:.2f} ms)")
        print(f"  one region / per op: {np.median(versus['per op']) / np.median(versus['one region']):.2f}x")
        print("the same step op by op (model.forward's kernels, one parallel region each):")
    print(f"one forward pass of {T} token{'s' * (T > 1)}: {total * 1e3:.2f} ms (mean of {args.steps})")
    accounted = 0.0
    for label, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        per_step = seconds / args.steps
        accounted += per_step
        print(f"  {label:28s} {per_step * 1e3:8.2f} ms  {calls[label] // args.steps:4d} calls, "
              f"{seconds / calls[label] * 1e6:8.0f} us each")
    print(f"  {'python':28s} {(total - accounted) * 1e3:8.2f} ms")


# ---------------------------------------------------------------- read-only step

def _read_only_kernels():
    """numba kernels of the read-only step (compiled on first use: bench only)."""
    import numba
    from numba import prange

    from stage1_cpu.fast import sync
    from stage1_cpu.fast.decode_step import ATTENTION, COUNTER, DST, EXPERTS, LAYER, MATMUL, OP, WEIGHT, _items

    @numba.njit(inline="always")
    def read_words(a, lo, hi):                        # sum of a[lo:hi], uint64 words: one add per 8 bytes
        return a[lo:hi].sum()                         # (an explicit loop here does not vectorise)

    @numba.njit(inline="always")
    def read_phase(words, scale_words, mins_words, O, R, counts, phase, workers):
        """A matmul (or experts) phase: the same items as _matvec over the first R of the
        O rows (experts: k experts' worth, as many bytes as the routed ones), each item's
        weights and scales summed (one stream each), nothing multiplied."""
        row = words.size // O
        block, big, n_big, split, n = _items(R, row * 8, workers)
        srow, mrow = scale_words.size // O, mins_words.size // O
        s = np.uint64(0)
        i = sync.claim(counts, phase)
        while i < n:
            r0 = i * big if i < n_big else split + (i - n_big) * block
            r1 = min(R, r0 + (big if i < n_big else block))
            s += read_words(words, r0 * row, r1 * row) + read_words(scale_words, r0 * srow, r1 * srow)
            s += read_words(mins_words, r0 * mrow, r1 * mrow)
            sync.finish(counts, phase)
            i = sync.claim(counts, phase)
        sync.wait(counts, phase, n)
        return s

    @numba.njit(inline="always", fastmath=True)
    def read_kv(kv, layer, pos, counts, phase):
        """An attention phase: each KV head's keys and values up to pos, summed."""
        Hkv = kv.shape[2]
        s = np.float32(0.0)
        i = sync.claim(counts, phase)
        while i < Hkv:
            s += kv[layer, 0, i, :pos + 1].sum() + kv[layer, 1, i, :pos + 1].sum()
            sync.finish(counts, phase)
            i = sync.claim(counts, phase)
        sync.wait(counts, phase, Hkv)
        return s

    @numba.njit(parallel=True)
    def step(workers, prog, meta, words, scale_words, mins_words, kv, pos, counts):
        """The step's program (decode_step.py), its shared phases only, read instead of run."""
        total = np.zeros(workers, dtype=np.float64)
        for w in prange(workers):
            s = 0.0
            for p in range(prog.shape[0]):
                op = prog[p, OP]
                if op == ATTENTION:
                    s += read_kv(kv, prog[p, LAYER], pos, counts, prog[p, COUNTER])
                elif op == MATMUL or op == EXPERTS:
                    m = prog[p, WEIGHT]
                    O = meta[m, 2]
                    R = O if op == MATMUL else prog[p, DST + 2]   # experts: k x rows per expert
                    s += read_phase(words[m], scale_words[m], mins_words[m], O, R, counts, prog[p, COUNTER],
                                    workers)
            total[w] = s
        return total.sum()

    return step


def against_bandwidth(model, weight_bytes: int, args) -> None:
    """The real one-region step and its read-only copy, each against the read
    bandwidth measured right next to it (see the module docstring)."""
    import numba
    from numba import types
    from numba.typed import List

    from bench.common import BandwidthProbe
    from stage1_cpu.fast import sync

    ds = model.decode_step
    words_of = lambda arrays: _typed([np.asarray(a).view(np.uint8)[: a.nbytes // 8 * 8].view(np.uint64)
                                      for a in arrays], List, types)
    words, scale_words, mins_words = words_of(ds.data), words_of(ds.scales), words_of(ds.mins)
    read_step = _read_only_kernels()
    workers = numba.get_num_threads()
    probe = BandwidthProbe()
    kv = model.cache.data
    samples = []                                    # (GB/s, real step s, read-only step s)
    pos = 128
    for i in range(args.steps + 3):
        bw = probe.read(workers)
        t0 = time.perf_counter()
        model.forward(np.array([5]), pos)
        t1 = time.perf_counter()
        read_step(workers, ds.prog, ds.meta, words, scale_words, mins_words, kv, pos, sync.counters(ds.n_counters))
        t2 = time.perf_counter()
        samples.append((bw, t1 - t0, t2 - t1))
        pos = pos + 1 if pos < 255 else 128          # positions 128..255, as in the benchmark's decode
    probe.close()
    a = np.array(samples[3:])                       # without the warm-up
    kv_bytes = 2 * kv.shape[0] * kv.shape[2] * kv.shape[4] * 4 * (pos + 1)
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(f"stage 1, --quant {args.quant}, {workers} threads, OMP_WAIT_POLICY={policy}: "
          f"{weight_bytes / 1e6:.0f} MB of weights per token (+ {kv_bytes / 1e6:.0f} MB of KV cache at position "
          f"{pos}); each step next to a read of 256 MiB (GB/s)")
    print("  bandwidth      n   real step                 read-only step")
    edges = [0, 40, 1e9]
    for lo, hi in zip(edges, edges[1:]):
        sel = (a[:, 0] >= lo) & (a[:, 0] < hi)
        if not sel.any():
            continue
        bw, real, ro = (np.median(a[sel, c]) for c in range(3))
        fr = np.median(weight_bytes / a[sel, 1] / 1e9 / a[sel, 0])
        fro = np.median(weight_bytes / a[sel, 2] / 1e9 / a[sel, 0])
        label = f"< {hi:.0f} GB/s" if lo == 0 else f">= {lo:.0f} GB/s"
        print(f"  {label:12s} {sel.sum():3d}   {real * 1e3:6.2f} ms = {fr:4.0%} of it    "
              f"{ro * 1e3:6.2f} ms = {fro:4.0%} of it   (median {bw:.1f} GB/s)")
    print("  (% = weight bytes ÷ step time ÷ the bandwidth measured just before the step, median over the steps)")


def _typed(arrays, List, types):
    out = List.empty_list(types.Array(types.uint64, 1, "C", readonly=True))
    for a in arrays:
        out.append(a)
    return out


if __name__ == "__main__":
    main()
