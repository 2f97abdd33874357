"""python -m bench.gpu_stage3 [--out DIR] [--quick]: stage 3 on a GPU, the steps bench/gpu.py lacks.

bench/gpu.py already runs stage 3 on the full workload and the subset (it finds every
GPU stage); these are the stage-3 figures it does not measure. Each step runs in its own
subprocess (a crash or a timeout loses one cell, never the table); bench/gpu.py or
gpu_check.sh can call `run_steps()` / `table()` or `python -m bench.gpu_stage3`, which
writes gpu_stage3.md / .json.

  model        the Qwen3-0.6B-shaped random model (as bench/gpu.py's setup writes it)
  bandwidth    bench/gpu.py's device-to-device copy: the HBM bandwidth the roofline uses
  s3_ours      stage 3 on nano-vllm's workload (256 sequences, lengths 100..1024, greedy,
               EOS ignored): output tok/s, the number to compare with stage 2's "ours"
  s3_b1        stage 3, one sequence, 0.6B shape: decode tok/s and % of the HBM roofline
  s3_b1_eager  the same with --no-cuda-graphs (every kernel launched from Python): what
               the decode graphs save (docs/stage3.md, section 7)
  model_8b     a Qwen3-8B-shaped model with 4 of its 36 layers (hidden 4096, 32/8 heads x 128,
               MLP 12288, vocab 151936), random bf16 weights
  s3_b1_8b     stage 3, one sequence, on it: % of the HBM roofline (the issue's >= 70 % target)
  s3_attn      prefill attention alone: TFLOP/s of the tensor-core kernel and the plain one
  s3_prefix    a shared-system-prompt workload (a 1,000-token system prompt, 100-token
               questions): prefix-cache hit rate, and tok/s with the cache on and off

--deadline-s bounds the whole run (a step gets min(its cap, the time left) and is skipped
when less than 15 s are left); --model-folder reuses bench/gpu.py's 0.6B model and a
bench/gpu.py setup.json in --workdir gives the bandwidth without measuring it again
(bench/gpu_check.sh does both). --dry-run: the steps on the numpy twins with tiny models
(vocabulary 10240, so the workload's ids fit; the "8B" model is tiny too): checks the
plumbing on a CPU.

Napkin maths (docs/stage3.md has the derivations): the roofline of batch-1 decode is
HBM bandwidth / bytes per token (bf16 weights + the KV cache read), and attention
FLOPs are 4 * D * H * sum over queries of the positions each sees.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu import QWEN3_06B, bandwidth, workload  # noqa: E402

QWEN3_8B_4L = dict(QWEN3_06B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=4,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
STEPS = {"model": 150, "bandwidth": 40, "s3_b1": 60, "s3_b1_eager": 60, "model_8b": 120, "s3_b1_8b": 60,
         "s3_attn": 60, "s3_prefix": 90, "s3_ours": 240}
DEVICE = os.environ.get("BENCH_GPU_DEVICE", "cuda")     # cpu: a smoke test of this script on the twins
# --dry-run's models: tiny, with a vocabulary that holds the workload's ids (0..10000)
TINY_S3 = dict(QWEN3_06B, vocab_size=10240, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
TINY_S3_4L = dict(TINY_S3, num_hidden_layers=4, tie_word_embeddings=False)


def step_model(args) -> dict:
    """The Qwen3-0.6B-shaped random model (bench/gpu.py's setup writes the same one)."""
    import torch
    import transformers as tf
    folder = Path(args.workdir) / ("tiny-random-s3" if args.dry_run else "qwen3-0.6b-random")
    if (folder / "config.json").is_file():
        return {"folder": str(folder), "reused": True}
    torch.manual_seed(0)
    with torch.device("cuda" if DEVICE == "cuda" else "cpu"):
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**(TINY_S3 if args.dry_run else QWEN3_06B))).to(torch.bfloat16)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return {"folder": str(folder)}


def step_bandwidth(args) -> dict:
    return bandwidth(DEVICE)


def _sync():
    if DEVICE == "cuda":
        import cupy
        cupy.cuda.Device().synchronize()


def _engine(folder, **kw):
    from stage3_optimized.engine import LLMEngine
    return LLMEngine(folder, progress=False, device=DEVICE, **kw)


def _drive(eng, requests, partial: Path | None = None) -> dict:
    """Add (id, prompt, max_tokens) requests, step until done -> output tok/s and counters."""
    from common.engine import Request
    from common.sampling import SamplingParams
    steps0 = eng.num_steps
    for rid, prompt, n in requests:
        eng.add_request(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
    produced, last_write = 0, 0.0
    t0 = time.perf_counter()
    while eng.has_work():
        produced += sum(1 for e in eng.step() if e.token_id >= 0)
        now = time.perf_counter()
        if partial is not None and now - last_write > 5:       # a timed-out run still reports
            partial.write_text(json.dumps({"partial": True, "output_tokens": produced,
                                           "seconds": now - t0, "tok_s": produced / (now - t0)}))
            last_write = now
    _sync()
    seconds = time.perf_counter() - t0
    return {"output_tokens": produced, "seconds": seconds, "tok_s": produced / seconds,
            "steps": eng.num_steps - steps0, "preemptions": eng.num_preemptions}


def _warm(eng):
    _drive(eng, [("warm", list(range(1, 300)), 4)])


def step_s3_ours(args) -> dict:
    prompts, outputs = workload(args.num_seqs)
    eng = _engine(args.model_folder, max_ctx=2048, slots=256, token_budget=args.token_budget, page_size=256)
    _warm(eng)
    r = _drive(eng, [(str(i), p, n) for i, (p, n) in enumerate(zip(prompts, outputs))],
               Path(args.workdir) / "s3_ours.partial.json")
    r.update(expected_tokens=sum(outputs), weight_bytes=eng.weights.decode_nbytes, pages=eng.num_total_pages())
    return r


def _b1(folder, enforce_eager: bool = False) -> dict:
    """One sequence, 128 prompt tokens, 256 new: decode tok/s (tokens after the first / their time)
    and the bytes one step reads (weights + the mean KV context, bf16). enforce_eager: no CUDA graphs."""
    eng = _engine(folder, max_ctx=2048, slots=1, token_budget=2048, page_size=256, kv_memory=4 * 2**30,
                  enforce_eager=enforce_eager)
    prompt, _ = workload(1, seed=1)
    _warm(eng)
    from common.engine import Request
    from common.sampling import SamplingParams
    rates = []
    for rep in range(3):
        eng.add_request(Request(f"b1-{rep}", prompt[0][:128], SamplingParams(temperature=0.0, max_tokens=256,
                                                                           ignore_eos=True)))
        stamps = []
        while eng.has_work():
            if eng.step():
                stamps.append(time.perf_counter())
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    kv = eng.model.cache.nbytes_per_token * (128 + 128)          # the mean context of the decode steps
    graphs = eng.graphs
    return {"decode_tok_s": sorted(rates)[1], "runs": rates, "bytes_per_token": eng.weights.decode_nbytes + kv,
            "graph_replays": graphs.num_replays if graphs is not None else 0,
            "graph_error": graphs.error if graphs is not None else None}


def step_s3_b1(args) -> dict:
    return _b1(args.model_folder)


def step_s3_b1_eager(args) -> dict:
    return _b1(args.model_folder, enforce_eager=True)


def step_model_8b(args) -> dict:
    import torch
    import transformers as tf
    folder = Path(args.workdir) / _8b_name(args)
    if (folder / "config.json").is_file():
        return {"folder": str(folder), "reused": True}
    torch.manual_seed(0)
    with torch.device("cuda" if DEVICE == "cuda" else "cpu"):
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**(TINY_S3_4L if args.dry_run else QWEN3_8B_4L))).to(torch.bfloat16)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return {"folder": str(folder)}


def _8b_name(args) -> str:
    return "tiny-4layers-s3" if args.dry_run else "qwen3-8b-4layers-random"


def step_s3_b1_8b(args) -> dict:
    return _b1(str(Path(args.workdir) / _8b_name(args)))


def step_s3_attn(args) -> dict:
    """Prefill attention of 4 sequences x 2,048 tokens, Qwen3-0.6B's heads (16 / 8 x 128),
    pages of 256: TFLOP/s of the tensor-core kernel and of the plain one (median of 5)."""
    import numpy as np
    from stage3_optimized import kernels
    from stage3_optimized.batch import PREFILL_TILE
    from stage3_optimized.ops import bf16_bits
    S, T, H, Hkv, D, P = (4, 2048, 16, 8, 128, 256) if DEVICE == "cuda" else (1, 64, 4, 2, 64, 16)
    rng = np.random.default_rng(0)
    pages = S * T // P
    k = bf16_bits(rng.standard_normal((pages, P, Hkv, D)).astype(np.float32))
    v = bf16_bits(rng.standard_normal((pages, P, Hkv, D)).astype(np.float32))
    q = bf16_bits(rng.standard_normal((S * T, H, D)).astype(np.float32))
    tables = np.arange(pages, dtype=np.int32).reshape(S, T // P)
    token_seq = np.repeat(np.arange(S, dtype=np.int32), T)
    positions = np.tile(np.arange(T, dtype=np.int32), S)
    tile_start = np.arange(0, S * T, PREFILL_TILE, dtype=np.int32)
    tile_count = np.full(len(tile_start), PREFILL_TILE, np.int32)
    flops = 4 * D * H * S * (T * (T + 1) // 2)                 # QK^T and PV over the causal triangle
    xp = np if DEVICE == "cpu" else __import__("cupy")
    args_ = [xp.asarray(a) for a in (q, k, v, tables, token_seq, positions, tile_start, tile_count)]
    out = {"flops": flops}
    for name, tc in (("tensor_cores", True), ("plain", False)):
        times = []
        for _ in range(6):
            _sync()
            t0 = time.perf_counter()
            kernels.prefill_attention(*args_, tensor_cores=tc)
            _sync()
            times.append(time.perf_counter() - t0)
        best = sorted(times[1:])[2]                            # the first call compiles
        out[name] = {"seconds": best, "tflops": flops / best / 1e12}
    return out


def step_s3_prefix(args) -> dict:
    """64 requests: one 1,000-token system prompt, each with its own 100-token question, 32 new
    tokens each; the first request runs alone first (it fills the cache), then the other 63."""
    import numpy as np
    rng = np.random.default_rng(7)
    n = 64 if DEVICE == "cuda" else 4
    system = rng.integers(0, 10000, size=1000 if DEVICE == "cuda" else 40).tolist()
    reqs = [(f"p{i}", system + rng.integers(0, 10000, size=100 if DEVICE == "cuda" else 5).tolist(), 32)
            for i in range(n)]
    out = {}
    for label, on in (("on", True), ("off", False)):
        eng = _engine(args.model_folder, max_ctx=2048, slots=256, token_budget=8192, page_size=16,
                      enable_prefix_caching=on)
        _warm(eng)
        first = _drive(eng, reqs[:1])
        rest = _drive(eng, reqs[1:])
        cached = sum(eng.num_cached_tokens(r) for r, _, _ in reqs)
        out[label] = {"tok_s": rest["tok_s"], "seconds": first["seconds"] + rest["seconds"],
                      "hit_rate": cached / sum(len(p) for _, p, _ in reqs),   # the warm-up not counted
                      "cached_tokens": cached}
    return out


# ---------------------------------------------------------------------------
# the driver: every step in a subprocess with a timeout (bench/gpu.py's pattern), then the table
# ---------------------------------------------------------------------------

def run_step(name: str, args, budget_s: float) -> dict:
    out, partial = Path(args.workdir) / f"{name}.json", Path(args.workdir) / f"{name}.partial.json"
    for f in (out, partial):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.gpu_stage3", "--run", name, "--workdir", args.workdir,
           "--model-folder", args.model_folder or "", "--num-seqs", str(args.num_seqs),
           "--token-budget", str(args.token_budget)] + (["--dry-run"] if args.dry_run else [])
    t0 = time.perf_counter()
    print(f"[bench.gpu_stage3] {name} (at most {budget_s:.0f} s) ...", flush=True)
    try:
        r = subprocess.run(cmd, cwd=ROOT, timeout=budget_s, capture_output=True, text=True)
        log = r.stdout + r.stderr
        status = "ok" if r.returncode == 0 and out.is_file() else f"failed (exit {r.returncode})"
    except subprocess.TimeoutExpired as e:
        log = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        status = f"timed out after {budget_s:.0f} s"
    (Path(args.workdir) / f"{name}.log").write_text(log)
    result = json.loads(out.read_text()) if out.is_file() else {}
    if not result and partial.is_file():
        result = json.loads(partial.read_text())
    result.update(status=status, wall_s=time.perf_counter() - t0)
    print(f"[bench.gpu_stage3] {name}: {status} in {result['wall_s']:.0f} s", flush=True)
    if status != "ok":
        print("\n".join(log.strip().splitlines()[-15:]), flush=True)
    return result


def table(res: dict, args) -> str:
    g = lambda step, *keys: _dig(res.get(step, {}), keys)  # noqa: E731
    bw = g("bandwidth", "gbps")
    pct = lambda step: (100 * g(step, "decode_tok_s") * g(step, "bytes_per_token") / (bw * 1e9)  # noqa: E731
                        if bw and g(step, "decode_tok_s") and g(step, "bytes_per_token") else None)
    f = lambda x, spec=".0f": "—" if x is None else f"{x:{spec}}"  # noqa: E731
    return "\n".join([
        f"# Stage 3 GPU benchmark ({g('bandwidth', 'gpu') or 'GPU'}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        "| measurement | stage 3 | notes |",
        "|---|---|---|",
        f"| throughput, {args.num_seqs} seqs (output tok/s) | {f(g('s3_ours', 'tok_s'))} | "
        f"{f(g('s3_ours', 'output_tokens'), 'd')} tokens, {f(g('s3_ours', 'steps'), 'd')} steps, "
        f"{f(g('s3_ours', 'preemptions'), 'd')} preemptions; target >= 10,000 and >= 5x stage 2; {g('s3_ours', 'status')} |",
        f"| batch-1 decode, 0.6B shape (tok/s) | {f(g('s3_b1', 'decode_tok_s'))} | {f(pct('s3_b1'))} % of the HBM "
        f"roofline ({f(bw)} GB/s measured); {f(g('s3_b1', 'graph_replays'), 'd')} CUDA-graph replays"
        f"{'; **capture failed: ' + g('s3_b1', 'graph_error') + '**' if g('s3_b1', 'graph_error') else ''}; "
        f"reported only; {g('s3_b1', 'status')} |",
        f"| the same, --no-cuda-graphs (tok/s) | {f(g('s3_b1_eager', 'decode_tok_s'))} | {f(pct('s3_b1_eager'))} % "
        f"of the roofline; graphs / eager = {f(_ratio(g('s3_b1', 'decode_tok_s'), g('s3_b1_eager', 'decode_tok_s')), '.2f')} "
        f"(predicted 1.5-2.5); {g('s3_b1_eager', 'status')} |",
        f"| batch-1 decode, 8B shape, 4 layers (tok/s) | {f(g('s3_b1_8b', 'decode_tok_s'))} | {f(pct('s3_b1_8b'))} % "
        f"of the HBM roofline; target >= 70 %; {g('s3_b1_8b', 'status')} |",
        f"| prefill attention (TFLOP/s) | {f(g('s3_attn', 'tensor_cores', 'tflops'), '.1f')} | plain kernel: "
        f"{f(g('s3_attn', 'plain', 'tflops'), '.1f')}; {g('s3_attn', 'status')} |",
        f"| prefix cache, shared system prompt | {f(g('s3_prefix', 'on', 'hit_rate') and 100 * g('s3_prefix', 'on', 'hit_rate'))} % hit | "
        f"{f(g('s3_prefix', 'on', 'tok_s'))} tok/s on, {f(g('s3_prefix', 'off', 'tok_s'))} off; {g('s3_prefix', 'status')} |",
        ""])


def _ratio(a, b):
    return a / b if a and b else None


def _dig(d, keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def run_steps(args, names, t_end: float) -> dict:
    """Run the named steps in order, each in a subprocess, within t_end (perf_counter time)."""
    res = {}
    for name in names:
        left = t_end - time.perf_counter()
        if name == "bandwidth" and _setup_bandwidth(args):
            res[name] = {**_setup_bandwidth(args), "status": "ok", "from": "bench/gpu.py's setup"}
            continue
        if left < 15:
            res[name] = {"status": "skipped: out of time"}
            continue
        res[name] = run_step(name, args, min(STEPS[name], left))
        if name == "model" and res[name].get("folder"):
            args.model_folder = res[name]["folder"]
    return res


def _setup_bandwidth(args) -> dict | None:
    """The bandwidth bench/gpu.py's setup step measured in this workdir, if there is one."""
    setup = Path(args.workdir) / "setup.json"
    try:
        r = json.loads(setup.read_text())
    except (OSError, ValueError):
        return None
    return {k: r[k] for k in ("gbps", "gpu") if k in r} if r.get("gbps") else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_stage3", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_results"), help="folder for the table and logs")
    ap.add_argument("--workdir", default=None, help="where the models and per-step files go (default: OUT/work)")
    ap.add_argument("--deadline-s", type=float, default=330, help="all steps together stop after this")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="32 sequences: a smoke run")
    ap.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset of " + ",".join(STEPS))
    ap.add_argument("--model-folder", default=None,
                    help="an existing Qwen3-0.6B-shaped model folder (bench/gpu.py's): the model step is skipped")
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the numpy twins: checks the plumbing")
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_seqs = min(args.num_seqs, 32)
    if args.dry_run:
        args.num_seqs = min(args.num_seqs, 4)
        os.environ["BENCH_GPU_DEVICE"] = "cpu"          # the workers (subprocesses) run on the twins
        global DEVICE
        DEVICE = "cpu"
    if args.run:                                       # a worker: one step, its JSON
        result = globals()[f"step_{args.run}"](args)
        (Path(args.workdir) / f"{args.run}.json").write_text(json.dumps(result))
        print(json.dumps(result))
        return 0
    names = [s for s in args.steps.split(",") if s]
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        print(f"unknown step(s) {unknown}; known: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.workdir = str(Path(args.workdir or out / "work").resolve())
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    if args.model_folder:
        names = [s for s in names if s != "model"]
    res = run_steps(args, names, time.perf_counter() + args.deadline_s)
    (out / "gpu_stage3.json").write_text(json.dumps(res, indent=1))
    text = table(res, args)
    (out / "gpu_stage3.md").write_text(text)
    print(text)
    statuses = [r.get("status", "") for r in res.values()]
    if any(s.startswith("failed") for s in statuses):
        return 1                                       # a step broke
    return 3 if any(s.startswith(("timed out", "skipped")) for s in statuses) else 0   # 3: out of time


if __name__ == "__main__":
    sys.exit(main())
