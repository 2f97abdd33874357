"""Prefill GEMM: the int8-activation GEMM (stage1_cpu/fast/gemm.py) against today's
prefill (dequantize ROW_BLOCK rows to fp32, BLAS sgemm), on the Qwen3-0.6B matrices,
interleaved in one run, and the integer / fp32 peak of the instructions they use.

    OMP_WAIT_POLICY=PASSIVE python -m bench.prefill_gemm [--reps 5] [--tokens 32 128 512] [--act int8|int16]
        [--save docs/figures/stage1_prefill_gemm.json]   (python -m bench figures draws it)

Prints, per format and prompt length, the best of --reps of one layer's four
matmuls (wqkv, wo, gate_up, down; lm_head left out: it runs on the last token only)
as layer-matmul tokens per second and GMAC/s, the same GEMM on a layout repacked once
beforehand (BuiltOnce: what repacking 64 rows at a time in every call costs), and
where AVX-512 BF16 exists the bf16 prefill GEMM (fast/kernels.py) on the same matrices
beside them; then the peak micro-benchmarks, 12 independent chains on each thread:
vpmaddwd (int16 pairs, what the AVX2 pairs tile issues, alone and with its vpaddd),
vpmaddubsw (the AVX2 quads tile), vfmadd231ps (what sgemm issues), and where they
exist vpdpwssd / vpdpbusd (the VNNI tiles) and vdpbf16ps (the bf16 GEMM); then each
tile alone (tile_alone: no repack, no rounding, its block in cache), so that the steps
from the instruction's peak to the tile, and from the tile to the GEMM, each have a
figure. --act int16 measures what --activations auto runs (int4 weights then on the
pairs tile too).
"""
from __future__ import annotations

import argparse
import functools
import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

# Qwen3-0.6B: hidden 1024, 16 q heads + 2 x 8 kv heads of 128, MLP 3072
CHAINS = 12                   # more than latency x throughput of each instruction (Zen 3: 3 x 2, 4 x 2)
SHAPES = {"wqkv": (4096, 1024), "wo": (1024, 2048), "w_gate_up": (6144, 1024), "w_down": (1024, 3072)}


def _peak_kernel(kind):
    V8I, V16S, V32B, V8F = (ir.VectorType(ir.IntType(32), 8), ir.VectorType(ir.IntType(16), 16),
                            ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.FloatType(), 8))

    @intrinsic
    def chains(typingctx, n, seed):
        """CHAINS independent chains of n steps of one instruction; returns a lane so nothing folds."""
        sig = types.float32(types.int64, types.float32)

        def codegen(context, builder, signature, args):
            n_, seed_ = args
            fn = cgutils.get_or_insert_function
            if kind == "fma":
                f = fn(builder.module, ir.FunctionType(V8F, [V8F] * 3), "llvm.fma.v8f32")
                a = builder.insert_element(ir.Constant(V8F, None), seed_, ir.Constant(ir.IntType(32), 0))
                accs = [cgutils.alloca_once_value(builder, a) for _ in range(CHAINS)]
                with cgutils.for_range(builder, n_):
                    for acc in accs:
                        builder.store(builder.call(f, [a, a, builder.load(acc)]), acc)
                tot = builder.load(accs[0])
                for acc in accs[1:]:
                    tot = builder.fadd(tot, builder.load(acc))
                return builder.extract_element(tot, ir.Constant(ir.IntType(32), 0))
            s = builder.fptosi(seed_, ir.IntType(16))
            a16 = builder.insert_element(ir.Constant(V16S, [1] * 16), s, ir.Constant(ir.IntType(32), 0))
            accs = [cgutils.alloca_once_value(builder, builder.bitcast(a16, V8I)) for _ in range(CHAINS)]
            if kind == "dpbf16":                 # AVX-512 BF16: 32 bf16 pairs into 16 fp32 lanes (a zmm register)
                from stage1_cpu.fast.simd import BF16S32, FLOATS16
                f = fn(builder.module, ir.FunctionType(FLOATS16, [FLOATS16, BF16S32, BF16S32]),
                       "llvm.x86.avx512bf16.dpbf16ps.512")
                a = builder.insert_element(ir.Constant(FLOATS16, None), seed_, ir.Constant(ir.IntType(32), 0))
                b = builder.bitcast(a, BF16S32)
                accs = [cgutils.alloca_once_value(builder, a) for _ in range(CHAINS)]
                with cgutils.for_range(builder, n_):
                    for acc in accs:
                        builder.store(builder.call(f, [builder.load(acc), b, b]), acc)
                tot = builder.load(accs[0])
                for acc in accs[1:]:
                    tot = builder.fadd(tot, builder.load(acc))
                return builder.extract_element(tot, ir.Constant(ir.IntType(32), 0))
            if kind in ("dpwssd", "dpbusd", "dpwssd+fma"):   # VNNI: the multiply-add and its accumulate in one
                f = fn(builder.module, ir.FunctionType(V8I, [V8I] * 3), f"llvm.x86.avx512.vp{kind[:6]}.256")
                b = builder.bitcast(a16, V8I)
                fma = fn(builder.module, ir.FunctionType(V8F, [V8F] * 3), "llvm.fma.v8f32")
                fl = builder.sitofp(b, V8F)
                faccs = [cgutils.alloca_once_value(builder, fl) for _ in range(CHAINS // 3 if "fma" in kind else 0)]
                with cgutils.for_range(builder, n_):
                    for acc in accs:
                        builder.store(builder.call(f, [builder.load(acc), b, b]), acc)
                    for acc in faccs:     # dpwssd+fma: 1 FMA per 3 vpdpwssd, as a tile's epilogue adds them
                        builder.store(builder.call(fma, [fl, fl, builder.load(acc)]), acc)
                if faccs:
                    tot = builder.load(accs[0])
                    for acc in faccs:
                        tot = builder.add(tot, builder.bitcast(builder.load(acc), V8I))
                    builder.store(tot, accs[0])
            elif kind in ("maddwd", "maddwd+add"):
                f = fn(builder.module, ir.FunctionType(V8I, [V16S, V16S]), "llvm.x86.avx2.pmadd.wd")
                with cgutils.for_range(builder, n_):
                    for acc in accs:          # a dependent chain each: nothing to hoist or fold
                        v = builder.load(acc)
                        prod = builder.call(f, [builder.bitcast(v, V16S), a16])
                        # maddwd+add: the int8 tile's pair, acc += vpmaddwd(..), a vpaddd per vpmaddwd
                        builder.store(builder.add(v, prod) if kind == "maddwd+add" else prod, acc)
            else:            # maddubs into int16, as the int4 tile does
                f = fn(builder.module, ir.FunctionType(V16S, [V32B, V32B]), "llvm.x86.avx2.pmadd.ub.sw")
                b = builder.bitcast(a16, V32B)
                with cgutils.for_range(builder, n_):
                    for acc in accs:
                        v = builder.bitcast(builder.load(acc), V32B)
                        builder.store(builder.bitcast(builder.call(f, [v, b]), V8I), acc)
            tot = builder.load(accs[0])
            for acc in accs[1:]:
                tot = builder.add(tot, builder.load(acc))
            return builder.sitofp(builder.extract_element(tot, ir.Constant(ir.IntType(32), 0)), ir.FloatType())

        return sig, codegen

    @njit(parallel=True)
    def run(n, threads):
        out = np.zeros(threads, dtype=np.float32)
        for i in prange(threads):
            out[i] = chains(n, np.float32(i + 1))
        return out

    return run


def peak(kind: str, threads: int, n: int = 20_000_000) -> float:
    """Multiply-adds per second of `kind` (8 chains of n instructions per thread)."""
    run = _peak_kernel(kind)
    run(1000, threads)
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        run(n, threads)
        best = min(best, time.perf_counter() - t0)
    per_instr = {"fma": 8, "maddwd": 16, "maddwd+add": 16, "maddubs": 32, "dpwssd": 16, "dpbusd": 32,
                 "dpbf16": 32, "dpwssd+fma": 16}[kind]          # dpwssd+fma: vpdpwssd's multiply-adds only
    return CHAINS * n * threads * per_instr / best


def pairs_tile(fmt: str, act: str, vnni: bool = False) -> bool:
    """Whether gemm.py runs fmt on the pairs tile (vpmaddwd, each with the vpaddd that accumulates it, or
    vpdpwssd on VNNI): int8 weights, but for int8 activations on VNNI (the quads tile tile_int8_q8), and int4
    ones on int16 activations; int4 on int8 activations takes the quads tile (vpmaddubsw, vpdpbusd on VNNI)."""
    return act == "int16" or (fmt == "int8" and not vnni)


def ceiling(fmt: str, act: str, vnni: bool) -> str:
    """The peak() kind that bounds fmt's tile: the instruction it issues per multiply-add step."""
    if pairs_tile(fmt, act, vnni):
        return "dpwssd" if vnni else "maddwd+add"
    return "dpbusd" if vnni else "maddubs"


def tile_block(fmt: str, act: str):
    """gemm.py's block loop for fmt on act activations, and whether it runs the quads layout (4 values a
    lane: int4 on int8 activations, and int8 on int8 ones on VNNI, as q + 128: tile_int8_q8)."""
    from stage1_cpu.fast import gemm
    quads = not pairs_tile(fmt, act, gemm.VNNI)
    if fmt == "int8":
        return (gemm.block_int8_q8 if quads else gemm.block_int8), quads
    return (gemm.block_int4 if quads else gemm.block_int4_16), quads


class BuiltOnce:
    """A FastWeight's integer GEMM on its layout repacked once, here, instead of 64 rows at a time in every
    call (gemm._gemm_int8 / _gemm_int4): the same rounding, the same tiles, the same bits (checked against
    w.matmul in main). Against "int8 gemm" it is what the per-call repack costs, and what keeping the layout
    would buy, at the price of a second copy of the weights beside the one decode reads."""

    def __init__(self, w, act: str):
        from stage1_cpu.fast import gemm
        self.O, self.act = w.out_features, act
        block, quads = tile_block(w.fmt, act)
        data, s = np.ascontiguousarray(w.data).reshape(self.O, -1), np.ascontiguousarray(w.scales).view(np.uint16)
        word = data.view(np.uint32 if quads else (np.int16 if w.fmt == "int8" else np.uint16))
        G, Kp, RB = s.shape[1], s.shape[1] * w.group_size, gemm.BLOCK_RB
        nv = -(-self.O // 8)                                      # 8-row vectors, RB to a block
        nb = -(-nv // RB)
        self.W = np.empty((nb, RB * 8 * Kp // word.itemsize), dtype=word.dtype)
        self.S = np.empty((nb, RB * G * 8), dtype=np.uint16)
        if w.fmt == "int8":
            self.M = self.S
            _builders()[0](word, s, 0x80808080 if quads else 0, self.W, self.S)
        else:
            self.M = np.empty_like(self.S)
            _builders()[1](word, s, np.ascontiguousarray(w.mins).view(np.uint16), w.group_size, self.W, self.S, self.M)
        self.run = _runner(block)
        self.quads, self.fmt, self.gs = quads, w.fmt, w.group_size

    def matmul(self, x: np.ndarray) -> np.ndarray:
        from stage1_cpu.fast import gemm
        T = x.shape[0]
        x3 = x.reshape(T, -1, self.gs)                                        # [T, G, gs]
        out = np.empty((T, 8 * -(-self.O // 8)), dtype=np.float32)
        if self.act == "int16":
            xq, xs, xsum = gemm.round_prompt16(x3)
        else:
            xq, xs, xsum, xcorr = gemm.round_prompt8(x3)
            if self.fmt == "int8":
                xq, xsum = (xq, xcorr) if self.quads else (xq.astype(np.int16), xs)
        self.run(xq, xs, xsum, self.W, self.S, self.M, self.O, out)
        return out if out.shape[1] == self.O else np.ascontiguousarray(out[:, :self.O])


@functools.cache
def _builders():
    """The repack of every block of a matrix at once, on all threads (gemm's repack_int8 / repack_int4)."""
    from stage1_cpu.fast.gemm import BLOCK_RB, repack_int4, repack_int8

    @njit(parallel=True)
    def build_int8(q, s, flip, W, S):
        for blk in prange(W.shape[0]):
            repack_int8(q, s, 8 * BLOCK_RB * blk, W[blk], S[blk], flip)

    @njit(parallel=True)
    def build_int4(b, s, m, gs, W, S, M):
        for blk in prange(W.shape[0]):
            repack_int4(b, s, m, gs, 8 * BLOCK_RB * blk, W[blk], S[blk], M[blk])
    return build_int8, build_int4


@functools.cache
def _runner(block):
    """The prange over the built blocks for one tile kind (gemm._gemm_int8's loop, less the repack)."""
    from stage1_cpu.fast.gemm import BLOCK_RB, prefetch_rows

    @njit(parallel=True)
    def run(x, xs, xsum, W, S, M, O, out):
        T, G, gs = x.shape
        xf, xsf, xsumf, of = x.reshape(-1), xs.reshape(-1), xsum.reshape(-1), out.reshape(-1)
        nv_all = -(-O // 8)
        for blk in prange(W.shape[0]):
            prefetch_rows(W, blk + 1, blk + 2)            # as the GEMM prefetches its next block's rows
            block(W[blk], xf, S[blk], xsf, M[blk], xsumf, G, gs, of, out.shape[1], 8 * BLOCK_RB * blk,
                  min(BLOCK_RB, nv_all - blk * BLOCK_RB), T)
    return run


def tile_alone(fmt: str, act: str, threads: int, K: int = 1024, T: int = 128, gs: int = 32, reps: int = 7) -> float:
    """Multiply-adds per second of the tile loops alone (gemm.block_*): each thread runs T tokens through
    one repacked block of 64 rows again and again, its weights in cache, with no repack, no rounding and no
    Python call per matrix; the GEMM's figure against this one is what those cost."""
    block, quads = tile_block(fmt, act)
    q8 = fmt == "int8" and quads                                  # tile_int8_q8: q + 128 in the quads layout
    G, rows = K // gs, 64
    rng = np.random.default_rng(1)
    word = np.uint32 if quads else np.int16                      # 4 values a lane, or 2
    if fmt == "int8":                                            # int8 values (q + 128 for the quads tile)
        wl = rng.integers(-127, 128, (threads, rows * K), dtype=np.int8).view(word)
    else:                                                        # nibbles 0..15, one a byte
        wl = rng.integers(0, 16, (threads, rows * K), dtype=np.uint8).view(word)
    x = rng.integers(-127, 128, T * K, dtype=np.int8)            # the quads tiles read int8 activations,
    if not quads:                                                # the pairs tiles int16 (int8 ones widened)
        x = x.astype(np.int16) if act == "int8" else rng.integers(-32767, 32768, T * K, dtype=np.int16)
    s, xs = rng.random(rows * G).astype(np.float16).view(np.uint16), rng.random(T * G, dtype=np.float32)
    xcorr = rng.integers(-2 ** 20, 2 ** 20, T * G, dtype=np.int32) if q8 else xs   # tile_int8_q8's correction
    out = np.zeros((threads, T * rows), dtype=np.float32)

    @njit(parallel=True)
    def run(n, wl, x, s, xs, xsum, out, G, gs, T):   # the sizes as arguments: as constants LLVM unrolls the tile worse
        for i in prange(wl.shape[0]):
            for _ in range(n):
                block(wl[i], x, s, xs, s, xsum, G, gs, out[i], rows, 0, rows // 8, T)

    run(1, wl, x, s, xs, xcorr, out, G, gs, T)
    n = max(1, int(4e8 / (rows * K * T)))
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        run(n, wl, x, s, xs, xcorr, out, G, gs, T)
        best = min(best, time.perf_counter() - t0)
    return threads * n * rows * K * T / best


def main(argv=None) -> None:
    import numba

    from stage1_cpu.fast import cpu
    from stage1_cpu.fast.weight import fast_quantize

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--formats", nargs="+", default=["int8", "int4"])
    ap.add_argument("--act", default="int8", choices=["int8", "int16"],
                    help="the GEMM's activations: int8 (--activations int8) or int16 (--activations auto's)")
    ap.add_argument("--save", default=None, help="also write the results as JSON (for python -m bench figures)")
    args = ap.parse_args(argv)
    if not cpu.INT8:
        raise SystemExit(f"no int8 dot product on this target ({cpu.instructions()}): nothing to compare")
    import os
    import sys
    rng = np.random.default_rng(0)
    rows, load0 = [], os.getloadavg()[0]
    print(f"threads {numba.get_num_threads()}, {cpu.instructions()}, group size {args.group_size}, "
          f"{args.act} activations")
    engines = ["sgemm", "int8 gemm", "built once"] + (["bf16"] if cpu.BF16 else [])   # bf16: auto's before, on such CPUs
    vnni = cpu.INT8 == "vnni"
    for fmt in args.formats:
        mats = {k: rng.standard_normal(s, dtype=np.float32) * 0.02 for k, s in SHAPES.items()}
        weights = {"sgemm": {k: fast_quantize(w, fmt, args.group_size) for k, w in mats.items()},
                   "int8 gemm": {k: fast_quantize(w, fmt, args.group_size, prefill_act=args.act) for k, w in mats.items()},
                   "bf16": {k: fast_quantize(w, fmt, args.group_size, prefill_act="bf16") for k, w in mats.items()}
                   if cpu.BF16 else {}}
        weights["built once"] = {k: BuiltOnce(w, args.act) for k, w in weights["int8 gemm"].items()}
        for T in args.tokens:
            xs = {k: rng.standard_normal((T, s[1]), dtype=np.float32) for k, s in SHAPES.items()}
            for k, w in weights["built once"].items():           # the same arithmetic: the same bits
                if not np.array_equal(w.matmul(xs[k]), weights["int8 gemm"][k].matmul(xs[k])):
                    raise SystemExit(f"the layout built once gives other bits than the GEMM ({fmt}, {k}, T={T})")
            macs = T * sum(o * k for o, k in SHAPES.values())
            best = {name: 1e9 for name in engines}
            for rep in range(args.reps + 1):                     # the first round warms up, uncounted
                for name in engines:
                    t0 = time.perf_counter()
                    for k, w in weights[name].items():
                        w.matmul(xs[k])
                    dt = time.perf_counter() - t0
                    if rep:
                        best[name] = min(best[name], dt)
            row = ", ".join(f"{n} {T / t:7.1f} tok/s {macs / t / 1e9:5.1f} GMAC/s" for n, t in best.items())
            print(f"{fmt} T={T:4d}: {row}  ({best['sgemm'] / best['int8 gemm']:.2f}x sgemm, built once "
                  f"{best['int8 gemm'] / best['built once']:.2f}x the GEMM"
                  + (f", {best['bf16'] / best['int8 gemm']:.2f}x bf16)" if cpu.BF16 else ")"), flush=True)
            rows.append(dict(format=fmt, tokens=T, **{f"{n.replace(' ', '_')}_gmac_s": macs / t / 1e9
                                                      for n, t in best.items()}))
    th = numba.get_num_threads()
    peaks = {}
    kinds = ["maddwd", "maddwd+add", "maddubs", "fma"] + (["dpwssd", "dpwssd+fma", "dpbusd"] if vnni else []) + \
        (["dpbf16"] if cpu.BF16 else [])
    for kind in kinds:
        peaks[kind] = peak(kind, th) / 1e9
        print(f"peak {kind:10s} {peaks[kind]:6.1f} GMAC/s on {th} threads")
    names = {"maddwd+add": "vpmaddwd+vpaddd", "maddubs": "vpmaddubsw", "dpwssd": "vpdpwssd", "dpbusd": "vpdpbusd"}
    tile_peak = {fmt: ceiling(fmt, args.act, vnni) for fmt in args.formats}
    alone = {}
    for r in rows:            # each against the instruction its tile issues per multiply-add step
        kind = tile_peak[r["format"]]
        r["int8_gemm_of_peak"] = r["int8_gemm_gmac_s"] / peaks[kind]
        r["sgemm_of_peak"] = r["sgemm_gmac_s"] / peaks["fma"]
        bf16 = f", bf16 {100 * r['bf16_gmac_s'] / peaks['dpbf16']:.0f} % of vdpbf16ps's" if cpu.BF16 else ""
        print(f"{r['format']} T={r['tokens']:4d}: integer gemm {100 * r['int8_gemm_of_peak']:.0f} % of "
              f"{names[kind]}'s peak, sgemm {100 * r['sgemm_of_peak']:.0f} % of the FMA peak{bf16}")
    for fmt in args.formats:  # the same tiles with nothing around them: what the GEMM's loops and repack cost
        alone[fmt] = tile_alone(fmt, args.act, th, gs=args.group_size) / 1e9
        print(f"{fmt} tile alone (a 64-row block in cache, T=128, K=1024, repeated): {alone[fmt]:5.1f} GMAC/s, "
              f"{100 * alone[fmt] / peaks[tile_peak[fmt]]:.0f} % of {names[tile_peak[fmt]]}'s peak", flush=True)
    print(f"1-minute load before {load0:.2f}, after {os.getloadavg()[0]:.2f}")
    if args.save:
        import json
        from pathlib import Path

        from bench.common import machine_description
        from stage1_cpu.fast import gemm
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps({
            "command": "python -m bench.prefill_gemm " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_description(),
            "threads": th, "load": [load0, os.getloadavg()[0]], "group_size": args.group_size, "act": args.act,
            "tile": {"int8": [gemm.RB8 * 8, gemm.TT8], "int4": [gemm.RB4 * 8, gemm.TT4]},
            "ceiling": tile_peak, "peaks_gmac_s": peaks, "tile_alone_gmac_s": alone, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
