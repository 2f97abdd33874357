"""The ablation ladder: what each idea of stage 1's decode buys, one rung at a time.

    python -m bench ladder                     # Qwen3-0.6B's matrices, 2 threads (~2 min idle)
    python -m bench ladder --quick             # 4 small layers (seconds; CI)
    python -m bench ladder --threads 2 --tokens 7 --out /tmp/ladder.md

Start from the naive program and add one idea per rung, on stage 1's own kernels, for
the matrix-vector products of one decode token (every projection of every layer, q/k/v and
gate/up stacked as stage 1 stores them, and the lm_head): ~95 % of a decode step's time.

    rung 1  one thread; each matrix dequantized to fp32, then multiplied (int8 weights)
    rung 2  the same, with prange threads
    rung 3  fused: int8 weights converted in registers (matmul.matmul_int8), no fp32 copy
    rung 4  int4 weights (matmul.matmul_int4); the lm_head stays int8, as the engine keeps it
    rung 5  the fast path: int4 weights, activations rounded to int8 and multiplied by the
            CPU's integer dot product (stage1_cpu/fast; only where cpu.INT8 is not None)

Then the prefill ladder, in ms per prompt token: every layer's projections (no
lm_head: prefill needs only the last token's logits) for a --prefill-tokens prompt:

    rung P1  the plain path: ROW_BLOCK rows dequantized to an fp32 tile, then BLAS sgemm (int8)
    rung P2  the fast path's int8-activation GEMM with register tiles (stage1_cpu/fast/gemm.py)
    rung P3  the same GEMM on int4 weights (vpmaddubsw; vpdpbusd on VNNI)

The weights are random (speed does not depend on their values), built straight in
stage 1's storage formats (quant.Weight), never as fp32 matrices. Each rung is
warmed up once (compilation), then timed over --tokens tokens (a new random
activation each); the median is reported.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numba
import numpy as np
from numba import njit, prange

from bench.common import NeighbourMeter, check_load, machine_description, rungs_table, save_json
from bench.cpu import SHAPES
from stage1_cpu import fast, matmul
from stage1_cpu.fast import cpu
from stage1_cpu.jit.numba_cache import set_threads
from stage1_cpu.quant import Weight, _padded

GROUP = 32      # stage 1's default group size (options.py)


# ------------------------------------------------------------------ rungs 1-2: dequantize, then multiply

@njit(parallel=True, cache=True, error_model="numpy")
def dequant_int8(q, s, out):
    """q [O, G, gs] int8, s [O, G] fp16 bits -> out [O, G, gs] f32 = q * s, rows over threads.
    With one thread this is the plain loop; the fp32 matrix it writes is 4x the int8 one,
    and the matvec that follows reads it back: 9 bytes of traffic per weight instead of ~1."""
    for r in prange(q.shape[0]):
        for g in range(q.shape[1]):
            sc = matmul.f16_to_f32(s[r, g])
            for j in range(q.shape[2]):
                out[r, g, j] = np.float32(q[r, g, j]) * sc


def dequant_then_matmul(w: Weight, x: np.ndarray, buf: np.ndarray) -> np.ndarray:
    """Rungs 1-2: the whole matrix to fp32 (into buf), then the fp32 matvec (matmul.matmul_f32)."""
    O, Kp = w.out_features, w.padded_in
    wf = buf[: O * Kp].reshape(O, Kp)                     # [O, Kp] f32
    dequant_int8(w.data, w.scales, wf.reshape(O, -1, w.group_size))
    out = np.empty((1, O), dtype=np.float32)
    matmul.matmul_f32(w._pad(x), wf, out)
    return out


# ------------------------------------------------------------------ the model's matrices

def model_matrices(shape, fmt: str, rng: np.random.Generator) -> list[Weight]:
    """Every matrix one decode token multiplies, in stage 1's layout, random: per layer
    wqkv [(H+2Hkv)D, C], wo [C, HD], w_gate_up [2F, C], w_down [C, F]; then the lm_head
    [V, C], kept in int8 when the layers are int4 (as stage 1's loader keeps it)."""
    C, H, Hkv, D, F = (shape.hidden_size, shape.num_attention_heads, shape.num_key_value_heads,
                       shape.head_dim, shape.intermediate_size)
    per_layer = [((H + 2 * Hkv) * D, C), (C, H * D), (2 * F, C), (C, F)]
    mats = [random_weight(O, K, fmt, rng) for _ in range(shape.num_hidden_layers) for O, K in per_layer]
    return mats + [random_weight(shape.vocab_size, C, "int8", rng)]


def random_weight(O: int, K: int, fmt: str, rng: np.random.Generator) -> Weight:
    """A random Weight in stage 1's int8 / int4 layout (quant.py), made without an fp32 copy."""
    Kp = _padded(K, fmt, GROUP)
    G = Kp // GROUP
    scales = (rng.random((O, G), dtype=np.float32) * 1e-3 + 1e-3).astype(np.float16).view(np.uint16)
    if fmt == "int8":
        data = rng.integers(-127, 128, size=(O, G, GROUP), dtype=np.int8)
        return Weight("int8", O, K, GROUP, data, scales=scales)
    data = rng.integers(0, 256, size=(O, G // 2, GROUP), dtype=np.uint8)
    mins = (-8 * scales.view(np.float16).astype(np.float32)).astype(np.float16).view(np.uint16)
    return Weight("int4", O, K, GROUP, data, scales=scales, mins=mins)


# ------------------------------------------------------------------ timing

def time_matrices(step, mats: list, T: int, reps: int, rng: np.random.Generator) -> list[float]:
    """ms per token of step(w, x [T, K]) over all matrices, a new random activation each pass (as
    each decode token is new): one warm-up pass (compiles, packs), then `reps` timed ones."""
    xs = {K: rng.standard_normal((reps + 1, T, K), dtype=np.float32) for K in {w.in_features for w in mats}}
    times = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        for w in mats:
            step(w, xs[w.in_features][r])
        if r:                                              # pass 0 compiles / warms up
            times.append(1e3 * (time.perf_counter() - t0) / T)
    return times


def time_rungs(rungs: list, T: int, reps: int, rng: np.random.Generator, log=print) -> list[dict]:
    """Each rung (name, weights, threads, matrices, step) timed by time_matrices -> a row of the
    saved JSON: the median ms per token (T=1: decode) or per prompt token, and the weight bytes
    and multiply-adds of one pass over the matrices (for GB/s and GMAC/s)."""
    rows, key = [], "ms_per_token" if T == 1 else "ms_per_prompt_token"
    for i, (name, fmt, n, mats, step) in enumerate(rungs):
        set_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        ms = time_matrices(step, mats, T, reps, rng)
        rows.append({"rung": i + 1 if T == 1 else f"P{i + 1}", "what": name, "weights": fmt, "threads": n,
                     "mb_per_token": sum(w.nbytes for w in mats) / 1e6, key: statistics.median(ms),
                     "macs": sum(w.out_features * w.in_features for w in mats)})
        log(f"  {name}: {rows[-1][key]:.3f} ms per {'token' if T == 1 else 'prompt token'} (min {min(ms):.3f}, "
            f"max {max(ms):.3f})")
    return rows


def prefill_rungs(shape, threads: int, log=print) -> list:
    """Rungs P1-P3 (the module's doc) on the layers' matrices (the lm_head left out)."""
    rng = np.random.default_rng(1)
    int8 = model_matrices(shape, "int8", rng)[:-1]
    rungs = [("plain: dequantize an fp32 tile, BLAS sgemm", "int8", int8)]
    if cpu.INT8:
        rungs.append(("+ int8 activations, integer GEMM with register tiles (fast/gemm.py)", "int8",
                      [fast.as_fast(w, "int8", "int8") for w in int8]))
        rungs.append(("+ int4 weights, the same GEMM (vpmaddubsw, vpdpbusd on VNNI)", "int4",
                      [fast.as_fast(w, "int8", "int8") for w in model_matrices(shape, "int4", rng)[:-1]]))
    else:
        log("the fast path has no int8 dot product on this target: its prefill rungs are left out")
    return [(name, fmt, threads, mats, lambda w, x: w.matmul(x)) for name, fmt, mats in rungs]


def decode_rungs(shape, threads: int, log=print) -> list:
    """Rungs 1-5 (the module's doc) on every matrix of one decode token."""
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    int8 = model_matrices(shape, "int8", rng)
    int4 = model_matrices(shape, "int4", rng)
    log(f"built the random matrices in {time.perf_counter() - t0:.1f} s")
    biggest = max(w.out_features * w.padded_in for w in int8)
    buf = np.empty(biggest, dtype=np.float32)               # the fp32 copy of rungs 1-2, reused
    buf.fill(0.0)                                            # touch its pages outside the timing

    rungs = [
        ("1 thread, dequantize to fp32 then multiply", "int8", 1, int8,
         lambda w, x: dequant_then_matmul(w, x, buf)),
        (f"+ prange threads ({threads})", "int8", threads, int8, lambda w, x: dequant_then_matmul(w, x, buf)),
        ("+ fused dequantization (matmul.matmul_int8)", "int8", threads, int8, lambda w, x: w.matmul(x)),
        ("+ int4 weights (matmul.matmul_int4)", "int4", threads, int4, lambda w, x: w.matmul(x)),
    ]
    if cpu.INT8:
        fast4 = [fast.as_fast(w, **fast.choose_act(w.fmt, "auto", w.in_features, lm_head=i == len(int4) - 1))
                 for i, w in enumerate(int4)]
        isa = {"vnni": "VNNI", "avx2": "AVX2 vpmaddubsw"}[cpu.INT8]
        rungs.append((f"+ int8 activations, {isa} (stage1_cpu/fast)", "int4", threads, fast4,
                      lambda w, x: w.matmul(x)))
    else:
        log("the fast path has no int8 dot product on this target: its rung is left out")
    return rungs


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench ladder", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small model of bench cpu --quick (4 layers, C=512)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has (faster, less memory)")
    p.add_argument("--threads", type=int, default=None, help="threads of rungs 2+ (default: all, at most 2)")
    p.add_argument("--tokens", type=int, default=5, help="timed tokens per rung (default 5)")
    p.add_argument("--prefill-tokens", type=int, default=128, help="tokens, 0: none (default 128)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown tables to this file")
    p.add_argument("--save", type=Path, default=None,
                   help="also write the rows as JSON (docs/figures/stage1_ladder.json: python -m bench figures)")
    args = p.parse_args(argv)
    args.argv = argv
    args.threads = args.threads or min(2, numba.config.NUMBA_NUM_THREADS)
    if args.threads < 1 or args.tokens < 1:
        p.error("--threads and --tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    shape = SHAPES["quick" if args.quick else "0.6b"]
    if args.layers:
        shape = replace(shape, num_hidden_layers=args.layers, name=f"{shape.name}, {args.layers} layers")
    log = lambda s: print(s, flush=True)  # noqa: E731
    log(check_load("before"))
    load0, meter = os.getloadavg()[0], NeighbourMeter()
    rows = time_rungs(decode_rungs(shape, args.threads, log), 1, args.tokens, np.random.default_rng(0), log)
    T = args.prefill_tokens
    prefill = time_rungs(prefill_rungs(shape, args.threads, log), T, 3, np.random.default_rng(1), log) if T else []
    others = meter.cores_used_by_others()
    text = "\n".join([
        f"### Ablation ladder: {shape.name}, decode matmuls of one token", "",
        "- command: `" + " ".join(["python -m bench ladder", *args.argv]) + "`",
        f"- machine: {machine_description()}; numba target {cpu.target_name()} ({cpu.instructions()})",
        f"- OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; 1-minute load before {load0:.2f}; other "
        f"processes used {others:.2f} cores on average" + ("  **busy: numbers may be low**" if others > 0.25 else ""),
        f"- {shape.num_hidden_layers} layers × (wqkv, wo, w_gate_up, w_down) + lm_head [{shape.vocab_size}, "
        f"{shape.hidden_size}], group size {GROUP}; median of {args.tokens} tokens after one warm-up", "",
        rungs_table(rows, "ms_per_token", "GB/s"), ""] + ([
        f"Prefill ladder: a {T}-token prompt through every layer's matrices (no lm_head), median of 3 after one "
        "warm-up", "", rungs_table(prefill, "ms_per_prompt_token", "GMAC/s"), ""]
        if prefill else []))
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
    if args.save:                      # (a rung's MACs, and a prefill rung's bytes, are for the table only)
        save_json(args.save, "python -m bench ladder " + " ".join(args.argv),
                  rows=[{k: r[k] for k in ("rung", "what", "weights", "threads", "mb_per_token", "ms_per_token")}
                        for r in rows],
                  prefill=[{k: r[k] for k in ("rung", "what", "weights", "threads", "ms_per_prompt_token")}
                           for r in prefill])
    return 0


if __name__ == "__main__":
    sys.exit(main())
