"""python -m bench lessons [--save FILE] [--layers N] [--throughput --workdir DIR]: the stage 2 -> 3 ladder.

Each rung of the lesson series (stage 2 plus the first k patches of docs/lessons/stage3/,
built by course/series.py as a package of its own) is counted on the CPU, on a random Qwen3
with Qwen3-0.6B's depth and attention shape and a small hidden size, MLP and vocabulary:
request A (64 prompt tokens) is prefilled, three requests sharing its first 48 tokens are
prefilled in one step, then one decode step of the four is counted, twice per rung:

  * on the numpy twins: the prefill tokens computed (the prefix cache skips shared pages),
    their attention FLOPs, and the K/V bytes the decode step reads;
  * on the tests' stand-in CuPy (bench/testbed/cuda_emulator.py): the host's calls in that decode
    step by kind, priced with the per-call costs measured on the GPU machine
    (bench/host_costs.json) into a predicted host time, and the activation bytes its
    kernels write (every array a kernels.py wrapper returns, a conversion to bf16
    included); a rung with CUDA graphs eagerly and as a graph replay.

The predicted decode step is the larger of the host time and the GPU time (the weight and
K/V bytes, and the activations written and read back, at HBM_BPS, plus KERNEL_GAP_S per
kernel): docs/stage3.md's napkin maths. --throughput adds output tok/s per rung, measured
on a GPU (else on the numpy twins with bench/gpu.py's tiny model): --seqs requests of
random ids, all at once, each rung under --rung-cap-s (a rung cut there reports its rate
so far, marked partial), all of it within --deadline-s.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench import gpu
from bench.common import markdown_table, save_json
from bench.testbed import cuda_emulator as emu      # the stand-in CuPy and its count of host calls
from bench.testbed.models import make_model
from common.engine import Request
from common.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent

HBM_BPS = 4.8e12                      # the H200's datasheet bandwidth
KERNEL_GAP_S = 1e-6                   # per kernel on the GPU, launched back to back
PLAIN_FLOPS, TC_FLOPS = 67e12, 100e12  # prefill attention: fp32 CUDA cores' peak; tensor cores, the
                                       # middle of the 50-150 TFLOP/s docs/stage3.md predicts
COSTS = json.loads((Path(__file__).with_name("host_costs.json")).read_text())
WORKLOAD = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                hidden_size=128, intermediate_size=384, vocab_size=1024)
ENGINE = dict(max_ctx=256, slots=8, token_budget=512, page_size=16, num_pages=64, progress=False)


def load(name: str, path: Path):
    """The file, or the package in the folder, at `path`, imported as module `name`:
    course/series.py (bench/ and course/ stand side by side: neither imports the other), or a
    rung of the series."""
    folder = [str(path)] if path.is_dir() else None
    spec = importlib.util.spec_from_file_location(name, path / "__init__.py" if folder else path,
                                                  submodule_search_locations=folder)
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def host_us(calls: dict) -> float:
    """Counted calls -> predicted host microseconds (bench/host_costs.json's prices)."""
    return round(sum(n * COSTS["us"][kind] for kind, n in calls.items() if kind in COSTS["us"]), 1)


def _requests(eng, counted):
    """The workload: A's prefill, three cache hits prefilled together, then `counted()` around
    one decode step of the four; the rest of the run finishes them. Sampled (temperature 0.8,
    top-p 0.9, seeded), so that a rung that samples on the host copies the logits back."""
    params = lambda seed: SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=6,  # noqa: E731
                                         ignore_eos=True)
    shared = [(7 * i) % 1000 + 3 for i in range(48)]
    eng.add_request(Request("a", shared + list(range(100, 116)), params(0)))
    eng.step()
    for i in range(3):
        eng.add_request(Request(f"b{i}", shared + list(range(200 + 16 * i, 216 + 16 * i)), params(i + 1)))
    eng.step()
    out = counted()
    while eng.has_work():
        eng.step()
    return out


def twin_counts(pkg: str, folder: Path) -> dict:
    """device="cpu": prefill tokens and attention FLOPs of the two prefill steps, K/V bytes and
    weight bytes of the decode step."""
    K = importlib.import_module(f"{pkg}.kernels")
    split = "merge_attention" in K.KERNEL_FILES                   # one read of K/V per GQA group
    tc = "prefill_attention_tc" in K.KERNEL_FILES
    seen = dict(kv=0, flops=0.0, tc_flops=0.0)
    decode, prefill = K.paged_decode_attention, K.prefill_attention

    def counted_decode(q, k_cache, v_cache, tables, ctx, *a, **kw):
        H, Hkv = q.shape[1], k_cache.shape[2]
        seen["kv"] += int(ctx.sum()) * Hkv * q.shape[2] * 2 * k_cache.dtype.itemsize * (1 if split else H // Hkv)
        return decode(q, k_cache, v_cache, tables, ctx, *a, **kw)

    def counted_prefill(q, *a, **kw):
        flops = 4.0 * float((a[4].astype(float) + 1).sum()) * q.shape[1] * q.shape[2]
        seen["flops"] += flops
        tiles = a[5] if len(a) > 5 else kw.get("tile_start")
        if tc and tiles is not None and q.shape[2] % 16 == 0 and q.shape[2] <= 128:
            seen["tc_flops"] += flops                              # the tensor-core kernel's share
        return prefill(q, *a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K, "paged_decode_attention", counted_decode)
        mp.setattr(K, "prefill_attention", counted_prefill)
        eng = importlib.import_module(f"{pkg}.engine").LLMEngine(folder, device="cpu", **ENGINE)

        def step():
            flops, tc_flops, prefill_tokens = seen["flops"], seen["tc_flops"], int(eng.num_prefill_tokens)
            seen["kv"] = 0
            eng.step()
            return dict(prefill_tokens_computed=prefill_tokens, prefill_attention_flops=flops,
                        predicted_prefill_attention_us=round(((flops - tc_flops) / PLAIN_FLOPS
                                                              + tc_flops / TC_FLOPS) * 1e6, 3),
                        kv_bytes_per_token=seen["kv"] // 4, weight_bytes_per_token=eng.weights.decode_nbytes // 4)
        return _requests(eng, step)


# kernels.py's functions that write no activation: host work and launch arithmetic
NOT_WRITERS = {"route", "to_host", "decode_splits", "decode_shared_bytes"}


def _writers(K) -> list:
    """The rung's kernel wrappers: the public functions kernels.py defines, less NOT_WRITERS."""
    return [(name, fn) for name, fn in vars(K).items()
            if inspect.isfunction(fn) and fn.__module__ == K.__name__ and not name.startswith("_")
            and name not in NOT_WRITERS]


def _counting(fn, seen: dict):
    """fn, adding the bytes of the array it returns to seen["written"]: what the decode step's
    kernels write between them (a wrapper that calls another counts both, as both write)."""
    def counted(*a, **kw):
        r = fn(*a, **kw)
        seen["written"] += int(getattr(r, "nbytes", 0))
        return r
    return counted


def host_counts(pkg: str, folder: Path, graphs: bool) -> dict:
    """The host's calls in the decode step, device="cuda" on the stand-in CuPy (counted, not run),
    and (eager) the bytes its kernel wrappers write ("written").
    graphs: the step as a replay of its captured graph (the rung's DecodeGraphs)."""
    engine = importlib.import_module(f"{pkg}.engine")
    K = importlib.import_module(f"{pkg}.kernels")
    seen = dict(written=0)
    with pytest.MonkeyPatch.context() as mp:
        emu.install(mp, K, None, execute=False)
        for name, fn in _writers(K) if not graphs else []:
            mp.setattr(K, name, _counting(fn, seen))
        mp.setattr(engine, "array_module", lambda device: sys.modules["cupy"])
        kw = dict(enforce_eager=not graphs) if hasattr(engine, "DecodeGraphs") else {}
        eng = engine.LLMEngine(folder, device="cuda", **ENGINE, **kw)

        def step():
            if graphs:                                   # the bucket's warm-up and capture first
                eng.step()
            before, to_host = emu.STATE.calls.as_dict(), emu.STATE.calls.bytes_to_host
            seen["written"] = 0
            eng.step()
            calls = {k: v - before[k] for k, v in emu.STATE.calls.as_dict().items()}
            return dict(calls, bytes_to_host=emu.STATE.calls.bytes_to_host - to_host,
                        **({} if graphs else dict(written=seen["written"])))
        calls = _requests(eng, step)
        if graphs:
            assert eng.graphs is not None and eng.graphs.num_replays >= 1 and eng.graphs.error is None, eng.graphs.error
    return calls


def count_rung(pkg: str, folder: Path) -> dict:
    row = twin_counts(pkg, folder)
    eager = host_counts(pkg, folder, graphs=False)
    row["activation_bytes_per_token"] = eager.pop("written") // 4
    row.update(host_calls=eager, host_us=host_us(eager))
    has_graphs = hasattr(importlib.import_module(f"{pkg}.engine"), "DecodeGraphs")
    if has_graphs:
        graph = host_counts(pkg, folder, graphs=True)
        row.update(graph_host_calls=graph, graph_host_us=host_us(graph))
    kernels = eager["launches"] + eager["blas"] + eager["elementwise"]
    # the weights and K/V read, the activations written and read back
    read = (row["weight_bytes_per_token"] + row["kv_bytes_per_token"]
            + 2 * row["activation_bytes_per_token"])
    gpu_us = (read * 4 / HBM_BPS + kernels * KERNEL_GAP_S) * 1e6
    row["predicted_decode_step_us"] = round(max(gpu_us, row.get("graph_host_us", row["host_us"])), 1)
    return row


def gpu_present() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:                                   # no CuPy, no driver, no device
        return False


class OutOfTime(Exception):
    pass


def throughput_rung(pkg: str, folder: Path, dev: str, prompts, outputs, cap_s: float, workdir: Path) -> dict:
    """One rung on the workload, by bench/gpu.py's _throughput; a step past cap_s stops it
    (the partial rate _throughput wrote every 2 s is reported)."""
    engine = importlib.import_module(f"{pkg}.engine")
    t0 = time.perf_counter()
    kw = (dict(max_ctx=1024, slots=64, token_budget=4096, page_size=16, kv_memory=4 * 2**30) if dev == "cuda"
          else dict(max_ctx=256, slots=8, token_budget=512, page_size=16, num_pages=64))
    eng = engine.LLMEngine(folder, device=dev, progress=False, **kw)
    load_s, end, step = time.perf_counter() - t0, t0 + cap_s, eng.step

    def capped():
        if time.perf_counter() > end:
            raise OutOfTime
        return step()
    eng.step = capped
    partial = workdir / f"lessons-{pkg}.partial.json"
    partial.unlink(missing_ok=True)
    try:
        r = dict(gpu._throughput(eng, prompts, outputs, dev, partial), status="ok")
    except OutOfTime:
        r = json.loads(partial.read_text()) if partial.is_file() else dict(output_tokens=0, tok_s=None)
        r["status"] = f"timed out after {cap_s:.0f} s" + (" (partial)" if r.get("tok_s") else "")
    r["load_s"] = round(load_s, 2)
    del eng
    gc.collect()
    if dev == "cuda":
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
    return r


def throughput_all(pkgs: list[str], args, started: float) -> list[dict]:
    dev = "cuda" if gpu_present() else "cpu"
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    folder = gpu._model(argparse.Namespace(workdir=str(workdir), dry_run=dev == "cpu"),
                        gpu.TINY if dev == "cpu" else gpu.QWEN3_06B, "qwen3-0.6b-random")
    # sequences, prompt lengths, output lengths: a GPU's, or the CPU dry run's
    seqs, lens, outs = (args.seqs or 32, (384, 640), (32, 96)) if dev == "cuda" else (args.seqs or 3, (4, 12), (4, 12))
    prompts, _ = gpu.workload(seqs, min_len=lens[0], max_len=lens[1])
    _, outputs = gpu.workload(seqs, seed=1, min_len=outs[0], max_len=outs[1])
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = [[t % vocab for t in p] for p in prompts]
    print(f"[lessons] throughput on {dev}: {seqs} sequences, prompts {lens[0]}..{lens[1]}, outputs "
          f"{outs[0]}..{outs[1]}, model {folder}", flush=True)
    out = []
    for pkg in pkgs:
        cap = min(args.rung_cap_s, started + args.deadline_s - time.perf_counter())
        if cap < args.rung_cap_s / 2:
            out.append(dict(status="skipped: out of time", tok_s=None, output_tokens=0))
        else:
            try:
                out.append(throughput_rung(pkg, folder, dev, prompts, outputs, cap, workdir))
            except Exception as e:                      # one rung's failure: its row says so, the rest run
                out.append(dict(status=f"failed: {type(e).__name__}: {e}"[:200], tok_s=None, output_tokens=0))
        out[-1].update(device=dev, requested_tokens=sum(outputs))
        print(f"[lessons] {pkg}: {out[-1]['status']}, tok/s {out[-1]['tok_s']}", flush=True)
    return out


COLUMNS = [("rung", "rung"), ("name", "name"), ("launches", "launches"), ("cuBLAS", "blas"),
           ("allocs", "allocations"), ("elementwise", "elementwise"), ("copies", "copies"), ("syncs", "syncs"),
           ("B to host", "bytes_to_host"), ("host µs (eager)", "host_us"), ("host µs (graph)", "graph_host_us"),
           ("weight B/tok", "weight_bytes_per_token"), ("KV B/tok", "kv_bytes_per_token"),
           ("act. B/tok", "activation_bytes_per_token"),
           ("prefill tok", "prefill_tokens_computed"), ("prefill attn MFLOP", "prefill_attention_flops"),
           ("pred. attn µs", "predicted_prefill_attention_us"), ("pred. decode µs", "predicted_decode_step_us")]


DOCS_COLUMNS = [c for c in COLUMNS if c[1] not in ("prefill_attention_flops", "predicted_prefill_attention_us")]


def table(rows: list[dict], columns: list = COLUMNS) -> str:
    """The ladder as a markdown table (docs/stage3.md's is DOCS_COLUMNS of the saved JSON)."""
    cols = columns + ([(f"output tok/s ({rows[0]['throughput']['device']})", "output_tok_s")]
                      if "throughput" in rows[0] else [])

    def cell(r, k):
        if k in emu.HostCalls.KINDS or k == "bytes_to_host":
            return str(r["host_calls"][k])
        if k == "prefill_attention_flops":
            return f"{r[k] / 1e6:.1f}"
        if k == "output_tok_s":
            t = r["throughput"]
            return str(r[k]) if t["status"] == "ok" else f"{r[k] or '—'} ({t['status']})"
        return str(r.get(k, "—"))
    return markdown_table([h for h, _ in cols], [[cell(r, k) for _, k in cols] for r in rows])


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lessons", description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", type=Path, help="write the rows as JSON (e.g. docs/figures/lessons.json)")
    ap.add_argument("--layers", type=int, default=WORKLOAD["num_hidden_layers"],
                    help="layers of the counting model (default 28, Qwen3-0.6B's; fewer: a quicker check)")
    ap.add_argument("--throughput", action="store_true",
                    help="also measure output tok/s per rung (a GPU if CuPy sees one, else a CPU dry run)")
    ap.add_argument("--workdir", default=None, help="--throughput: where bench.gpu's model folder is (re)used")
    ap.add_argument("--seqs", type=int, default=None, help="--throughput: sequences (default 32 on a GPU, 3 on CPU; "
                    "prompts of 384..640 tokens and outputs of 32..96, on CPU 4..12 and 4..12)")
    ap.add_argument("--rung-cap-s", type=float, default=20.0,
                    help="--throughput: seconds per rung (default 20)")
    ap.add_argument("--deadline-s", type=float, default=600.0,
                    help="--throughput: the whole run ends by then; rungs left without their cap "
                         "are skipped (default %(default)g)")
    args = ap.parse_args()
    started = time.perf_counter()
    if args.throughput and args.workdir is None:
        ap.error("--throughput needs --workdir (bench.gpu's model folder goes there)")
    folder = make_model("qwen3", **dict(WORKLOAD, num_hidden_layers=args.layers))
    with tempfile.TemporaryDirectory() as tmp:
        rungs = load("qs_lesson_series", ROOT / "course" / "series.py").unpack(Path(tmp) / "rungs")
        pkgs = [load(f"qs_bench_rung{k:02d}", rung).__name__ for k, rung in enumerate(rungs)]
        rows = [dict(rung=k, name=rung.name, **count_rung(pkg, folder))
                for k, (rung, pkg) in enumerate(zip(rungs, pkgs))]
        if args.throughput:
            for row, r in zip(rows, throughput_all(pkgs, args, started)):
                row["throughput"] = r
                row["output_tok_s"] = round(r["tok_s"], 1) if r.get("tok_s") else None
    print(table(rows))
    print(f"(host µs: the counted calls x bench/host_costs.json, {COSTS['date']}, {COSTS['machine']})")
    if args.save:
        layers = f" --layers {args.layers}" if args.layers != 28 else ""
        command = "python -m bench lessons" + layers + (" --throughput" if args.throughput else "")
        save_json(args.save, command, workload=dict(WORKLOAD, num_hidden_layers=args.layers),
                  host_costs=COSTS, rows=rows)
        print(f"saved {args.save}")
    if args.throughput and any(r["throughput"]["status"].startswith("failed") for r in rows):
        return 1
    if args.throughput and any(r["throughput"]["status"] != "ok" for r in rows):
        return 3                                        # a rung not run (out of time): not a pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
