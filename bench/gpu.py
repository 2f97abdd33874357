"""python -m bench gpu [--out DIR] [--deadline-s S] [--dry-run]: stage 3 on one GPU, against its
targets, transformers and the HBM roofline, in one run that fits its deadline.

Each step runs in a subprocess of its own under its own cap (a crash or a timeout loses one
row, never the table; a step left without time says "skipped: out of time"):

  setup    the Qwen3-0.6B-shaped random model, the HBM bandwidth, and the host's cost per
           call of each kind bench/lessons.py counts (the next bench/host_costs.json)
  b1       one sequence (128 prompt tokens, 256 new, median of 3): decode tok/s with CUDA
           graphs and eagerly, and the host time of one eager step, with its profile
  gemv     gemv.cu against cuBLAS at the 0.6B decode shapes (1 and 4 rows)
  hf       transformers' batch-1 decode on the same model, bf16, static cache (the peer)
  b1_8b    a Qwen3-8B-shaped model with 4 of its 36 layers, against its roofline
  attn     prefill attention alone, 4 x 2,048 tokens: tensor cores and the plain kernel
  serve    nano-vllm's workload (256 sequences, lengths 100..1024, greedy), then a shared
           system prompt: the prefix cache's hit rate and tok/s

docs/stage3.md says why each target is expected. --dry-run: tiny models on the numpy twins.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common.engine import Request
from common.sampling import SamplingParams
from stage3_optimized import kernels
from stage3_optimized.batch import PREFILL_TILE, build_batch
from stage3_optimized.engine import LLMEngine
from stage3_optimized.ops import bf16_bits

# (torch, transformers and cupy are imported in the steps that use them: the driver and
# `--help` start without them, and each step runs in a process of its own)
ROOT = Path(__file__).resolve().parent.parent

# Qwen3-0.6B's config.json (the architecture numbers; weights are random)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=40960,
                 rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                 bos_token_id=151643, eos_token_id=151645)
QWEN3_8B_4L = dict(QWEN3_06B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=4,
                   num_attention_heads=32, tie_word_embeddings=False)
# --dry-run: the same architecture, tiny (a vocabulary that holds the workload's ids)
TINY = dict(QWEN3_06B, vocab_size=10240, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
TINY_4L = dict(TINY, num_hidden_layers=4, tie_word_embeddings=False)
CAPS = {"setup": 30, "b1": 25, "gemv": 8, "hf": 15, "b1_8b": 30, "attn": 10, "serve": 30}
TARGETS = dict(b1_tok_s=1000, b1_vs_hf=3.0, roofline_8b=0.70, serve_tok_s=12000, attn_tflops=150)
OUT_OF_TIME = "skipped: out of time"


def workload(num_seqs: int, seed: int = 0, min_len: int = 100, max_len: int = 1024):
    """nano-vllm's: random ids in 0..10000, input and output lengths uniform in min_len..max_len."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 10000, size=int(rng.integers(min_len, max_len + 1))).tolist()
               for _ in range(num_seqs)]
    outputs = [int(rng.integers(min_len, max_len + 1)) for _ in range(num_seqs)]
    return prompts, outputs


def _dev(args) -> str:
    return "cpu" if args.dry_run else "cuda"


def _sync(dev: str) -> None:
    if dev == "cuda":
        import cupy
        cupy.cuda.Device().synchronize()


def _per_call(f, dev: str, n: int = 1, rounds: int = 5, wait: bool = True) -> list[float]:
    """Seconds per call of f, a figure per round of n calls, each round started on an idle device
    after one call that is not timed; wait: until the device has finished them (the device's
    time), else only until the host has enqueued them (the host's)."""
    f()
    times = []
    for _ in range(rounds):
        _sync(dev)
        t = time.perf_counter()
        for _ in range(n):
            f()
        if wait:
            _sync(dev)
        times.append((time.perf_counter() - t) / n)
    return times


def _model(args, config: dict, name: str) -> Path:
    """A random-weight model folder (bf16 safetensors, initialised on the GPU), reused if there."""
    import torch
    import transformers as tf
    folder = Path(args.workdir) / (f"tiny-{name}" if args.dry_run else name)
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        with torch.device(_dev(args)):
            model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**config)).to(torch.bfloat16)
        model.save_pretrained(folder)
        (folder / "generation_config.json").write_text(
            json.dumps({"eos_token_id": [151645, 151643]}))
    return folder


def _engine(args, folder, **kw):
    return LLMEngine(folder, progress=False, device=_dev(args), **kw)


def _greedy(n: int):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _throughput(eng, prompts, outputs, dev: str, partial: Path | None) -> dict:
    """All requests at once, run to the end: output tokens / s over the whole run (a timed-out
    run leaves its rate so far in `partial`)."""
    # compile kernels, wake cuBLAS
    eng.add_request(Request("warm", list(range(1, 40)), _greedy(4)))
    while eng.has_work():
        eng.step()
    _sync(dev)
    steps0, pre0, dec0 = eng.num_steps, eng.num_prefill_tokens, eng.num_decode_tokens
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        eng.add_request(Request(str(i), p, _greedy(n)))
    produced, last_write = 0, 0.0
    t0 = time.perf_counter()
    while eng.has_work():
        produced += sum(1 for e in eng.step() if e.token_id >= 0)
        now = time.perf_counter()
        if partial is not None and now - last_write > 2:
            partial.write_text(json.dumps({"partial": True, "output_tokens": produced,
                                           "seconds": now - t0,
                                           "tok_s": produced / (now - t0)}))
            last_write = now
    _sync(dev)
    seconds = time.perf_counter() - t0
    return {"output_tokens": produced, "expected_tokens": sum(outputs), "seconds": seconds,
            "tok_s": produced / seconds, "steps": eng.num_steps - steps0,
            "preemptions": eng.num_preemptions,
            "prefill_tokens": eng.num_prefill_tokens - pre0,
            "decode_tokens": eng.num_decode_tokens - dec0}


def _b1(eng, prompt, new_tokens: int) -> dict:
    """One sequence, 3 runs: decode tok/s (tokens after the first / their time), the median run."""
    rates = []
    for rep in range(3):
        eng.add_request(Request(f"b1-{rep}", prompt, _greedy(new_tokens)))
        stamps = []
        while eng.has_work():
            if eng.step():
                stamps.append(time.perf_counter())
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    graphs = getattr(eng, "graphs", None)
    return {"tok_s": sorted(rates)[1], "runs": rates,
            "graph_replays": graphs.num_replays if graphs else 0,
            "graph_error": graphs.error if graphs else None,
            "bytes_per_token": eng.weights.decode_nbytes + (
                eng.model.cache.nbytes_per_token * (len(prompt) + new_tokens // 2))}


# ---------------------------------------------------------------------------
# steps (each runs in a fresh subprocess and returns a dict)
# ---------------------------------------------------------------------------

def step_setup(args) -> dict:
    t0 = time.perf_counter()
    folder = _model(args, TINY if args.dry_run else QWEN3_06B, "qwen3-0.6b-random")
    result = {"folder": str(folder), "model_s": time.perf_counter() - t0}
    if args.dry_run:
        return dict(result, gbps=10.0, gpu="CPU (--dry-run)", host_costs_us={})
    import cupy
    n = 2 * 2**30
    a = cupy.empty(n // 4, dtype=cupy.float32)
    b = cupy.empty_like(a)
    times = []
    for _ in range(6):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        b[...] = a
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    del a, b
    return dict(result, gbps=2 * n / sorted(times)[1] / 1e9, gpu=name, host_costs_us=host_costs())


def host_costs() -> dict:
    """Host microseconds per call of each kind bench/lessons.py counts: the best of 5 rounds of
    N calls enqueued on an idle GPU (fewer than its queue holds, so the host never waits)."""
    import cupy
    us = lambda f, n=200: round(min(_per_call(f, "cuda", n, wait=False)) * 1e6, 2)  # noqa: E731
    rng = np.random.default_rng(0)
    w = cupy.asarray(bf16_bits(rng.standard_normal((1024, 1024)).astype(np.float32)))
    x1, x8 = (cupy.asarray(bf16_bits(rng.standard_normal((n, 1024)).astype(np.float32)))
              for n in (1, 8))
    o1, o8 = cupy.empty((1, 1024), cupy.uint16), cupy.empty((8, 1024), cupy.uint16)
    y, small = cupy.zeros(1024, cupy.float32), cupy.zeros(16, cupy.int32)
    pinned = cupy.cuda.alloc_pinned_memory(4096 * 4)
    host, dev = np.ndarray(4096, np.int32, buffer=pinned), cupy.zeros(4096, cupy.int32)
    stream, event = cupy.cuda.get_current_stream(), cupy.cuda.Event(disable_timing=True)
    event.record()
    capture = cupy.cuda.Stream(non_blocking=True)
    kernels.linear(x1, w, out=o1)
    with capture:
        capture.begin_capture()
        for _ in range(10):
            kernels.linear(x1, w, out=o1)
        graph = capture.end_capture()
    return {"launches": us(lambda: kernels.linear(x1, w, out=o1)),        # gemv.cu: 14 arguments
            # cublasGemmEx through ctypes
            "blas": us(lambda: kernels.linear(x8, w, out=o8)),
            "allocations": us(lambda: cupy.empty(1024, cupy.float32), 500),
            "elementwise": us(lambda: y * 2),
            # 16 KB from page-locked memory
            "copies": us(lambda: dev.set(host, stream=stream)),
            # a D2H copy waits for the stream
            "copy_back_and_sync": us(lambda: small.get()),
            "syncs": us(lambda: event.synchronize(), 500),                 # an event already done
            "graph_launches": us(lambda: graph.launch(stream=stream), 100)}


def step_b1(args) -> dict:
    prompt = workload(1, seed=1)[0][0][:128]
    new = 16 if args.dry_run else 256
    out = {}
    for label, eager in (("graphs", False), ("eager", True)):
        eng = _engine(args, args.model_folder, max_ctx=2048, slots=4, token_budget=2048,
                      page_size=256,
                      kv_memory=4 * 2**30, enforce_eager=eager)
        # warm-up: compile, capture bucket 1
        _b1(eng, prompt[:32], 4)
        out[label] = _b1(eng, prompt, new)
        if eager:
            (out["eager"]["host_ms_per_step"],
             out["eager"]["host_profile"]) = _eager_host_ms(args, eng, prompt)
        del eng
    return out


def _eager_host_ms(args, eng, prompt) -> float:
    """The host time of one eager decode step of one sequence: the input upload, the forward
    pass and the sampling kernel enqueued on an idle GPU, without waiting for them."""
    eng.add_request(Request("h", prompt, _greedy(8)))
    eng.step()
    sched = eng.scheduler.schedule()
    seqs, tokens, batch = build_batch(sched.seqs, sched.num_tokens, eng.page_size)
    params = eng._sampling_inputs(seqs)

    def enqueue():
        dt, db, dp = eng.inputs.upload(tokens, batch, params)
        logits = eng.model.forward(dt, db)
        kernels.sample(logits, dp.temperature, dp.top_k, dp.top_p, dp.u,
                       out=eng.model.buffers.next_tokens[:1])
    best = min(_per_call(enqueue, _dev(args), wait=False))
    # where that host time goes: cProfile over 10 steps, the top functions by their own time
    prof = cProfile.Profile()
    for _ in range(10):
        _sync(_dev(args))
        prof.runcall(enqueue)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
    _sync(_dev(args))
    eng.abort("h")
    while eng.has_work():
        eng.step()
    return round(best * 1e3, 3), [line for line in text.getvalue().splitlines()
                                  if line.strip()][-13:]


def step_gemv(args) -> dict:
    """gemv.cu against cuBLAS (ctypes), device time per call, 1 and 4 rows, 0.6B's decode shapes."""
    xp = np if args.dry_run else __import__("cupy")
    shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
              "lm_head": (151936, 1024)} if not args.dry_run else {"qkv": (64, 32)}
    rng, out = np.random.default_rng(0), {}
    for name, (M, K) in shapes.items():
        w = xp.asarray(bf16_bits(rng.standard_normal((M, K)).astype(np.float32) * 0.05))
        for N in (1, 4):
            x = xp.asarray(bf16_bits(rng.standard_normal((N, K)).astype(np.float32)))
            o = xp.empty((N, M), np.uint16)
            runs = {"gemv": lambda: kernels.linear(x, w, out=o)}
            if not args.dry_run:
                runs["cublas"] = lambda: kernels._gemm(x, w, o)
            times = {label: _per_call(f, _dev(args), 50, rounds=1)[0] for label, f in runs.items()}
            out[f"{name} N={N}"] = {label: {"us": round(s * 1e6, 2),
                                            "gbps": round(M * K * 2 / s / 1e9, 0)}
                                    for label, s in times.items()}
    return out


def step_hf(args) -> dict:
    """transformers generate(), one sequence, bf16 on the GPU, static cache: decode tok/s of the
    new tokens (the whole generate minus a one-token generate), the best of 3."""
    import torch
    import transformers as tf
    dev = _dev(args)
    model = tf.AutoModelForCausalLM.from_pretrained(args.model_folder,
                                                    dtype=torch.bfloat16).to(dev).eval()
    ids = torch.tensor([workload(1, seed=1)[0][0][:128]]).to(dev)
    n = 8 if args.dry_run else 64
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, cache_implementation="static")

    def timed(k):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    timed(2)
    return {"tok_s": max((n - 1) / (timed(n) - timed(1)) for _ in range(3))}


def step_b1_8b(args) -> dict:
    folder = _model(args, TINY_4L if args.dry_run else QWEN3_8B_4L, "qwen3-8b-4layers-random")
    eng = _engine(args, folder, max_ctx=2048, slots=4, token_budget=2048, page_size=256,
                  kv_memory=4 * 2**30)
    prompt = workload(1, seed=1)[0][0][:128]
    _b1(eng, prompt[:32], 4)
    return _b1(eng, prompt, 16 if args.dry_run else 128)


def step_attn(args) -> dict:
    """Prefill attention of 4 sequences x 2,048 tokens, 0.6B's heads (16 / 8 x 128), pages of
    256: TFLOP/s of the tensor-core kernel and of the plain one (the median of 5 after one)."""
    S, T, H, Hkv, D, P = (4, 2048, 16, 8, 128, 256) if not args.dry_run else (1, 64, 4, 2, 64, 16)
    rng = np.random.default_rng(0)
    pages = S * T // P
    k, v = (bf16_bits(rng.standard_normal((pages, P, Hkv, D)).astype(np.float32)) for _ in range(2))
    q = bf16_bits(rng.standard_normal((S * T, H, D)).astype(np.float32))
    tables = np.arange(pages, dtype=np.int32).reshape(S, T // P)
    token_seq, positions = (np.repeat(np.arange(S, dtype=np.int32), T),
                            np.tile(np.arange(T, dtype=np.int32), S))
    tile_start = np.arange(0, S * T, PREFILL_TILE, dtype=np.int32)
    tile_count = np.full(len(tile_start), PREFILL_TILE, np.int32)
    xp = np if args.dry_run else __import__("cupy")
    arrays = [xp.asarray(a)
              for a in (q, k, v, tables, token_seq, positions, tile_start, tile_count)]
    # QK^T and PV over the causal triangle
    flops, out = 4 * D * H * S * (T * (T + 1) // 2), {}
    for name, tc in (("tensor_cores", True), ("plain", False)):
        times = _per_call(lambda: kernels.prefill_attention(*arrays, tensor_cores=tc), _dev(args))
        out[name] = {"tflops": flops / sorted(times)[2] / 1e12}
    return out


def step_serve(args) -> dict:
    """nano-vllm's workload, then the shared system prompt with the prefix cache."""
    prompts, outputs = workload(args.num_seqs,
                                **(dict(min_len=4, max_len=24) if args.dry_run else {}))
    eng = _engine(args, args.model_folder, max_ctx=2048, slots=256, token_budget=8192,
                  page_size=256,
                  kv_memory=None if args.dry_run else 16 * 2**30)
    full = _throughput(eng, prompts, outputs, _dev(args), Path(args.workdir) / "serve.partial.json")
    del eng
    rng = np.random.default_rng(7)
    n, sys_len, q_len = (64, 1000, 100) if not args.dry_run else (4, 40, 5)
    system = rng.integers(0, 10000, size=sys_len).tolist()
    reqs = [system + rng.integers(0, 10000, size=q_len).tolist() for _ in range(n)]
    eng = _engine(args, args.model_folder, max_ctx=2048, slots=256, token_budget=8192, page_size=16,
                  kv_memory=None if args.dry_run else 16 * 2**30)
    _throughput(eng, reqs[:1], [32], _dev(args), None)           # the first request fills the cache
    rest = _throughput(eng, reqs[1:], [32] * (n - 1), _dev(args), None)
    cached = sum(eng.num_cached_tokens(str(i)) for i in range(n - 1))
    return {"full": full, "prefix": dict(rest, hit_rate=cached / sum(len(p) for p in reqs[1:]))}


# ---------------------------------------------------------------------------
# the driver: every step in a subprocess with its cap, then the table
# ---------------------------------------------------------------------------

def run_step(name: str, args, cap_s: float) -> dict:
    out, partial = Path(args.workdir) / f"{name}.json", Path(args.workdir) / f"{name}.partial.json"
    for f in (out, partial):
        f.unlink(missing_ok=True)
    cmd = ([sys.executable, "-m", "bench.gpu", "--run", name, "--workdir", args.workdir,
            "--num-seqs", str(args.num_seqs), "--model-folder", args.model_folder or ""]
           + (["--dry-run"] if args.dry_run else []))
    t0 = time.perf_counter()
    print(f"[bench.gpu] {name} (at most {cap_s:.0f} s) ...", flush=True)
    try:
        r = subprocess.run(cmd, cwd=ROOT, timeout=cap_s, capture_output=True, text=True)
        log, status = (r.stdout + r.stderr, "ok" if r.returncode == 0 and out.is_file()
                       else f"failed (exit {r.returncode})")
    except subprocess.TimeoutExpired as e:
        log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                      for x in (e.stdout, e.stderr))
        # (a slow exit after its JSON)
        status = "ok" if out.is_file() else f"timed out after {cap_s:.0f} s"
    (Path(args.workdir) / f"{name}.log").write_text(log)
    result = (json.loads(out.read_text()) if out.is_file()
              else json.loads(partial.read_text()) if partial.is_file() else {})
    result.update(status=status, wall_s=round(time.perf_counter() - t0, 1))
    print(f"[bench.gpu] {name}: {status} in {result['wall_s']:.0f} s", flush=True)
    if status != "ok":
        print("\n".join(log.strip().splitlines()[-15:]), flush=True)
    return result


def _get(res, *keys):
    for k in keys:
        res = res.get(k) if isinstance(res, dict) else None
    return res


def table(res: dict, args) -> str:
    f = lambda x, spec=".0f": "—" if x is None else f"{x:{spec}}"  # noqa: E731
    bw = _get(res, "setup", "gbps")
    b1, eager, hf = (_get(res, "b1", "graphs", "tok_s"), _get(res, "b1", "eager", "tok_s"),
                     _get(res, "hf", "tok_s"))

    def roof(step):
        return (_get(res, *step, "tok_s") * _get(res, *step, "bytes_per_token") / (bw * 1e9)
                if bw and _get(res, *step, "tok_s") else None)

    st = lambda step: _get(res, step, "status") or "not run"  # noqa: E731
    err = _get(res, "b1", "graphs", "graph_error")
    attn, serve, prefix = (res.get("attn", {}), _get(res, "serve", "full") or {},
                           _get(res, "serve", "prefix") or {})
    gemv = _get(res, "gemv") or {}
    lines = [f"# Stage 3 on {_get(res, 'setup', 'gpu') or 'the GPU'} "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "", "--dry-run: tiny models on the CPU; the numbers mean nothing." if args.dry_run else
             "Qwen3-0.6B shape, random bf16 weights, greedy; batch 1: 128 prompt tokens, 256 new, "
             "the median of 3.", "",
             "| measurement | stage 3 | target | notes |", "|---|---|---|---|",
             f"| batch-1 decode, CUDA graphs (tok/s) | {f(b1)} | ≥ {TARGETS['b1_tok_s']:,}, ≥ "
             f"{TARGETS['b1_vs_hf']:.0f}× transformers | "
             f"{f(roof(('b1', 'graphs')) and 100 * roof(('b1', 'graphs')))} % of the roofline "
             f"({f(bw)} GB/s measured); {f(_get(res, 'b1', 'graphs', 'graph_replays'), 'd')} "
             f"replays{'; **capture failed: ' + err + '**' if err else ''}; {st('b1')} |",
             f"| the same, eager (tok/s) | {f(eager)} | — | graphs ÷ eager "
             f"{f(b1 and eager and b1 / eager, '.2f')}; host "
             f"{f(_get(res, 'b1', 'eager', 'host_ms_per_step'), '.3f')} ms per eager step "
             "(bench lessons predicts ≤ 1.5) |",
             f"| transformers, static cache (tok/s) | {f(hf)} | — | stage 3 ÷ transformers "
             f"{f(b1 and hf and b1 / hf, '.2f')}×; {st('hf')} |",
             f"| batch-1 decode, 8B shape, 4 layers (tok/s) | {f(_get(res, 'b1_8b', 'tok_s'))} | ≥ "
             f"{TARGETS['roofline_8b']:.0%} of the roofline | "
             f"{f(roof(('b1_8b',)) and 100 * roof(('b1_8b',)))} %; {st('b1_8b')} |",
             f"| nano-vllm workload, {args.num_seqs} seqs (output tok/s) | {f(serve.get('tok_s'))} "
             f"| ≥ {TARGETS['serve_tok_s']:,} | {f(serve.get('output_tokens'), 'd')} tokens, "
             f"{f(serve.get('steps'), 'd')} steps, {f(serve.get('preemptions'), 'd')} "
             f"preemptions{' (partial)' if serve.get('partial') else ''}; {st('serve')} |",
             "| prefix cache, shared system prompt | "
             f"{f(prefix.get('hit_rate') and 100 * prefix['hit_rate'])} % hit | — | "
             f"{f(prefix.get('tok_s'))} tok/s |",
             "| prefill attention, tensor cores (TFLOP/s) | "
             f"{f(_get(attn, 'tensor_cores', 'tflops'), '.1f')} | ≥ {TARGETS['attn_tflops']} | "
             f"plain kernel {f(_get(attn, 'plain', 'tflops'), '.1f')}; {st('attn')} |"]
    for shape, row in gemv.items():
        if isinstance(row, dict) and "gemv" in row:
            lines.append(f"| gemv.cu, {shape} (GB/s) | {f(row['gemv']['gbps'])} | — | cuBLAS "
                         f"{f(_get(row, 'cublas', 'gbps'))} GB/s; {row['gemv']['us']} µs |")
    profile = _get(res, "b1", "eager", "host_profile")
    if profile:
        lines += ["", "Host time of 10 eager decode steps of one sequence, by function (cProfile):",
                  "", "```", *profile, "```"]
    costs = _get(res, "setup", "host_costs_us")
    if costs:
        lines += ["", "Host µs per call (the next bench/host_costs.json): "
                  + ", ".join(f"{k} {v}" for k, v in costs.items())]
    return "\n".join(lines + [""])


def plan(deadline_s: float, scale: float = 1.0) -> dict[str, float]:
    """step -> cap in seconds, in run order; serve gets what the others leave (at least its cap)."""
    caps = {k: v * scale for k, v in CAPS.items()}
    caps["serve"] = max(caps["serve"],
                        deadline_s - 5 - sum(v for k, v in caps.items() if k != "serve"))
    return caps


def exit_status(statuses: list[str]) -> int:
    """1 when a step broke (failed, or skipped for a reason other than time), else 3 when a step
    ran out of time (gpu_check.sh reports it, not as a failure), else 0."""
    if any(s.startswith("failed") or (s.startswith("skipped") and s != OUT_OF_TIME)
           for s in statuses):
        return 1
    return 3 if any(s.startswith("timed out") or s == OUT_OF_TIME for s in statuses) else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_results"),
                    help="folder for the table (gpu_bench.md, gpu_bench.json, host_costs.json) and "
                         "nothing else (default: $OUT, else gpu_results)")
    ap.add_argument("--workdir", default=None,
                    help="models, per-step logs and JSON (default: under the temp dir)")
    ap.add_argument("--deadline-s", type=float, default=150, help="seconds in all (default 150)")
    ap.add_argument("--steps", default=",".join(CAPS), help="which (default: all, %(default)s)")
    ap.add_argument("--num-seqs", type=int, default=256, help="nano-vllm's sequences (default 256)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny models on the CPU: checks the plumbing")
    # internal: one step, in this process
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.num_seqs = min(args.num_seqs, 4)
    if args.run:                                       # a worker: one step, its JSON
        result = globals()[f"step_{args.run}"](args)
        (Path(args.workdir) / f"{args.run}.json").write_text(json.dumps(result))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.workdir = str(Path(args.workdir or Path(tempfile.gettempdir()) / "qs-bench-gpu").resolve())
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    names = [s for s in args.steps.split(",") if s]
    if set(names) - set(CAPS):
        ap.error(f"unknown step(s) {sorted(set(names) - set(CAPS))}; known: {', '.join(CAPS)}")
    caps = plan(args.deadline_s, 4.0 if args.dry_run else 1.0)
    t_end, res = time.perf_counter() + args.deadline_s, {}
    for name in [n for n in CAPS if n in names]:
        left = t_end - time.perf_counter() - 2
        if name != "setup" and not args.model_folder and name in ("b1", "hf", "serve"):
            res[name] = {"status": "skipped: the setup step made no model"}
        elif left < 5:
            res[name] = {"status": OUT_OF_TIME}
        else:
            res[name] = run_step(name, args, min(caps[name], left))
        if name == "setup" and res[name].get("folder"):
            args.model_folder = res[name]["folder"]
            if res[name].get("host_costs_us"):
                (out / "host_costs.json").write_text(
                    json.dumps(res[name]["host_costs_us"], indent=1))
        (out / "gpu_bench.json").write_text(json.dumps(res, indent=1))
    text = table(res, args)
    (out / "gpu_bench.md").write_text(text)
    print(text)
    return exit_status([r.get("status", "") for r in res.values()])


if __name__ == "__main__":
    sys.exit(main())
