"""The default demo before and after it ran its GGUF file directly (docs/benchmarks.md).

  old  the Q4_1 file converted to a float32 Hugging Face folder (common/gguf_convert.py),
       stage 1 at --quant none (the old default)
  new  the Q4_1 file itself, stage 1 at --quant stored (Q4_1 -> int4, Q8_0 embedding -> int8)

Each runs in a fresh process (its peak resident memory is its own): load, warm up, then
the chat's first question answered greedily for --tokens tokens (EOS ignored), three times;
the median decode tok/s is reported, with the disk each needs.

    python -m bench.gguf_demo [--tokens 64] [--threads N]

--vs-llama: stage 1 (--quant stored) against llama.cpp (llama-cpp-python, the `bench` extra)
on the very same files: the demo's Q4_1 file and a Q8_0 file of the Qwen3-0.6B shape
(bench/cpu.py writes it from random weights). Prefill of 128 tokens and decode of --tokens,
each engine under OMP_WAIT_POLICY=PASSIVE and ACTIVE in a fresh process, each at its best
policy in the ratio; every run starts from an empty KV cache (a new prompt each time).

    python -m bench.gguf_demo --vs-llama [--tokens 32] [--runs 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _status_mb(key: str) -> float:
    """VmRSS (resident now) or VmHWM (the peak) of this process, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _one(model: str, quant: str, tokens: int, threads: int | None) -> dict:
    from common.chat_template import ChatTemplate
    from common.engine import Request
    from common.sampling import SamplingParams
    from common.tokenizer import Tokenizer
    from stage1_cpu.engine import LLMEngine

    t0 = time.perf_counter()
    eng = LLMEngine(model, quant=quant, max_ctx=512, progress=False, threads=threads)
    load_s = time.perf_counter() - t0
    loaded_mb = _status_mb("VmRSS")
    eng.warm_up()
    tok = Tokenizer(model)
    ids = tok.encode(ChatTemplate.from_folder(model).render(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True))
    rates, text = [], None
    for _ in range(3):
        eng.add_request(Request("r", ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)))
        out = []
        while eng.has_work():
            out += [e.token_id for e in eng.step()]
        rates.append(eng.last_decode_tokens / eng.last_decode_s)
        # the first answer: later ones reuse the cached prompt, whose last position is then
        # computed on the decode path, where a near tie of the first token may go the other way
        text = tok.decode(out) if text is None else text
    return {"decode_tok_s": statistics.median(rates), "load_s": load_s, "first_words": text[:40],
            "peak_rss_mb": _status_mb("VmHWM"), "loaded_rss_mb": loaded_mb,
            "formats": eng.describe_kernels()}


def _vs_child(engine: str, path: str, tokens: int, runs: int, threads: int) -> dict:
    prompts = [[(7 + 31 * i + 1009 * r) % 30000 + 100 for i in range(128)] for r in range(runs)]
    pre, dec, what = [], [], ""
    if engine == "stage1":
        from common.engine import Request
        from common.sampling import SamplingParams
        from stage1_cpu.engine import LLMEngine
        eng = LLMEngine(path, quant="stored", max_ctx=512, progress=False, threads=threads)
        eng.warm_up()
        what = eng.describe_kernels()
        for p in prompts:
            eng.add_request(Request("r", p, SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)))
            while eng.has_work():
                eng.step()
            pre.append(eng.last_prefill_tokens / eng.last_prefill_s)
            dec.append(eng.last_decode_tokens / eng.last_decode_s)
    else:
        from bench.cpu import LlamaCppRunner
        r = LlamaCppRunner(path, threads, 512)
        what = r.isa()
        r.generate(prompts[0][:8], 4)                          # warm
        for p in prompts:
            _, prefill_s, decode_s = r.generate(p, tokens)
            pre.append(len(p) / prefill_s)
            dec.append(tokens / decode_s)
    return {"prefill": statistics.median(pre), "decode": statistics.median(dec), "what": what}


def vs_llama(args) -> int:
    from bench.cpu import CACHE, QWEN3_0_6B, prepare_models
    from common.models import resolve_model
    demo = next(Path(resolve_model(None, progress=False)).glob("*.gguf"))
    q8 = prepare_models(QWEN3_0_6B, CACHE, quants=("Q8_0",))["Q8_0"]
    threads = args.threads or os.cpu_count()
    loads = [os.getloadavg()[0]]
    res = {}
    for path in (demo, q8):
        for engine in ("stage1", "llama.cpp"):
            for policy in ("PASSIVE", "ACTIVE"):
                env = dict(os.environ, OMP_WAIT_POLICY=policy)
                cmd = [sys.executable, "-m", "bench.gguf_demo", "--vs-child", engine, str(path),
                       "--tokens", str(args.tokens), "--runs", str(args.runs), "--threads", str(threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode:
                    print(out.stderr[-2000:], file=sys.stderr)
                    return 1
                res[path.name, engine, policy] = json.loads(out.stdout.strip().splitlines()[-1])
                loads.append(os.getloadavg()[0])
                r = res[path.name, engine, policy]
                print(f"  {path.name:40} {engine:9} {policy:7} prefill {r['prefill']:8.1f}  decode {r['decode']:7.1f}",
                      flush=True)
    print(f"\n{threads} threads; load average during the run {min(loads):.1f}-{max(loads):.1f} "
          f"({os.cpu_count()} CPUs); prefill 128 tokens, decode {args.tokens}, median of {args.runs}")
    print(f"{'file':42} {'engine':10} {'prefill tok/s':>14} {'decode tok/s':>13}  (best policy)")
    for path in (demo, q8):
        best = {}
        for engine in ("stage1", "llama.cpp"):
            b = {k: max((res[path.name, engine, p][k], p) for p in ("PASSIVE", "ACTIVE")) for k in ("prefill", "decode")}
            best[engine] = b
            print(f"{path.name:42} {engine:10} {b['prefill'][0]:9.1f} {b['prefill'][1]:>4} "
                  f"{b['decode'][0]:8.1f} {b['decode'][1]:>4}")
        print(f"{'':42} {'ratio':10} {best['stage1']['prefill'][0] / best['llama.cpp']['prefill'][0]:13.2f}x "
              f"{best['stage1']['decode'][0] / best['llama.cpp']['decode'][0]:12.2f}x")
    print("stage 1:", res[demo.name, "stage1", "PASSIVE"]["what"], "|", res[q8.name, "stage1", "PASSIVE"]["what"])
    print("llama.cpp:", res[demo.name, "llama.cpp", "PASSIVE"]["what"][:300])
    return 0


def _du(path: Path) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gguf-demo", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--vs-llama", action="store_true", help="stage 1 against llama.cpp on the same GGUF files")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "QUANT"), help=argparse.SUPPRESS)
    ap.add_argument("--vs-child", nargs=2, metavar=("ENGINE", "FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vs_child:
        print(json.dumps(_vs_child(args.vs_child[0], args.vs_child[1], args.tokens, args.runs,
                                   args.threads or os.cpu_count())))
        return 0
    if args.vs_llama:
        return vs_llama(args)
    if args.child:
        print(json.dumps(_one(args.child[0], args.child[1], args.tokens, args.threads)))
        return 0

    from common.gguf_convert import convert_gguf
    from common.models import cache_root, resolve_model

    new = Path(resolve_model(None, progress=False))
    old = cache_root() / "bench" / "smollm2-135m-fp32"
    if not (old / "model.safetensors").is_file():
        convert_gguf(next(new.glob("*.gguf")), old)
    rows = []
    for label, model, quant in (("old: fp32 folder, --quant none", old, "none"),
                                ("new: the GGUF, --quant stored", new, "stored")):
        cmd = [sys.executable, "-m", "bench.gguf_demo", "--child", str(model), quant, "--tokens", str(args.tokens)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        rows.append((label, res, _du(model)))
    print(f"load average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs); {args.tokens} decode tokens, median of 3")
    print(f"{'':34} {'decode tok/s':>12} {'RSS loaded MB':>13} {'peak RSS MB':>11} {'disk MB':>8} {'load s':>7}"
          "  first words")
    for label, r, disk in rows:
        print(f"{label:34} {r['decode_tok_s']:12.1f} {r['loaded_rss_mb']:13.0f} {r['peak_rss_mb']:11.0f} "
              f"{disk:8.0f} {r['load_s']:7.1f}  {r['first_words']!r}")
    print("new formats:", rows[1][1]["formats"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
