"""Micro-benchmark of stage 1's matmul kernels at Qwen3-0.6B shapes.

    OMP_WAIT_POLICY=PASSIVE python -m bench.kernels [--group-size 64] [--threads 1 2]
                                                   [--formats none bf16 int8 int4] [--prefill 512]
                                                   [--activations fp32|auto]

Napkin maths it prints:
- the machine's read bandwidth (a parallel numba sum over 512 MiB) and copy
  bandwidth (numpy copy): decode of one token reads every weight once, so
  weight bytes / read bandwidth is the fastest a decode step can be;
- per shape and format, a decode matvec (T=1): GB/s = weight bytes / time,
  and its share of the read bandwidth;
- the estimated matmul-only decode tok/s of the whole model
  (28 layers of qkv, o, gate_up, down -- stacked as the engine stacks them -- plus
  the 151936 x 1024 lm_head);
- the other ops of one layer (norms, RoPE, attention, SwiGLU) at decode
  (one token at position 511) and at prefill;
- prefill of --prefill tokens at once: GFLOP/s and the layers' tok/s.
Times are medians of several runs, with the fastest run in brackets ("best"):
the load average is printed because other people share this machine, and a
busy neighbour drags the medians down (rerun if it was busy).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numba
import numpy as np
from numba import njit, prange

from stage1_cpu import kernels
from stage1_cpu.quant import Weight
from stage1_cpu.fast import choose_act
from stage1_cpu.fast import fast_quantize as quantize_weight

# (out, in) of each matmul of one Qwen3-0.6B layer (q/k/v and gate/up stacked, as stage 1 does):
# C=1024, H*D=2048, Hkv*D=1024, F=3072
LAYER = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LM_HEAD = (151936, 1024)
N_LAYERS = 28


@njit(parallel=True, cache=True)
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


@njit(parallel=True, cache=True, fastmath={"reassoc"})
def _parallel_sum(a2):
    # a2 [chunks, n] f32 read once, one chunk per prange step: the read bandwidth
    # a matvec can hope for
    parts = np.zeros(a2.shape[0], dtype=np.float32)
    for c in prange(a2.shape[0]):
        s = np.float32(0.0)
        for i in range(a2.shape[1]):
            s += a2[c, i]
        parts[c] = s
    return parts.sum()


BEST = {}  # id(fn) -> fastest run of the last median_time(fn) call


def median_time(fn, runs: int) -> float:
    """Median seconds of fn() over `runs` runs (after one warm-up call). The
    fastest run is kept in BEST: on a shared machine it is the better estimate
    of what the kernel can do, the median of what you get right now."""
    fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    BEST["last"] = float(np.min(ts))
    return float(np.median(ts))


def copy_weight(W: Weight) -> Weight:
    return dataclasses.replace(W, **{k: getattr(W, k).copy() for k in ("data", "scales", "mins")
                                     if getattr(W, k) is not None})


def bandwidth(runs: int) -> tuple[float, float]:
    a = np.ones(128 * 2**20, dtype=np.float32)   # 512 MiB, far beyond the 32 MiB L3
    median_time(lambda: _parallel_sum(a.reshape(64, -1)), runs)
    read = a.nbytes / BEST["last"] / 1e9   # the fastest run: the machine's capability
    b = np.empty_like(a)
    median_time(lambda: np.copyto(b, a), runs)
    copy = 2 * a.nbytes / BEST["last"] / 1e9
    return read, copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=64, help="group size of int8 / int4")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to time")
    ap.add_argument("--formats", nargs="+", default=["none", "bf16", "int8", "int4"])
    ap.add_argument("--runs", type=int, default=15, help="runs per measurement (median)")
    ap.add_argument("--prefill", type=int, default=512, help="tokens for the prefill timing (0: skip)")
    ap.add_argument("--no-lm-head", action="store_true", help="skip the 600 MB lm_head shape")
    ap.add_argument("--activations", choices=("fp32", "auto"), default="fp32",
                    help="fp32: the float kernels; auto: what the engine uses on this CPU (int8 decode "
                         "activations for int8 / int4, bf16 prefill; stage1_cpu/fast/simd.py)")
    args = ap.parse_args()

    def quantize(w, fmt, gs):          # the lm_head is the only [151936, C] matrix: its own activations
        head = w.shape[0] == LM_HEAD[0]
        return quantize_weight(w, fmt, gs, **choose_act(fmt, args.activations, w.shape[1], lm_head=head))

    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores; > 0.5 means someone else is busy)")
    rng = np.random.default_rng(0)
    shapes = dict(LAYER) if args.no_lm_head else {**LAYER, "lm_head": LM_HEAD}
    fp32 = {name: rng.standard_normal(shape, dtype=np.float32) * 0.05 for name, shape in shapes.items()}

    bw = {}
    for nt in args.threads:
        kernels.set_threads(nt)
        bw[nt] = bandwidth(args.runs)
        print(f"threads={nt}: read bandwidth {bw[nt][0]:.1f} GB/s (numba sum), copy {bw[nt][1]:.1f} GB/s "
              f"(numpy, read+write); fastest of {args.runs} runs")
        if nt > 1:
            print(f"threads={nt}: an empty parallel region costs {parallel_start_cost() * 1e6:.1f} us (median; "
                  f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
                  f"numba threading layer {numba.threading_layer()})")

    # ---- per-core arithmetic speed: a 1024 x 1024 matvec on one thread, again and again,
    # so the weights stay in L2 and memory is out of the picture ----
    kernels.set_threads(1)
    small = rng.standard_normal((1024, 1024), dtype=np.float32) * 0.05
    x1 = rng.standard_normal((1, 1024), dtype=np.float32)
    speeds = []
    for fmt in args.formats:
        W = quantize(small, fmt, args.group_size)
        median_time(lambda: W.matmul(x1), args.runs * 20)
        speeds.append(f"{fmt} {W.out_features * W.in_features / BEST['last'] / 1e9:.1f}")
    print(f"\none core, weights in L2 (1024 x 1024 matvec, fastest of {args.runs * 20}): "
          f"{', '.join(speeds)} G weights/s")

    # ---- decode: one token, every weight byte read once ----
    print(f"\ndecode matvec (T=1), group size {args.group_size}: GB/s = weight bytes / time, % of read bandwidth")
    print(f"{'shape':>16} {'fmt':>5} {'MB':>7} " + " ".join(f"{'t=' + str(nt):>21}" for nt in args.threads))
    step_time = {(f, nt): 0.0 for f in args.formats for nt in args.threads}
    step_best = dict(step_time)
    step_bytes = {f: 0 for f in args.formats}
    for fmt in args.formats:
        for name, w32 in fp32.items():
            W = quantize(w32, fmt, args.group_size)
            # copies of the matrix, > 256 MB in all, used in turn: a real decode step
            # reads 28 layers' weights, so none of them is still in the 32 MB L3 cache
            Ws = [W] + [copy_weight(W) for _ in range(-(-256_000_000 // W.nbytes) - 1)]
            x = rng.standard_normal((1, W.in_features), dtype=np.float32)
            count = 1 if name == "lm_head" else N_LAYERS
            step_bytes[fmt] += count * W.nbytes
            cells = []
            for nt in args.threads:
                kernels.set_threads(nt)
                t = median_time(lambda: [Wi.matmul(x) for Wi in Ws], args.runs) / len(Ws)
                best = BEST["last"] / len(Ws)
                step_time[(fmt, nt)] += count * t
                step_best[(fmt, nt)] += count * best
                gbs = W.nbytes / t / 1e9
                cells.append(f"{t * 1e6:7.0f}us {gbs:5.1f}GB/s {100 * gbs / bw[nt][0]:3.0f}% "
                             f"(best {W.nbytes / best / 1e9:5.1f})")
            print(f"{name + ' ' + str(W.in_features) + '>' + str(W.out_features):>16} {fmt:>5} "
                  f"{W.nbytes / 1e6:7.1f} " + " ".join(cells))
            del W, Ws

    print("\nestimated decode of Qwen3-0.6B, matmuls only (28 layers + lm_head):")
    for fmt in args.formats:
        for nt in args.threads:
            t = step_time[(fmt, nt)]
            roof = bw[nt][0] * 1e9 / step_bytes[fmt]
            print(f"  {fmt:>5} t={nt}: {step_bytes[fmt] / 1e6:6.0f} MB/token  {1 / t:6.1f} tok/s"
                  f" (best runs {1 / step_best[(fmt, nt)]:6.1f})  roofline {roof:5.1f} tok/s: {100 / t / roof:3.0f}%")
    print("  (add the other ops below, ~N_LAYERS x their per-layer time, for a whole decode step)")

    # ---- the other ops of one layer: norms, RoPE, attention, SwiGLU ----
    ops_time = {}
    for T, start in [(1, 511), (args.prefill or 1, 0)]:
        nt = max(args.threads)
        kernels.set_threads(nt)
        H, Hkv, D, C, F = 16, 8, 128, 1024, 3072
        x = rng.standard_normal((T, C), dtype=np.float32)
        q = rng.standard_normal((T, H, D), dtype=np.float32)
        k = rng.standard_normal((T, Hkv, D), dtype=np.float32)
        kc = rng.standard_normal((Hkv, 4096, D), dtype=np.float32)
        vc = rng.standard_normal((Hkv, 4096, D), dtype=np.float32)
        cs = rng.standard_normal((T, D // 2), dtype=np.float32)
        g = rng.standard_normal((T, 2 * F), dtype=np.float32)       # [gate | up]
        wC, wD = np.ones(C, np.float32), np.ones(D, np.float32)

        def layer_ops():
            kernels.rmsnorm(x, wC, 1e-6)
            kernels.rmsnorm(q, wD, 1e-6)
            kernels.rmsnorm(k, wD, 1e-6)
            kernels.rope(q, cs, cs)
            kernels.rope(k, cs, cs)
            kernels.attention(q, kc, vc, start)
            kernels.rmsnorm(x, wC, 1e-6)
            kernels.silu_mul(g)

        ops_time[T] = median_time(layer_ops, max(3, args.runs // 3))
        att = median_time(lambda: kernels.attention(q, kc, vc, start), max(3, args.runs // 3))
        print(f"\nother ops of one layer, T={T} at positions {start}..{start + T - 1}, threads={nt}: "
              f"{ops_time[T] * 1e3:.2f} ms (attention {att * 1e3:.2f} ms) x {N_LAYERS} layers = "
              f"{N_LAYERS * ops_time[T] * 1e3:.1f} ms per forward")

    # ---- prefill: T tokens at once, compute-bound ----
    if args.prefill:
        T = args.prefill
        nt = max(args.threads)
        kernels.set_threads(nt)
        print(f"\nprefill of {T} tokens, threads={nt}: the 4 layer matmuls (lm_head runs for the last token only)")
        flops = 2 * T * sum(o * i for o, i in LAYER.values())
        for fmt in args.formats:
            total = 0.0
            best = 0.0
            for name, shape in LAYER.items():
                W = quantize(fp32[name], fmt, args.group_size)
                x = rng.standard_normal((T, W.in_features), dtype=np.float32)
                total += median_time(lambda: W.matmul(x), max(3, args.runs // 3))
                best += BEST["last"]
            print(f"  {fmt:>5}: best runs {flops / best / 1e9:6.1f} GFLOP/s -> {T / (N_LAYERS * best):6.1f} tok/s matmuls only")
            print(f"  {fmt:>5}: {flops / total / 1e9:6.1f} GFLOP/s  ->  {T / (N_LAYERS * total):6.1f} tok/s matmuls only, "
                  f"{T / (N_LAYERS * (total + ops_time[T])):6.1f} tok/s with the other ops")
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
