"""python -m bench.gpu [--out DIR] [--quick]: stage 2 on a GPU against transformers, in one run.

The workload is nano-vllm's bench.py: the Qwen3-0.6B shape with random weights,
256 sequences, input and output lengths uniform in 100..1024, EOS ignored, token
ids uniform in 0..10000. Measured, each in its own subprocess (a crash or a
timeout loses one cell, never the table; GPU memory is returned between steps):

  model        write the random-weight model folder once (bf16 safetensors; both
               engines read it, stage 2 converts to fp32 on load)
  bandwidth    device-to-device copy: the HBM bandwidth the roofline uses
  ours         stage 2 on all 256 sequences: output tokens / s (nano-vllm's number)
  ours_subset  stage 2 on the first --hf-seqs sequences
  hf_subset    transformers generate() on the same subset, one padded batch, fp32
  ours_b1      stage 2, one sequence: decode tokens / s against the roofline
  hf_b1        transformers, one sequence: decode tokens / s

Napkin maths printed with it: one decode step of one sequence reads every weight
once (fp32: ~3 GB for Qwen3-0.6B incl. the tied embedding / lm_head), so batch-1
decode can not beat bandwidth / weight bytes tokens per second.

Differences from nano-vllm's bench, stated in the table: greedy sampling (stage 2
samples non-greedy requests on the host, which would time the host, not the GPU),
fp32 weights (stage 2 is fp32; stage 3 is bf16).
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

# Qwen3-0.6B's config.json (the architecture numbers; weights are random)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                 bos_token_id=151643, eos_token_id=151645)

# step -> seconds it may take at most (each is also cut to what is left of --deadline-s)
# (in this order: the long throughput run last, where a timeout still leaves its partial rate)
STEPS = {"model": 150, "bandwidth": 40, "ours_b1": 60, "hf_b1": 60, "ours_subset": 90, "hf_subset": 120,
         "ours": 240}
# BENCH_GPU_DEVICE=cpu runs stage 2's steps on its numpy twins: a smoke test of this script only
DEVICE = os.environ.get("BENCH_GPU_DEVICE", "cuda")


def workload(num_seqs: int, seed: int = 0, min_len: int = 100, max_len: int = 1024):
    """nano-vllm's: random ids in 0..10000, input and output lengths uniform in min_len..max_len."""
    import numpy as np
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 10000, size=int(rng.integers(min_len, max_len + 1))).tolist()
               for _ in range(num_seqs)]
    outputs = [int(rng.integers(min_len, max_len + 1)) for _ in range(num_seqs)]
    return prompts, outputs


# ---------------------------------------------------------------------------
# steps (each runs in a fresh subprocess and returns a dict)
# ---------------------------------------------------------------------------

def step_model(args) -> dict:
    import torch
    import transformers as tf
    folder = Path(args.workdir) / "qwen3-0.6b-random"
    if (folder / "config.json").is_file():
        return {"folder": str(folder), "reused": True}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    config = tf.Qwen3Config(**QWEN3_06B)
    with torch.device("cuda"):                         # random init on the GPU: seconds, not minutes
        model = tf.Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return {"folder": str(folder), "seconds": time.perf_counter() - t0}


def step_bandwidth(args) -> dict:
    import cupy
    n = 2 * 2**30                                      # 2 GiB each way
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
    best = sorted(times)[len(times) // 2]
    props = cupy.cuda.runtime.getDeviceProperties(0)
    return {"gbps": 2 * n / best / 1e9, "gpu": props["name"].decode() if isinstance(props["name"], bytes)
            else str(props["name"]), "memory_gib": cupy.cuda.Device().mem_info[1] / 2**30}


def _ours(folder: str, prompts, outputs, partial: Path | None, warm: bool = True, **engine_kw) -> dict:
    """Run stage 2 on the workload; returns output tokens / s over the whole run."""
    from common.engine import Request
    from common.sampling import SamplingParams
    from stage2_batched.engine import LLMEngine
    t0 = time.perf_counter()
    eng = LLMEngine(folder, progress=False, **engine_kw)
    load_s = time.perf_counter() - t0
    greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    if warm:                                           # compile the kernels, wake up cuBLAS
        eng.add_request(Request("warm", list(range(1, 300)), greedy(4)))
        while eng.has_work():
            eng.step()
    if engine_kw.get("device") == "cuda":
        import cupy
        cupy.cuda.Device().synchronize()
    steps0, pre0, dec0 = eng.num_steps, eng.num_prefill_tokens, eng.num_decode_tokens
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        eng.add_request(Request(str(i), p, greedy(n)))
    produced, first_token_at, last_write = 0, None, 0.0
    t0 = time.perf_counter()
    while eng.has_work():
        events = eng.step()
        produced += sum(1 for e in events if e.token_id >= 0)
        now = time.perf_counter()
        if first_token_at is None and produced:
            first_token_at = now - t0
        if partial is not None and now - last_write > 5:      # a timed-out run still reports
            partial.write_text(json.dumps({"partial": True, "output_tokens": produced,
                                           "seconds": now - t0, "tok_s": produced / (now - t0)}))
            last_write = now
    seconds = time.perf_counter() - t0
    return {"output_tokens": produced, "expected_tokens": sum(outputs), "seconds": seconds,
            "tok_s": produced / seconds, "steps": eng.num_steps - steps0,
            "prefill_tokens": eng.num_prefill_tokens - pre0, "decode_tokens": eng.num_decode_tokens - dec0,
            "preemptions": eng.num_preemptions, "pages": eng.num_total_pages(),
            "load_s": load_s, "first_token_s": first_token_at, "weight_bytes": eng.weights.nbytes}


def step_ours(args) -> dict:
    prompts, outputs = workload(args.num_seqs)
    return _ours(args.model_folder, prompts, outputs, Path(args.workdir) / "ours.partial.json",
                 max_ctx=2048, slots=256, token_budget=args.token_budget, page_size=256, device=DEVICE)


def step_ours_subset(args) -> dict:
    prompts, outputs = workload(args.num_seqs)
    n = args.hf_seqs
    return _ours(args.model_folder, prompts[:n], outputs[:n], Path(args.workdir) / "ours_subset.partial.json",
                 max_ctx=2048, slots=256, token_budget=args.token_budget, page_size=256, device=DEVICE)


def step_hf_subset(args) -> dict:
    """transformers generate() on the same sequences, one left-padded batch, greedy, fp32.
    Each sequence's useful tokens are its own output length; the padded batch runs to the
    longest one, so the rest is waste that static batching pays for."""
    import torch
    import transformers as tf
    prompts, outputs = workload(args.num_seqs)
    prompts, outputs = prompts[:args.hf_seqs], outputs[:args.hf_seqs]
    model = tf.AutoModelForCausalLM.from_pretrained(args.model_folder, dtype=torch.float32).cuda().eval()
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):                     # left padding: every prompt ends at the same column
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        model.generate(ids[:1, -16:], attention_mask=mask[:1, -16:], max_new_tokens=4, do_sample=False,
                       eos_token_id=None, pad_token_id=0)   # warm up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=max(outputs), min_new_tokens=max(outputs),
                       do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"useful_tokens": sum(outputs), "generated_tokens": len(prompts) * max(outputs),
            "seconds": seconds, "tok_s": sum(outputs) / seconds}


def step_ours_b1(args) -> dict:
    """One sequence: 128 prompt tokens, 256 new. Decode speed = tokens after the first / their time."""
    from common.engine import Request
    from common.sampling import SamplingParams
    from stage2_batched.engine import LLMEngine
    eng = LLMEngine(args.model_folder, max_ctx=2048, slots=1, token_budget=2048, page_size=256,
                    kv_memory=4 * 2**30, device=DEVICE, progress=False)
    prompt, _ = workload(1, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    rates = []
    for rep in range(3):
        eng.add_request(Request(f"b1-{rep}", prompt[0][:128], params))
        stamps = []
        while eng.has_work():
            if eng.step():
                stamps.append(time.perf_counter())
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {"decode_tok_s": sorted(rates)[1], "runs": rates, "weight_bytes": eng.weights.nbytes}


def step_hf_b1(args) -> dict:
    import torch
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(args.model_folder, dtype=torch.float32).cuda().eval()
    prompt, _ = workload(1, seed=1)
    ids = torch.tensor([prompt[0][:128]]).cuda()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def timed(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(4)                                           # warm up
    rates = [255 / (timed(256) - timed(1)) for _ in range(3)]
    return {"decode_tok_s": sorted(rates)[1], "runs": rates}


# ---------------------------------------------------------------------------
# the driver: every step in a subprocess with a timeout, then the table
# ---------------------------------------------------------------------------

def run_step(name: str, args, budget_s: float) -> dict:
    out = Path(args.workdir) / f"{name}.json"
    partial = Path(args.workdir) / f"{name}.partial.json"
    for f in (out, partial):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "bench.gpu", "--run", name, "--workdir", args.workdir,
           "--model-folder", args.model_folder or "", "--num-seqs", str(args.num_seqs),
           "--hf-seqs", str(args.hf_seqs), "--token-budget", str(args.token_budget)]
    t0 = time.perf_counter()
    print(f"[bench.gpu] {name} (at most {budget_s:.0f} s) ...", flush=True)
    try:
        r = subprocess.run(cmd, cwd=ROOT, timeout=budget_s, capture_output=True, text=True)
        log = r.stdout + r.stderr
        status = "ok" if r.returncode == 0 and out.is_file() else f"failed (exit {r.returncode})"
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        status = f"timed out after {budget_s:.0f} s"
    (Path(args.workdir) / f"{name}.log").write_text(log)
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


def table(res: dict, args) -> str:
    get = lambda step, key: res.get(step, {}).get(key, "not run" if key == "status" else None)  # noqa: E731
    bw = get("bandwidth", "gbps")
    wbytes = get("ours_b1", "weight_bytes") or get("ours", "weight_bytes")
    roof = bw * 1e9 / wbytes if bw and wbytes else None
    ours, hf = get("ours_subset", "tok_s"), get("hf_subset", "tok_s")
    b1, hb1 = get("ours_b1", "decode_tok_s"), get("hf_b1", "decode_tok_s")
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "—"  # noqa: E731
    lines = [
        f"# Stage 2 GPU benchmark ({get('bandwidth', 'gpu') or 'GPU'}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
        "",
        "Workload: nano-vllm's bench (Qwen3-0.6B shape, random weights, input and output lengths "
        "uniform in 100..1024, EOS ignored), greedy, fp32 weights.",
        "",
        "| measurement | stage 2 | transformers | stage 2 / transformers | notes |",
        "|---|---|---|---|---|",
        f"| throughput, {args.num_seqs} seqs (output tok/s) | {fmt(get('ours', 'tok_s'))} | — | — | "
        f"{fmt(get('ours', 'output_tokens'), 'd')} tokens in {fmt(get('ours', 'seconds'), '.1f')} s, "
        f"{fmt(get('ours', 'steps'), 'd')} steps, {fmt(get('ours', 'preemptions'), 'd')} preemptions; "
        f"{get('ours', 'status')} |",
        f"| throughput, first {args.hf_seqs} seqs (useful tok/s) | {fmt(ours)} | {fmt(hf)} | {ratio(ours, hf)} | "
        f"transformers: one padded batch; {get('ours_subset', 'status')} / {get('hf_subset', 'status')} |",
        f"| batch-1 decode (tok/s) | {fmt(b1)} | {fmt(hb1)} | {ratio(b1, hb1)} | "
        f"{get('ours_b1', 'status')} / {get('hf_b1', 'status')} |",
        f"| batch-1 roofline (tok/s) | {fmt(roof)} | | | {fmt(wbytes and wbytes / 1e9, '.2f')} GB of weights "
        f"per token at {fmt(bw)} GB/s measured; stage 2 reaches {fmt(b1 and roof and 100 * b1 / roof, '.0f')}% |",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_results"), help="folder for the table and logs")
    ap.add_argument("--workdir", default=None, help="where the model and per-step files go (default: OUT/work)")
    ap.add_argument("--deadline-s", type=float, default=330, help="all steps together stop after this")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--hf-seqs", type=int, default=16, help="sequences of the transformers comparison")
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="32 sequences: a smoke run")
    ap.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset of " + ",".join(STEPS))
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)        # internal: one step, in this process
    ap.add_argument("--model-folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_seqs = min(args.num_seqs, 32)
        args.hf_seqs = min(args.hf_seqs, 8)

    if args.run:                                       # a worker: do one step, write its JSON
        result = globals()[f"step_{args.run}"](args)
        (Path(args.workdir) / f"{args.run}.json").write_text(json.dumps(result))
        print(json.dumps(result))
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.workdir = str(Path(args.workdir or out / "work").resolve())
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    t_end = time.perf_counter() + args.deadline_s
    res = {}
    for name in [s for s in args.steps.split(",") if s]:
        if name not in STEPS:
            print(f"unknown step {name!r}; known: {', '.join(STEPS)}", file=sys.stderr)
            return 2
        left = t_end - time.perf_counter()
        if name != "model" and not args.model_folder and "model" in res:
            print(f"[bench.gpu] {name}: skipped (no model folder)")
            res[name] = {"status": "skipped: the model step failed"}
            continue
        if left < 15:
            res[name] = {"status": "skipped: out of time"}
            continue
        res[name] = run_step(name, args, min(STEPS[name], left))
        if name == "model" and res[name].get("folder"):
            args.model_folder = res[name]["folder"]
        (out / "gpu_bench.json").write_text(json.dumps(res, indent=1))
    text = table(res, args)
    (out / "gpu_bench.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
