"""python -m bench lessons [--save FILE] [--layers N] [--throughput --workdir DIR]: the stage 2 -> 3 ladder.

Each rung of docs/lessons/stage3/ (stage 2 plus the first k patches, built by
course/series.py as a package of its own) runs with device="cpu" on its numpy twins,
a fixed small workload, while the launchers and the twins are counted:

  * workload: a random Qwen3 model with Qwen3-0.6B's depth and attention shape (28 layers,
    16 query heads, 8 KV heads, head dim 128) and a small hidden size, MLP and vocabulary
    (128, 384, 1024: the counts of launches, KV bytes and attention FLOPs are 0.6B's; the
    weight bytes are the small model's); request A (64 prompt tokens) is prefilled, then
    three requests sharing its first 48 tokens are prefilled in one step, then one decode
    step of the four sequences is counted;
  * launches and GEMMs per decode step: every call of a kernels.py launcher (decode
    attention counts two where the rung has the split kernel and its merge) and of
    Weight.matmul (one GEMM each) during the decode step; copies and gathers cupy runs on
    its own (RoPE row gathers, slicing) are not counted;
  * bytes read per decode token: the weight matrices the GEMMs read plus the K/V rows decode
    attention reads (context x Hkv x D x 2 x bytes per value, times the group size G where
    the kernel reads the rows once per query head, stage 2's), divided by the 4 tokens;
  * prefill tokens computed (the prefix cache skips the shared pages) and prefill attention
    FLOPs of those two prefill steps (4 x visible positions x H x D per token: QK^T and PV);
  * the GPU time of the decode step predicted by the napkin maths of docs/stage3.md (H200):
    bytes at 4.8 TB/s, each kernel ~1 us apart on the GPU, each host launch ~8 us from
    Python (eager), the step the larger of the GPU and host times; with CUDA graphs (rung
    5 on) a decode step is ~10 host calls. Prefill attention at fp32 CUDA-core peak
    (~67 TFLOP/s) for the plain kernel, ~100 TFLOP/s (the middle of the 50-150 predicted)
    on tensor cores.

--throughput adds the measured column: output tok/s per rung on a reduced nano-vllm-style
workload (bench/gpu.py's workload(): random ids, prompt and output lengths uniform in
--min-len..--max-len, EOS ignored, all requests at once, bench/gpu.py's _throughput()),
the model bench/gpu.py's setup step writes into --workdir (Qwen3-0.6B's shape, random bf16
weights; reused if there). On a GPU (CuPy sees one): 32 sequences of 32..128 tokens,
device="cuda"; without one: a dry run of the plumbing on the numpy twins, bench/gpu.py's
tiny model and 3 sequences of 4..12 tokens. Each rung has --rung-cap-s seconds (a rung cut
there reports the rate of the tokens it produced, marked partial) and all of it ends by
--deadline-s from the start (counting included): a rung left without its cap is
"skipped: out of time", not a failure. bench/gpu_check.sh runs it (step 4c).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HBM_BPS = 4.8e12
KERNEL_GAP_S = 1e-6
HOST_LAUNCH_S = 8e-6
GRAPH_HOST_CALLS = 10
PLAIN_FLOPS, TC_FLOPS = 67e12, 100e12
WORKLOAD = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                hidden_size=128, intermediate_size=384, vocab_size=1024)


def _series():
    spec = importlib.util.spec_from_file_location("qs_lesson_series", ROOT / "course" / "series.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Counter:
    """Wraps a rung's launchers and Weight.matmul; counts launches, GEMMs, bytes and FLOPs."""

    def __init__(self, pkg: str):
        self.K = importlib.import_module(f"{pkg}.kernels")
        self.W = importlib.import_module(f"{pkg}.weights")
        self.split = "merge_attention" in self.K.KERNEL_FILES      # GQA-shared split kernel + merge
        self.tc = "prefill_attention_tc" in self.K.KERNEL_FILES
        self.reset()
        names = [n for n in dir(self.K) if callable(getattr(self.K, n)) and not n.startswith("_")
                 and n not in ("to_host", "decode_shared_bytes") and getattr(getattr(self.K, n), "__module__", "")
                 == self.K.__name__]
        for n in names:
            setattr(self.K, n, self._wrap(n, getattr(self.K, n)))
        matmul = self.W.Weight.matmul
        counter = self

        def counted(w, x, *a, **kw):
            counter.gemms += 1
            counter.weight_bytes += int(w.data.nbytes)
            return matmul(w, x, *a, **kw)
        self.W.Weight.matmul = counted

    def reset(self):
        self.kernels = self.gemms = self.weight_bytes = self.kv_bytes = 0
        self.attn_flops = 0.0
        self.tc_flops = 0.0

    def _wrap(self, name, fn):
        def counted(*a, **kw):
            if name == "linear":
                return fn(*a, **kw)                    # counted in Weight.matmul (stage 3 calls it from there)
            out = fn(*a, **kw)
            if name == "paged_decode_attention":
                q, k_cache, _, _, ctx = a[:5]
                S, H, D = q.shape
                Hkv = k_cache.shape[2]
                reads = 1 if self.split else H // Hkv
                self.kv_bytes += int(ctx.sum()) * Hkv * D * 2 * k_cache.dtype.itemsize * reads
                self.kernels += 2 if self.split else 1
            elif name == "prefill_attention":
                q, positions = a[0], a[5]
                N, H, D = q.shape
                flops = 4.0 * float((positions.astype(float) + 1).sum()) * H * D
                self.attn_flops += flops
                if self.tc and len(a) > 6 and a[6] is not None and D % 16 == 0 and D <= 128:
                    self.tc_flops += flops
                self.kernels += 1
            else:
                self.kernels += 1
            return out
        return counted


def run_rung(pkg: str, folder: Path) -> dict:
    from common.engine import Request
    from common.sampling import SamplingParams
    c = Counter(pkg)
    engine = importlib.import_module(f"{pkg}.engine")
    eng = engine.LLMEngine(folder, max_ctx=256, slots=8, token_budget=512, page_size=16, num_pages=64,
                           device="cpu", progress=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    shared = [(7 * i) % 1000 + 3 for i in range(48)]
    c.reset()
    eng.add_request(Request("a", shared + list(range(100, 116)), params))
    eng.step()                                          # A's prefill
    for i in range(3):
        eng.add_request(Request(f"b{i}", shared + list(range(200 + 16 * i, 216 + 16 * i)), params))
    eng.step()                                          # A decodes; the three prefill (cache hits from A)
    attn_flops, tc_flops = c.attn_flops, c.tc_flops
    prefill_tokens = int(eng.num_prefill_tokens)
    c.reset()
    t0 = time.perf_counter()
    eng.step()                                          # one decode step: 4 sequences, one token each
    cpu_s = time.perf_counter() - t0
    tokens = 4
    launches = c.kernels + c.gemms
    step_bytes = c.weight_bytes + c.kv_bytes
    gpu_s = step_bytes / HBM_BPS + launches * KERNEL_GAP_S
    graphs = hasattr(importlib.import_module(f"{pkg}.engine"), "DecodeGraphs")
    host_s = (GRAPH_HOST_CALLS if graphs else launches) * HOST_LAUNCH_S
    plain_flops = attn_flops - tc_flops
    row = dict(kernels_per_decode_step=c.kernels, gemms_per_decode_step=c.gemms,
                launches_per_decode_step=launches, host_launches_per_decode_step=GRAPH_HOST_CALLS if graphs
                else launches, weight_bytes_per_token=c.weight_bytes // tokens,
                kv_bytes_per_token=c.kv_bytes // tokens, bytes_per_token=step_bytes // tokens,
                prefill_tokens_computed=prefill_tokens, prefill_attention_flops=attn_flops,
                predicted_decode_step_us=round(max(gpu_s, host_s) * 1e6, 1),
                predicted_prefill_attention_us=round((plain_flops / PLAIN_FLOPS + tc_flops / TC_FLOPS) * 1e6, 3),
                cpu_s=round(cpu_s, 2))
    while eng.has_work():
        eng.step()
    return row


def model_folder(layers: int) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from models import make_model
    return make_model("qwen3", **dict(WORKLOAD, num_hidden_layers=layers))


class OutOfTime(Exception):
    pass


def gpu_present() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:                                   # no CuPy, no driver, no device
        return False


def throughput_rung(pkg: str, folder: Path, dev: str, prompts, outputs, cap_s: float, workdir: Path) -> dict:
    """One rung on the workload, by bench/gpu.py's _throughput; a step past cap_s stops it
    (the partial rate _throughput wrote every 2 s is reported)."""
    from bench import gpu
    engine = importlib.import_module(f"{pkg}.engine")
    t0 = time.perf_counter()
    kw = (dict(max_ctx=512, slots=64, token_budget=4096, page_size=16, kv_memory=2 * 2**30) if dev == "cuda"
          else dict(max_ctx=256, slots=8, token_budget=512, page_size=16, num_pages=64))
    eng = engine.LLMEngine(folder, device=dev, progress=False, **kw)
    load_s = time.perf_counter() - t0
    end = t0 + cap_s
    step = eng.step

    def capped():
        if time.perf_counter() > end:
            raise OutOfTime
        return step()
    eng.step = capped
    partial = workdir / f"lessons-{pkg}.partial.json"
    partial.unlink(missing_ok=True)
    try:
        r = gpu._throughput(eng, prompts, outputs, dev, partial)
        r["status"] = "ok"
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
    from bench import gpu
    dev = "cuda" if gpu_present() else "cpu"
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    folder = Path(args.model_folder) if args.model_folder else \
        Path(gpu.step_setup(argparse.Namespace(workdir=str(workdir), dry_run=dev == "cpu"))["folder"])
    seqs = args.seqs or (32 if dev == "cuda" else 3)
    lo, hi = (args.min_len or 32, args.max_len or 128) if dev == "cuda" else (args.min_len or 4, args.max_len or 12)
    prompts, outputs = gpu.workload(seqs, min_len=lo, max_len=hi)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = [[t % vocab for t in p] for p in prompts]
    print(f"[lessons] throughput on {dev}: {seqs} sequences, lengths {lo}..{hi}, model {folder}", flush=True)
    out = []
    for pkg in pkgs:
        left = started + args.deadline_s - time.perf_counter()
        cap = min(args.rung_cap_s, left)
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


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lessons", description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", type=Path, help="write the rows as JSON (e.g. docs/figures/lessons.json)")
    ap.add_argument("--layers", type=int, default=WORKLOAD["num_hidden_layers"],
                    help="layers of the workload model (default 28, Qwen3-0.6B's; fewer: a quicker check)")
    ap.add_argument("--throughput", action="store_true",
                    help="also measure output tok/s per rung (a GPU if CuPy sees one, else a CPU dry run)")
    ap.add_argument("--workdir", default=None, help="--throughput: where bench.gpu's model folder is (re)used")
    ap.add_argument("--model-folder", default=None, help="--throughput: this model instead of bench.gpu's")
    ap.add_argument("--seqs", type=int, default=None, help="--throughput: sequences (default 32 on a GPU, 3 on CPU)")
    ap.add_argument("--min-len", type=int, default=None, help="--throughput: shortest prompt / output (32; CPU 4)")
    ap.add_argument("--max-len", type=int, default=None, help="--throughput: longest prompt / output (128; CPU 12)")
    ap.add_argument("--rung-cap-s", type=float, default=20.0, help="--throughput: seconds per rung")
    ap.add_argument("--deadline-s", type=float, default=600.0,
                    help="--throughput: the whole run ends by then; rungs left without their cap are skipped")
    args = ap.parse_args()
    started = time.perf_counter()
    if args.throughput and args.workdir is None and args.model_folder is None:
        ap.error("--throughput needs --workdir (bench.gpu's model folder goes there) or --model-folder")
    series = _series()
    folder = model_folder(args.layers)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rungs = series.unpack(Path(tmp) / "rungs")
        sys.path.insert(0, str(Path(tmp) / "pkgs"))
        for k, rung in enumerate(rungs):
            pkg = f"qs_bench_rung{k:02d}"
            shutil.copytree(rung, Path(tmp) / "pkgs" / pkg)
            row = dict(rung=k, name=rung.name, **run_rung(pkg, folder))
            rows.append(row)
        if args.throughput:
            # fresh copies: the counted packages' launchers are wrapped (and the wrappers sync the GPU)
            for k, rung in enumerate(rungs):
                shutil.copytree(rung, Path(tmp) / "pkgs" / f"qs_bench_tp_rung{k:02d}")
            for row, r in zip(rows, throughput_all([f"qs_bench_tp_rung{k:02d}" for k in range(len(rows))],
                                                   args, started)):
                row["throughput"] = r
                row["output_tok_s"] = round(r["tok_s"], 1) if r.get("tok_s") else None
    cols = [("rung", "rung"), ("name", "name"), ("kernels/step", "kernels_per_decode_step"),
            ("GEMMs/step", "gemms_per_decode_step"), ("host launches", "host_launches_per_decode_step"),
            ("weight B/tok", "weight_bytes_per_token"), ("KV B/tok", "kv_bytes_per_token"),
            ("prefill tok", "prefill_tokens_computed"), ("prefill attn MFLOP", "prefill_attention_flops"),
            ("pred. decode µs", "predicted_decode_step_us"), ("pred. attn µs", "predicted_prefill_attention_us")]
    if args.throughput:
        dev = rows[0]["throughput"]["device"]
        cols.append((f"output tok/s ({dev})", "output_tok_s"))

    def cell(r, k):
        if k == "prefill_attention_flops":
            return f"{r[k] / 1e6:.1f}"
        if k == "output_tok_s":
            t = r["throughput"]
            return str(r[k]) if t["status"] == "ok" else f"{r[k] or '—'} ({t['status']})"
        return str(r[k])
    print("| " + " | ".join(h for h, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(cell(r, k) for _, k in cols) + " |")
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps(dict(
            command="python -m bench lessons" + (f" --layers {args.layers}" if args.layers != 28 else "")
            + (" --throughput" if args.throughput else ""),
            date=time.strftime("%Y-%m-%d"), workload=dict(WORKLOAD, num_hidden_layers=args.layers),
            rows=rows), indent=1) + "\n")
        print(f"saved {args.save}")
    if args.throughput and any(r["throughput"]["status"].startswith("failed") for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
