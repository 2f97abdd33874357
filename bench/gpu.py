"""python -m bench.gpu [--out DIR] [--deadline-s S] [--quick] [--dry-run]: the GPU stages
against transformers on one GPU, in one run that fits its deadline.

The workload is nano-vllm's bench.py: the Qwen3-0.6B shape with random weights,
256 sequences, input and output lengths uniform in 100..1024, EOS ignored, token
ids uniform in 0..10000. Each step runs in its own subprocess with its own time cap
(a crash or a timeout loses one cell, never the table; GPU memory is returned between
steps). The caps add up to --deadline-s, and the headline comes first:

  setup        write the random-weight model folder once (bf16 safetensors; the engines
               read it, stage 2 converts to fp32 on load) and measure the HBM bandwidth
               (a device-to-device copy) that the roofline uses
  full:NEWEST  the newest GPU stage on all 256 sequences: output tokens / s (nano-vllm's
               number). It gets what the other steps leave; if it runs out of time, the
               rate of the tokens it produced so far is reported, marked partial
  small:STAGE  every GPU stage on the stated subset (the first --subset-seqs sequences,
               outputs capped at --subset-tokens) and at batch 1 (128 prompt tokens,
               --b1-tokens new): decode tokens / s against the roofline
  small:hf     transformers generate() on the same subset (one left-padded batch) and at
               batch 1, fp32, on the same GPU

The GPU stages are found, not listed: a folder stage*/ with an engine.py and a cuda/
(stage2_batched today, stage3_optimized when its engine lands).

Napkin maths printed with it: one decode step of one sequence reads every weight
once (fp32: ~3 GB for Qwen3-0.6B incl. the tied embedding / lm_head), so batch-1
decode can not beat bandwidth / weight bytes tokens per second.

Differences from nano-vllm's bench, stated in the table: greedy sampling (stage 2
samples non-greedy requests on the host, which would time the host, not the GPU),
the weights in each stage's own dtype (stage 2 fp32, stage 3 bf16).

--dry-run checks this script's plumbing on a CPU: a tiny model, 4 sequences, the
stages on their numpy twins (device="cpu") and transformers on the CPU, with the same
steps, subprocesses, caps, partial results and table (tests/test_gpu_check.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Qwen3-0.6B's config.json (the architecture numbers; weights are random)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                 bos_token_id=151643, eos_token_id=151645)
# --dry-run: the same architecture, tiny
TINY = dict(QWEN3_06B, vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)

# seconds each step may take; full:NEWEST gets the rest of --deadline-s (at least FULL_MIN)
CAPS = {"setup": 25, "small": 15, "small:hf": 25}
FULL_MIN = 30
SLACK = 5                                              # process starts, the table


def gpu_stages() -> list[str]:
    """Package names of the GPU stages, newest first: stage*/ with an engine.py and a cuda/."""
    found = [p.name for p in ROOT.glob("stage*") if (p / "engine.py").is_file() and (p / "cuda").is_dir()]
    return sorted(found, reverse=True)


def plan(deadline_s: float, stages: list[str], scale: float = 1.0) -> dict[str, float]:
    """step -> cap in seconds, in run order; the caps add up to at most deadline_s (unless
    FULL_MIN does not fit). scale > 1 stretches the fixed caps (--dry-run on a slow CPU)."""
    steps = {"setup": CAPS["setup"] * scale}
    rest = {f"small:{s}": CAPS["small"] * scale for s in stages}
    rest["small:hf"] = CAPS["small:hf"] * scale
    full = max(FULL_MIN, deadline_s - SLACK - steps["setup"] - sum(rest.values()))
    steps[f"full:{stages[0]}"] = full
    steps.update(rest)
    return steps


def workload(num_seqs: int, seed: int = 0, min_len: int = 100, max_len: int = 1024):
    """nano-vllm's: random ids in 0..10000, input and output lengths uniform in min_len..max_len."""
    import numpy as np
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 10000, size=int(rng.integers(min_len, max_len + 1))).tolist()
               for _ in range(num_seqs)]
    outputs = [int(rng.integers(min_len, max_len + 1)) for _ in range(num_seqs)]
    return prompts, outputs


def the_workload(args):
    """The run's workload (tiny under --dry-run: ids must fit the tiny vocabulary)."""
    if args.dry_run:
        prompts, outputs = workload(args.num_seqs, min_len=4, max_len=24)
        return [[t % TINY["vocab_size"] for t in p] for p in prompts], outputs
    return workload(args.num_seqs)


def subset(args):
    prompts, outputs = the_workload(args)
    n = args.subset_seqs
    return prompts[:n], [min(o, args.subset_tokens) for o in outputs[:n]]


def b1_prompt(args) -> list[int]:
    prompts, _ = the_workload(args)
    return prompts[0][:128]


def device(args) -> str:
    return "cpu" if args.dry_run else "cuda"


def sync(dev: str) -> None:
    if dev == "cuda":
        import cupy
        cupy.cuda.Device().synchronize()


# ---------------------------------------------------------------------------
# steps (each runs in a fresh subprocess and returns a dict)
# ---------------------------------------------------------------------------

def step_setup(args) -> dict:
    """The random-weight model folder (reused if there), then the copy bandwidth."""
    import torch
    import transformers as tf
    folder = Path(args.workdir) / ("tiny-random" if args.dry_run else "qwen3-0.6b-random")
    t0 = time.perf_counter()
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        config = tf.Qwen3Config(**(TINY if args.dry_run else QWEN3_06B))
        with torch.device(device(args)):               # random init on the GPU: seconds, not minutes
            model = tf.Qwen3ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(folder)
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
        del model
    result = {"folder": str(folder), "model_s": time.perf_counter() - t0}
    result.update(bandwidth(device(args)))
    return result


def bandwidth(dev: str) -> dict:
    """Device-to-device copy, 2 GiB each way (16 MiB on the CPU): the median of 10."""
    if dev == "cpu":
        import numpy as np
        a = np.ones(2**22, np.float32)
        b = np.empty_like(a)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            b[...] = a
            times.append(time.perf_counter() - t0)
        return {"gbps": 2 * a.nbytes / sorted(times)[5] / 1e9, "gpu": "CPU (--dry-run)"}
    import cupy
    n = 2 * 2**30
    a = cupy.empty(n // 4, dtype=cupy.float32)
    b = cupy.empty_like(a)
    b[...] = a
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(10):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        b[...] = a
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return {"gbps": 2 * n / sorted(times)[5] / 1e9, "gpu": name,
            "memory_gib": cupy.cuda.Device().mem_info[1] / 2**30}


def _engine(stage: str, args, **kw):
    import importlib
    LLMEngine = importlib.import_module(f"{stage}.engine").LLMEngine
    return LLMEngine(args.model_folder, progress=False, device=device(args), **kw)


def _greedy(n: int):
    from common.sampling import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _throughput(eng, prompts, outputs, dev: str, partial: Path | None) -> dict:
    """All requests at once, run to the end: output tokens / s over the whole run."""
    from common.engine import Request
    eng.add_request(Request("warm", list(range(1, 40)), _greedy(4)))   # compile kernels, wake cuBLAS
    while eng.has_work():
        eng.step()
    sync(dev)
    steps0, pre0, dec0 = eng.num_steps, eng.num_prefill_tokens, eng.num_decode_tokens
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        eng.add_request(Request(str(i), p, _greedy(n)))
    produced, first_token_at, last_write = 0, None, 0.0
    t0 = time.perf_counter()
    while eng.has_work():
        events = eng.step()
        produced += sum(1 for e in events if e.token_id >= 0)
        now = time.perf_counter()
        if first_token_at is None and produced:
            first_token_at = now - t0
        if partial is not None and now - last_write > 2:      # a timed-out run still reports
            partial.write_text(json.dumps({"partial": True, "output_tokens": produced,
                                           "expected_tokens": sum(outputs), "seconds": now - t0,
                                           "tok_s": produced / (now - t0)}))
            last_write = now
    seconds = time.perf_counter() - t0
    return {"output_tokens": produced, "expected_tokens": sum(outputs), "seconds": seconds,
            "tok_s": produced / seconds, "steps": eng.num_steps - steps0,
            "prefill_tokens": eng.num_prefill_tokens - pre0, "decode_tokens": eng.num_decode_tokens - dec0,
            "preemptions": eng.num_preemptions, "pages": eng.num_total_pages(),
            "first_token_s": first_token_at, "weight_bytes": eng.weights.decode_nbytes}


def _b1(eng, args) -> dict:
    """One sequence: 128 prompt tokens, --b1-tokens new, 3 runs; decode speed = tokens after
    the first / their time; the median run."""
    from common.engine import Request
    rates = []
    for rep in range(3):
        eng.add_request(Request(f"b1-{rep}", b1_prompt(args), _greedy(args.b1_tokens)))
        stamps = []
        while eng.has_work():
            if eng.step():
                stamps.append(time.perf_counter())
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {"decode_tok_s": sorted(rates)[1], "runs": rates, "weight_bytes": eng.weights.decode_nbytes}


def step_full(args, stage: str) -> dict:
    prompts, outputs = the_workload(args)
    t0 = time.perf_counter()
    eng = _engine(stage, args, max_ctx=2048, slots=256, token_budget=args.token_budget, page_size=256)
    load_s = time.perf_counter() - t0
    result = _throughput(eng, prompts, outputs, device(args), Path(args.workdir) / f"full:{stage}.partial.json")
    return dict(result, load_s=load_s)


def step_small(args, stage: str) -> dict:
    if stage == "hf":
        return _hf_small(args)
    prompts, outputs = subset(args)
    eng = _engine(stage, args, max_ctx=2048, slots=256, token_budget=args.token_budget, page_size=256,
                  kv_memory=4 * 2**30)
    return {"subset": _throughput(eng, prompts, outputs, device(args), None), "b1": _b1(eng, args)}


def _hf_small(args) -> dict:
    """transformers generate(): the subset as one left-padded batch (each sequence's useful
    tokens are its own output length; the batch runs to the longest, the waste static
    batching pays for), then batch 1. Greedy, fp32."""
    import torch
    import transformers as tf
    dev = device(args)
    model = tf.AutoModelForCausalLM.from_pretrained(args.model_folder, dtype=torch.float32).to(dev).eval()
    sync_t = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    prompts, outputs = subset(args)
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):                     # left padding: every prompt ends at the same column
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    with torch.no_grad():
        model.generate(ids[:1, -16:], attention_mask=mask[:1, -16:], max_new_tokens=4, **kw)   # warm up
        sync_t()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=max(outputs), min_new_tokens=max(outputs), **kw)
        sync_t()
    seconds = time.perf_counter() - t0
    result = {"subset": {"useful_tokens": sum(outputs), "generated_tokens": len(prompts) * max(outputs),
                         "seconds": seconds, "tok_s": sum(outputs) / seconds}}
    one = torch.tensor([b1_prompt(args)]).to(dev)

    def timed(n):
        sync_t()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(one, max_new_tokens=n, min_new_tokens=n, **kw)
        sync_t()
        return time.perf_counter() - t0

    n = args.b1_tokens
    rates = [(n - 1) / (timed(n) - timed(1)) for _ in range(3)]
    result["b1"] = {"decode_tok_s": sorted(rates)[1], "runs": rates}
    return result


# ---------------------------------------------------------------------------
# the driver: every step in a subprocess with its cap, then the table
# ---------------------------------------------------------------------------

def run_step(name: str, args, cap_s: float) -> dict:
    safe = name.replace(":", "-")
    out = Path(args.workdir) / f"{safe}.json"
    partial = Path(args.workdir) / f"{name}.partial.json"
    for f in (out, partial):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.gpu", "--run", name, "--workdir", args.workdir,
           "--model-folder", args.model_folder or "", "--num-seqs", str(args.num_seqs),
           "--subset-seqs", str(args.subset_seqs), "--subset-tokens", str(args.subset_tokens),
           "--b1-tokens", str(args.b1_tokens), "--token-budget", str(args.token_budget)]
    cmd += ["--dry-run"] if args.dry_run else []
    t0 = time.perf_counter()
    print(f"[bench.gpu] {name} (at most {cap_s:.0f} s) ...", flush=True)
    try:
        r = subprocess.run(cmd, cwd=ROOT, timeout=cap_s, capture_output=True, text=True)
        log = r.stdout + r.stderr
        status = "ok" if r.returncode == 0 and out.is_file() else f"failed (exit {r.returncode})"
    except subprocess.TimeoutExpired as e:
        log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                      for x in (e.stdout, e.stderr))
        # its JSON written, the worker was only slow to exit (torch's teardown): a result
        status = "ok" if out.is_file() else f"timed out after {cap_s:.0f} s"
    (Path(args.workdir) / f"{safe}.log").write_text(log)
    result = json.loads(out.read_text()) if out.is_file() else {}
    if not result and partial.is_file():
        result = json.loads(partial.read_text())
    result["status"] = status
    result["wall_s"] = time.perf_counter() - t0
    print(f"[bench.gpu] {name}: {status} in {result['wall_s']:.0f} s", flush=True)
    if status != "ok":
        print("\n".join(log.strip().splitlines()[-15:]), flush=True)
    return result


def fmt(x, spec=".0f", unit="") -> str:
    return "—" if x is None else f"{x:{spec}}{unit}"


def table(res: dict, args, stages: list[str]) -> str:
    def get(step, *keys):
        d = res.get(step, {})
        for k in keys:
            d = d.get(k, {}) if isinstance(d, dict) else {}
        return None if d == {} else d

    def status(step):
        return res.get(step, {}).get("status", "not run")

    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "—"  # noqa: E731
    bw = get("setup", "gbps")
    full = f"full:{stages[0]}"
    hf_sub, hf_b1 = get("small:hf", "subset", "tok_s"), get("small:hf", "b1", "decode_tok_s")
    lines = [
        f"# GPU benchmark ({get('setup', 'gpu') or 'GPU'}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        ("Workload: nano-vllm's bench (Qwen3-0.6B shape, random weights, input and output lengths "
         "uniform in 100..1024, EOS ignored), greedy, each stage in its own dtype."
         if not args.dry_run else "--dry-run: a tiny random model on the CPU; the numbers mean nothing."),
        f"Subset: the first {args.subset_seqs} sequences, outputs capped at {args.subset_tokens} tokens. "
        f"Batch 1: 128 prompt tokens, {args.b1_tokens} new, the median of 3.",
        "",
        "| measurement | engine | tok/s | vs transformers | notes |",
        "|---|---|---|---|---|",
    ]
    partial = " (partial: out of time)" if get(full, "partial") else ""
    lines.append(f"| throughput, {args.num_seqs} seqs (output tok/s) | {stages[0]} | {fmt(get(full, 'tok_s'))} | — | "
                 f"{fmt(get(full, 'output_tokens'), 'd')} of {fmt(get(full, 'expected_tokens'), 'd')} tokens in "
                 f"{fmt(get(full, 'seconds'), '.1f')} s{partial}, {fmt(get(full, 'preemptions'), 'd')} preemptions; "
                 f"{status(full)} |")
    for s in stages:
        sub = get(f"small:{s}", "subset", "tok_s")
        lines.append(f"| throughput, subset (useful tok/s) | {s} | {fmt(sub)} | {ratio(sub, hf_sub)} | "
                     f"{status(f'small:{s}')} |")
    lines.append(f"| throughput, subset (useful tok/s) | transformers | {fmt(hf_sub)} | 1.00x | one padded batch; "
                 f"{status('small:hf')} |")
    for s in stages:
        b1 = get(f"small:{s}", "b1", "decode_tok_s")
        wbytes = get(f"small:{s}", "b1", "weight_bytes")
        roof = bw * 1e9 / wbytes if bw and wbytes else None
        lines.append(f"| batch-1 decode (tok/s) | {s} | {fmt(b1)} | {ratio(b1, hf_b1)} | roofline {fmt(roof)} tok/s "
                     f"({fmt(wbytes and wbytes / 1e9, '.2f')} GB of weights at {fmt(bw)} GB/s measured): "
                     f"{fmt(b1 and roof and 100 * b1 / roof, '.0f')}% |")
    lines.append(f"| batch-1 decode (tok/s) | transformers | {fmt(hf_b1)} | 1.00x | fp32 |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_results"),
                    help="folder for the table (gpu_bench.md, gpu_bench.json) and nothing else")
    ap.add_argument("--workdir", default=None,
                    help="model folder, per-step logs and JSON (default: a folder under the system's temp dir)")
    ap.add_argument("--deadline-s", type=float, default=130, help="all steps together stop after this")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--subset-seqs", type=int, default=8, help="sequences of the transformers comparison")
    ap.add_argument("--subset-tokens", type=int, default=128, help="output tokens per subset sequence, at most")
    ap.add_argument("--b1-tokens", type=int, default=64, help="new tokens of the batch-1 runs")
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="32 sequences: a smoke run")
    ap.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU: checks the plumbing")
    ap.add_argument("--cap-scale", type=float, default=None,
                    help="stretch the fixed step caps (default 1; 4 under --dry-run, where a busy CPU imports torch)")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)        # internal: one step, in this process
    ap.add_argument("--model-folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_seqs = min(args.num_seqs, 32)
    if args.cap_scale is None:
        args.cap_scale = 4.0 if args.dry_run else 1.0
    if args.dry_run:
        args.num_seqs = min(args.num_seqs, 4)
        args.subset_seqs, args.subset_tokens, args.b1_tokens = 2, 8, 8

    if args.run:                                       # a worker: do one step, write its JSON
        kind, _, stage = args.run.partition(":")
        result = step_setup(args) if kind == "setup" else globals()[f"step_{kind}"](args, stage)
        (Path(args.workdir) / f"{args.run.replace(':', '-')}.json").write_text(json.dumps(result))
        print(json.dumps(result))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.workdir = str(Path(args.workdir or Path(tempfile.gettempdir()) / "qs-bench-gpu").resolve())
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    stages = gpu_stages()
    if not stages:
        print("no GPU stage found (stage*/engine.py with a cuda/ folder)", file=sys.stderr)
        return 2
    steps = plan(args.deadline_s, stages, args.cap_scale)
    print(f"[bench.gpu] stages {', '.join(stages)}; caps "
          + ", ".join(f"{k} {v:.0f} s" for k, v in steps.items()) + f" (deadline {args.deadline_s:.0f} s)")
    t_end = time.perf_counter() + args.deadline_s
    res = {}
    for name, cap in steps.items():
        left = t_end - time.perf_counter() - 2
        if name != "setup" and not args.model_folder:
            res[name] = {"status": "skipped: the setup step made no model"}
            continue
        if left < 5:
            res[name] = {"status": OUT_OF_TIME}
            continue
        res[name] = run_step(name, args, min(cap, left))
        if name == "setup" and res[name].get("folder"):
            args.model_folder = res[name]["folder"]
        (out / "gpu_bench.json").write_text(json.dumps(res, indent=1))
    text = table(res, args, stages)
    (out / "gpu_bench.md").write_text(text)
    print(text)
    return exit_status([r.get("status", "") for r in res.values()])


OUT_OF_TIME = "skipped: out of time"


def exit_status(statuses: list[str]) -> int:
    """The steps' statuses -> the exit code: 1 when a step broke (failed, or skipped for a
    reason other than time: no model to run), else 3 when a step timed out or was skipped
    for lack of time (the table says which; gpu_check.sh reports it, not as a failure), else 0."""
    if any(s.startswith("failed") or (s.startswith("skipped") and s != OUT_OF_TIME) for s in statuses):
        return 1                                       # a step broke: a finding
    short = any(s.startswith("timed out") or s == OUT_OF_TIME for s in statuses)
    return 3 if short else 0                           # 3: only out of time


if __name__ == "__main__":
    sys.exit(main())
