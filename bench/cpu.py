"""CPU benchmark: stage 1 against llama.cpp and the roofline, every engine's logits against
transformers', on a dense Qwen3 shape or a Qwen3-MoE one.

    python -m bench cpu                      # Qwen3-0.6B shapes, both wait policies (~25 min idle)
    python -m bench cpu --quick              # a small model, one thread count, PASSIVE (< 2 min)
    python -m bench cpu --shape moe          # Qwen3-30B-A3B's layer shape, 12 layers x 32 experts
    python -m bench cpu --threads 2 --formats int8 --kernels plain,auto --save /tmp/cpu.json

In one run, so that every number saw the same machine: a random-weight model of the shape
(built once with transformers, and the same weights as GGUF files for llama.cpp), the memory
bandwidth, then every engine in a subprocess of its own, once per OpenMP wait policy: prefill
tok/s, the time to the first token, decode tok/s, and its logits against transformers fp32 (the
oracle, not timed).
It prints stage 1 ÷ llama.cpp and every engine's figures, each engine at its own best policy,
with the napkin maths (bytes per token, GB/s, % of the roofline); docs/benchmarks.md says how
each figure is measured.

Decode of one sequence reads every weight it uses once per token and does ~2 FLOP per
weight, so on a CPU it is bound by memory bandwidth: bytes per token *is* the speed. A MoE
token reads the attention, the router, its k experts of each layer and the lm_head; the
experts it skips cost RAM, not bandwidth. The roofline is bandwidth ÷ the weight bytes a
token reads. A new shape is one line of SHAPES; a new engine, a runner class (generate ->
tokens, prefill s, decode s) and a branch of make_runner.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.common import (BandwidthProbe, NeighbourMeter, as_users_run, busy_cores, check_load,
                          cpu_flags, emit_result, fmt_num, items, machine_description,
                          markdown_table, measure_bandwidth, median, policy_env, run_worker,
                          save_json, stage1_bytes, versions)
from common.engine import Request
from common.gguf_write import write_gguf
from common.sampling import SamplingParams
from stage1_cpu.jit.numba_cache import set_threads as set_numba_threads

CACHE = Path(os.environ.get("QWEN3_STAGES_CACHE",
                            Path.home() / ".cache" / "qwen3-stages")) / "bench"
CHECK_TOKENS = 16          # tokens whose logits every engine must agree on (the correctness table)
BUILD_VERSION = 1          # bump when the HF model changes, so old caches are rebuilt
# bump when the GGUF writing changes (3: common/gguf_write.py writes them)
GGUF_VERSION = 3
MAX_CTX = 1024             # every engine's context

# stage-1 weight format -> the llama.cpp format that stores the same numbers
LLAMA_FORMAT = {"bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}
# an AVX-512 host standing in for an AVX2 CPU: the workers inherit NUMBA_CPU_NAME=haswell (with
# NUMBA_CPU_FEATURES) and LLAMA_CPP_LIB_PATH from the caller (docs/benchmarks.md)
STAND_IN = os.environ.get("NUMBA_CPU_NAME") == "haswell"
POLICIES = {"both": ["PASSIVE", "default"], "all": ["PASSIVE", "ACTIVE", "default"],
            "PASSIVE": ["PASSIVE"], "ACTIVE": ["ACTIVE"], "default": ["default"]}



# ------------------------------------------------------------------ the model

@dataclass
class Shape:
    """The architecture numbers of the benchmark model (Qwen3 / Qwen3-MoE config.json keys).
    num_experts 0: a dense model; else every layer is an MoE layer (decoder_sparse_step 1,
    no mlp_only_layers) and intermediate_size is only written to the config, as
    Qwen3-30B-A3B's is."""
    name: str
    num_hidden_layers: int           # L
    hidden_size: int                 # C
    num_attention_heads: int         # H
    num_key_value_heads: int         # Hkv
    head_dim: int                    # D
    intermediate_size: int           # F
    vocab_size: int                  # V
    eos_token_id: list[int] = field(default_factory=list)
    num_experts: int = 0             # E routed experts per layer
    num_experts_per_tok: int = 0     # k chosen per token (norm_topk_prob: their weights sum to 1)
    moe_intermediate_size: int = 0   # Fe, one expert's MLP width

    def linear_params(self) -> int:
        """Weights of all matmuls one token goes through, the tied lm_head included: per layer
        q, k, v and o, then the dense gate, up and down, or (MoE) the router [E, C] and the k
        chosen experts' gate, up [Fe, C] and down [C, Fe]."""
        C, H, Hkv, D = (self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
                        self.head_dim)
        mlp = (self.num_experts * C + self.num_experts_per_tok * 3 * C * self.moe_intermediate_size
               if self.num_experts else 3 * C * self.intermediate_size)
        return (self.num_hidden_layers * (2 * C * H * D + 2 * C * Hkv * D + mlp)
                + self.vocab_size * C)


SHAPES = {
    "0.6b": Shape("qwen3-0.6b-shape", 28, 1024, 16, 8, 128, 3072, 151936, [151645, 151643]),
    "quick": Shape("qwen3-quick", 4, 512, 8, 4, 64, 1536, 32000, [31999]),
    "tiny": Shape("qwen3-tiny", 2, 128, 4, 2, 32, 256, 512, [511]),
    # 12 layers put the lm_head clearly under a third of the bf16 decode bytes (311 M of 991 M
    # weights read per token), 2.35 G weights in all: bf16 4.7 GB, what a 24 GiB, 2-core machine
    # builds and runs; the attention and the experts are Qwen3-30B-A3B's, 32 of its 128 experts
    "moe": Shape("qwen3-moe-a3b-layers", 12, 2048, 32, 4, 128, 6144, 151936, [151645, 151643], 32,
                 8, 768),
    "moe-quick": Shape("qwen3-moe-quick", 4, 512, 8, 2, 64, 1024, 32000, [31999], 16, 4, 256),
    "moe-tiny": Shape("qwen3-moe-tiny", 2, 128, 4, 2, 32, 256, 512, [511], 8, 2, 64),
}


def build_hf_model(shape: Shape, folder: Path) -> None:
    """A random-weight Qwen3ForCausalLM (or Qwen3MoeForCausalLM) in bf16, saved by transformers
    itself. An MoE model is built in bf16 from the start, so the full shape never exists in fp32."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    kw = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
              intermediate_size=shape.intermediate_size,
              num_hidden_layers=shape.num_hidden_layers,
              num_attention_heads=shape.num_attention_heads,
              num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
              max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=True,
              initializer_range=0.02, bos_token_id=None, eos_token_id=shape.eos_token_id)
    saved = torch.get_default_dtype()
    if shape.num_experts:
        kw.update(num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok,
                  moe_intermediate_size=shape.moe_intermediate_size, norm_topk_prob=True,
                  decoder_sparse_step=1,
                  mlp_only_layers=[])
        torch.set_default_dtype(torch.bfloat16)
    try:
        config_cls, model_cls = ((tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM) if shape.num_experts
                                 else (tf.Qwen3Config, tf.Qwen3ForCausalLM))
        model = model_cls(config_cls(**kw)).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(saved)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": shape.eos_token_id,
                                                               "do_sample": False}))


def prepare_models(shape: Shape, cache: Path, log=print, quants=("BF16", "Q8_0", "Q4_0")) -> dict:
    """-> {"hf": folder, "BF16": path, "Q8_0": path, "Q4_0": path}, built once and cached; only
    the GGUF files in `quants` are written. As llama.cpp's converter does, every matrix is in the
    file's type except in Q4_0 files the one every logit goes through (the tied token_embd),
    which is Q8_0, as stage 1's int4 keeps its lm_head in int8."""
    root = cache / f"{shape.name}-v{BUILD_VERSION}"
    hf = root / "hf"
    paths = {"hf": hf,
             **{q: root / f"{shape.name}-{q}-g{GGUF_VERSION}.gguf"
                for q in ("BF16", "Q8_0", "Q4_0")}}
    if not (hf / "DONE").exists():
        t0 = time.perf_counter()
        log(f"building the random-weight {shape.name} model in {hf} ...")
        hf.mkdir(parents=True, exist_ok=True)
        build_hf_model(shape, hf)
        (hf / "DONE").write_text("ok")
        log(f"  done in {time.perf_counter() - t0:.0f} s")
    for q in quants:
        if not paths[q].exists():
            t0 = time.perf_counter()
            log(f"writing {paths[q].name} ...")
            tmp = paths[q].with_suffix(".tmp")
            write_gguf(hf, tmp, q, embed_qtype="Q8_0" if q == "Q4_0" else None)
            tmp.rename(paths[q])
            log(f"  done in {time.perf_counter() - t0:.0f} s")
    return paths


def gguf_decode_bytes(path: Path, shape: Shape) -> int:
    """Bytes of weights one llama.cpp decode token reads from a GGUF file, counted as
    stage1_bytes(decode=True) counts stage 1's: every matrix (the tied token_embd once, as the
    lm_head), each stacked expert tensor for k of its E experts; the 1-D norms left out."""
    import gguf
    total = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        if len(t.shape) >= 2:
            share = shape.num_experts_per_tok / shape.num_experts if "_exps." in t.name else 1.0
            total += round(int(t.n_bytes) * share)
    return total


# ------------------------------------------------------------------ the engines

class Stage1Runner:
    """Stage 1 through the Engine protocol, exactly as the chat and the server use it."""

    def __init__(self, folder: str, fmt: str, threads: int, kernels: str, activations: str):
        # stage 1 is imported here, in its own worker: a worker of another engine never loads its
        # kernels
        from stage1_cpu.engine import LLMEngine
        from stage1_cpu.fast import cpu
        self.kernels, self.cpu = kernels, cpu
        self.engine = LLMEngine(folder, quant={"fp32": "none"}.get(fmt, fmt), threads=threads,
                                max_ctx=MAX_CTX,
                                progress=False, kernels=kernels, activations=activations)
        self.count = 0

    def set_threads(self, n: int) -> None:
        set_numba_threads(n)                   # numba's thread count is process-wide

    def isa(self) -> str:
        return (f"--kernels {self.kernels}: {self.engine.describe_kernels()}; numba target "
                f"{self.cpu.target_name()}, the fast path's instructions there: "
                f"{self.cpu.instructions()}")

    def all_logits(self, ids: list[int]) -> np.ndarray:
        """[T, V]: the first half in one forward (the prefill path), the second half one
        token at a time (the decode path): each rounds activations its own way (quant.py)."""
        self.engine.reset()
        model, half = self.engine.model, len(ids) // 2
        logits = [model.forward(np.asarray(ids[:half], dtype=np.int64), 0, all_logits=True)]
        logits += [model.forward(np.asarray([t], dtype=np.int64), half + i)[None]
                   for i, t in enumerate(ids[half:])]
        self.engine.reset()                    # the cache holds these ids now; forget them
        return np.concatenate(logits).astype(np.float32)   # [T, V]

    def generate(self, prompt: list[int], n_decode: int) -> tuple[list[int], float, float]:
        """-> (tokens, prefill seconds, seconds of n_decode decode steps).

        Every runner times the same things: prefill = the prompt's forward pass plus
        picking the first token; decode = n_decode steps of (forward one token, pick
        the next). The engine's step() that finishes the prompt also feeds the first
        token back, so prefill is timed only on prefill-only requests (n_decode=0,
        max_tokens=1: that step feeds nothing), and decode from the first token's
        event to the (n_decode+1)-th: exactly n_decode feeds and samples.
        """
        self.count += 1
        params = SamplingParams(temperature=0.0, max_tokens=n_decode + 2 if n_decode else 1,
                                ignore_eos=True)
        tokens: list[int] = []
        times: list[float] = []                    # when each token's event arrived
        t0 = time.perf_counter()
        self.engine.add_request(Request(id=f"bench-{self.count}", prompt_ids=list(prompt),
                                        params=params))
        while self.engine.has_work():
            for ev in self.engine.step():
                if ev.token_id >= 0:
                    tokens.append(ev.token_id)
                    times.append(time.perf_counter())
        decode_s = times[n_decode] - times[0] if n_decode else 0.0
        return tokens[:n_decode + 1], times[0] - t0, decode_s


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's low-level eval: no sampler chain, the same
    greedy argmax in Python as the other engines, the KV cache cleared per prompt."""

    def __init__(self, path: str, threads: int, logits_all: bool = False):
        import llama_cpp
        self.llama_cpp = llama_cpp
        batch = 64 if logits_all else 512      # every position's logits: keep that buffer small
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=64 if logits_all else MAX_CTX,
                                   n_batch=batch,
                                   n_ubatch=batch, n_threads=threads, n_threads_batch=threads,
                                   logits_all=logits_all, use_mmap=True, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def set_threads(self, n: int) -> None:
        self.llama_cpp.llama_set_n_threads(self.llm.ctx, n, n)

    def isa(self) -> str:
        """llama.cpp's system info (the instruction sets its ggml-cpu was built with) and its
        library."""
        info = self.llama_cpp.llama_print_system_info()
        info = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
        lib = getattr(self.llama_cpp.llama_cpp, "_base_path", "?")
        return (f"llama-cpp-python {getattr(self.llama_cpp, '__version__', '?')} from {lib}: "
                f"{info.strip()}")

    def _next(self) -> int:
        ptr = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)   # the last token's logits [V]
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def generate(self, prompt, n_decode):
        self.llm.reset()                       # eval() drops the KV cache from position 0 on
        t0 = time.perf_counter()
        self.llm.eval(list(prompt))            # prefill in batches of n_batch = 512
        tokens = [self._next()]
        t_first = time.perf_counter()
        for _ in range(n_decode):
            self.llm.eval([tokens[-1]])
            tokens.append(self._next())
        return tokens, t_first - t0, time.perf_counter() - t_first

    def all_logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(list(ids))
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)   # [T, V]


class TransformersRunner:
    """transformers fp32 on CPU: the oracle every engine's logits are checked against."""

    def __init__(self, folder: str):
        # here: a worker of another engine never pays torch's RSS
        import torch
        import transformers as tf
        self.torch = torch
        self.model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def all_logits(self, ids):
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.tensor([list(ids)]))
        return out.logits[0].float().numpy()


def make_runner(spec: dict, threads: int, check: bool = False):
    if spec["engine"] == "stage1":
        return Stage1Runner(spec["path"], spec["fmt"], threads, spec["kernels"],
                            spec["activations"])
    if spec["engine"] == "llama.cpp":
        return LlamaCppRunner(spec["path"], threads, logits_all=check)
    return TransformersRunner(spec["path"])


def prompt_ids(vocab: int, length: int, seed: int) -> list[int]:
    """Random token ids; a new prompt per run, so no engine can reuse a cached prefix."""
    return np.random.default_rng(seed).integers(10, vocab - 300, size=length).tolist()


def worker(spec: dict) -> None:
    """Runs in its own process: one engine, one format, every thread count."""
    as_users_run(spec["engine"])                # a peer: its wait policy as given, not stage 1's
    result = {"cells": {}}
    n0, vocab = spec["threads"][0], spec["vocab"]
    try:
        if spec.get("check_ids") and spec["engine"] == "llama.cpp":
            # llama.cpp keeps every position's logits only in a context made for that:
            # check first, then free it, so the two never count twice in the peak RSS
            checker = make_runner(spec, n0, check=True)
            np.save(spec["check_out"], checker.all_logits(spec["check_ids"]))
            del checker
        t0 = time.perf_counter()
        runner = make_runner(spec, n0)
        result["load_s"] = time.perf_counter() - t0
        result["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "unset")   # stage 1's chosen
        if spec.get("check_ids") and spec["engine"] != "llama.cpp":
            np.save(spec["check_out"], runner.all_logits(spec["check_ids"]))
        if spec.get("check_ids"):
            result["check_file"] = spec["check_out"]
        if spec["engine"] == "transformers":    # the oracle: its logits alone
            emit_result(result)
            return
        try:
            result["isa"] = runner.isa()
        except Exception as e:                  # a report line, never a failed cell
            result["isa"] = f"unknown ({type(e).__name__}: {e})"
    # a missing package or engine is one cell, not the run
    except Exception as e:
        emit_result({"error": f"{type(e).__name__}: {e}"})
        return

    # the read bandwidth just before and just after each decode run: this VM's moves
    # within seconds, and the run's roofline is what the memory could do meanwhile
    probe = BandwidthProbe()
    ttft_lens, decode_prompt = spec["ttft_lens"], spec["decode_prompt"]
    for n in spec["threads"]:
        runner.set_threads(n)
        # warm-up, not counted: every size that is measured below, once (JIT, allocations, the
        # weights' pages, gemm.py's packed copies, llama.cpp's compute buffers for a full batch)
        for p in [*spec["prompt_lens"], *ttft_lens]:
            runner.generate(prompt_ids(vocab, p, seed=1 + p), 0)
        runner.generate(prompt_ids(vocab, decode_prompt, seed=2), spec["decode_tokens"])
        cell = {"prefill": {str(p): [] for p in spec["prompt_lens"]}, "decode": [], "decode_bw": [],
                "ttft": {str(p): [] for p in ttft_lens}, "runs": spec["runs"]}
        for r in range(spec["runs"]):
            # a fresh random prompt each time, so no engine can reuse a cached prefix
            for p in spec["prompt_lens"]:
                _, t_prefill, _ = runner.generate(
                    prompt_ids(vocab, p, seed=1000 * n + 10 * r + p), 0)
                cell["prefill"][str(p)].append(p / t_prefill)
            # time to the first token of a chat-sized prompt, seconds
            for p in ttft_lens:
                _, t_first, _ = runner.generate(
                    prompt_ids(vocab, p, seed=1000 * n + 10 * r + p + 3), 0)
                cell["ttft"][str(p)].append(t_first)
            before = probe.read(n)
            _, _, t_decode = runner.generate(
                prompt_ids(vocab, decode_prompt, seed=1000 * n + 10 * r + 5),
                spec["decode_tokens"])
            after = probe.read(n)
            cell["decode"].append(spec["decode_tokens"] / t_decode)
            # the better one, as for the run's figure
            cell["decode_bw"].append(max(before, after))
        result["cells"][str(n)] = cell
        print(f"{spec['engine']} {spec['fmt']} threads={n}: "
              f"decode {median(cell['decode']):.1f} tok/s", flush=True)
    probe.close()
    # what one decode token reads, as the engine holds it
    if spec["engine"] == "stage1":
        result["weight_bytes"] = stage1_bytes(runner.engine.weights, decode=True)
    emit_result(result)


# ------------------------------------------------------------------ the runs

@dataclass
class Row:
    engine: str                      # the report's name: stage1, "stage1 plain", llama.cpp
    fmt: str
    weight_bytes: int | None         # what one decode token reads
    result: dict


def table_plans(args) -> list[dict]:
    """Which runs each table makes: one table per wait policy. The first measures
    everything asked for (every thread count, the logits check); the next ones, in a full
    run, only the largest thread count, so that two policies cost ~1.5x one, not 2x.
    With --busy the default policy comes first: the busy table shows it at every count."""
    policies = sorted(POLICIES[args.omp_wait_policy], key=lambda p: args.busy and p != "default")
    return [{"policy": policy,
             "threads": args.threads if i == 0 or args.quick else [max(args.threads)],
             "check": i == 0} for i, policy in enumerate(policies)]


def stage1_label(kernels: str) -> str:
    return "stage1" if kernels == "auto" else f"stage1 {kernels}"


def jobs_for(args, shape: Shape, paths: dict, plan: dict,
             tmp: Path) -> list[tuple[str, int | None, dict]]:
    """One table's workers: (the row's engine name, the bytes a decode token reads where they
    are known before the run (llama.cpp's, from its file; stage 1's worker counts its own),
    the worker's spec)."""
    check_ids = prompt_ids(shape.vocab_size, CHECK_TOKENS, seed=7)

    def check(out):
        return {"check_ids": check_ids, "check_out": str(tmp / out)} if plan["check"] else {}

    hf = str(paths["hf"])
    jobs = []
    if "transformers" in args.engines and plan["check"]:           # the oracle, not timed
        jobs.append(("transformers", None,
                     dict(engine="transformers", fmt="fp32", path=hf, **check("hf.npy"))))
    for fmt in args.formats:
        if "stage1" in args.engines:
            for kernels in args.kernels:
                label = stage1_label(kernels)
                jobs.append((label, None, dict(engine="stage1", fmt=fmt, path=hf, kernels=kernels,
                                                  **check(f"{label}-{fmt}.npy"))))
        if "llama.cpp" in args.engines:
            q = LLAMA_FORMAT[fmt]
            jobs.append(("llama.cpp",
                         gguf_decode_bytes(paths[q], shape) if paths[q].exists() else None,
                         dict(engine="llama.cpp", fmt=q, path=str(paths[q]),
                              **check(f"llama.cpp-{q}.npy"))))
    return jobs


def run_tables(args, shape: Shape, paths: dict, log, check: bool = True) -> list[dict]:
    """A table per wait policy (table_plans), with the cores other processes used meanwhile;
    check False: no logits check (beside busy processes: the same weights, checked quiet)."""
    tables = []
    for plan in table_plans(args):
        plan = dict(plan, check=plan["check"] and check)
        log(f"--- table: OMP_WAIT_POLICY={plan['policy']}, threads {plan['threads']}")
        t0, table_meter = time.perf_counter(), NeighbourMeter()
        rows, checked = run_table(args, shape, paths, log, plan)
        others = table_meter.cores_used_by_others()
        tables.append({"plan": plan, "rows": rows, "check": checked, "others": others,
                       "wall_s": time.perf_counter() - t0})
    return tables


def run_table(args, shape: Shape, paths: dict, log, plan: dict) -> tuple[list[Row], dict]:
    """One table: every worker of the plan under its wait policy, then every engine's
    logits against transformers fp32's."""
    base = dict(vocab=shape.vocab_size, threads=plan["threads"], prompt_lens=args.prompt_lens,
                ttft_lens=args.ttft_lens, decode_prompt=args.decode_prompt,
                decode_tokens=args.decode_tokens,
                runs=args.runs, activations=args.activations, kernels="auto")
    tmp = Path(tempfile.mkdtemp(prefix="bench-cpu-"))
    rows, reference = [], None
    for label, nbytes, spec in jobs_for(args, shape, paths, plan, tmp):
        if spec["engine"] == "llama.cpp" and not llama_cpp_installed():
            rows.append(Row(label, spec["fmt"], nbytes, {"error": "not installed"}))
            continue
        log(f"running {label} {spec['fmt']} (OMP_WAIT_POLICY={plan['policy']}) ...")
        t0 = time.perf_counter()
        res = run_worker("bench.cpu", dict(base, **spec), timeout=args.worker_timeout, log=log,
                         omp_wait_policy=plan["policy"])
        wall = time.perf_counter() - t0
        log(f"  {label} {spec['fmt']}: {res['error']}" if "error" in res
            else f"  done in {wall:.0f} s, peak RSS {res['peak_rss_mib']:.0f} MiB")
        if spec["engine"] == "transformers" and res.get("check_file"):
            reference = np.load(res["check_file"])
        if spec["engine"] != "transformers" or "error" in res:
            rows.append(Row(label, spec["fmt"], res.get("weight_bytes") or nbytes, res))
    check = {}
    for row in rows:
        f = row.result.get("check_file")
        if reference is not None and f and Path(f).exists():
            check[(row.engine, row.fmt)] = logits_agreement(reference, np.load(f))
    shutil.rmtree(tmp, ignore_errors=True)
    return rows, check


def logits_agreement(ref: np.ndarray, got: np.ndarray) -> dict:
    """How close an engine's logits [T, V] are to transformers fp32's on the same weights."""
    err = np.abs(ref - got).max() / np.abs(ref).max()
    cos = float(np.mean(np.sum(ref * got, -1)
                        / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1))))
    return {"max_rel_err": float(err), "cosine": cos,
            "top1": float(np.mean(ref.argmax(-1) == got.argmax(-1)))}


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def ik_llama_bench(args, paths: dict, log) -> list[dict]:
    """--ik-bench BIN: ik_llama.cpp, built by hand from its sources, as a yardstick (nothing of it
    is in this repository): its llama-bench on the same GGUF files, prefill at --prompt-lens and
    decode of --decode-tokens from an empty context, each at its best of both wait policies and of
    its run-time repack (-rtr 0/1). -> `best` entries as save_results writes them, engine
    "ik_llama.cpp"."""
    best: dict = {}
    for q in [LLAMA_FORMAT[f] for f in args.formats if paths.get(LLAMA_FORMAT[f], Path()).exists()]:
        for policy in POLICIES[args.omp_wait_policy]:
            for rtr in (0, 1):
                cmd = [str(args.ik_bench), "-m", str(paths[q]), "-p",
                       ",".join(map(str, args.prompt_lens)), "-n",
                       str(args.decode_tokens), "-t", str(max(args.threads)), "-r", str(args.runs),
                       "-rtr", str(rtr),
                       "-o", "json"]
                done = subprocess.run(cmd, env=policy_env(policy), capture_output=True, text=True,
                                      timeout=args.worker_timeout)
                if done.returncode:
                    log(f"ik_llama.cpp {q} failed: {done.stderr.strip()[-300:]}")
                    continue
                for t in json.loads(done.stdout):
                    metric = str(t["n_prompt"]) if t["n_prompt"] else "decode"
                    key = (q, metric)
                    if t["avg_ts"] > best.get(key, {}).get("value", 0):
                        best[key] = dict(engine="ik_llama.cpp", format=q, threads=max(args.threads),
                                         metric=metric,
                                         policy=f"{policy}, -rtr {rtr}", value=t["avg_ts"])
                log(f"ik_llama.cpp {q} ({policy}, -rtr {rtr}): " + ", ".join(
                    f"{k[1]} {v['value']:.1f}" for k, v in best.items() if k[0] == q))
    return list(best.values())


# ------------------------------------------------------------------ the report

def best_by_policy(args, tables: list[dict]) -> dict:
    """(engine, format, threads, metric) -> (best median, its policy, its row, its cell), over
    every table; metric: "decode", a prompt length (prefill tok/s) or "ttftP" (1 / seconds, so
    that larger is better for every metric)."""
    best = {}
    for t in tables:
        for row in t["rows"]:
            for n, cell in row.result.get("cells", {}).items():
                values = {"decode": median(cell["decode"])}
                values.update({p: median(cell["prefill"][str(p)]) for p in args.prompt_lens})
                values.update({f"ttft{p}": 1 / median(v) for p, v in cell["ttft"].items() if v})
                for metric, v in values.items():
                    key = (row.engine, row.fmt, int(n), metric)
                    if v == v and (key not in best or v > best[key][0]):
                        best[key] = (v, t["plan"]["policy"], row, cell)
    return best


def saved_best(best: dict) -> list[dict]:
    """best_by_policy's figures as --save writes them: the time to the first token in seconds."""
    return [dict(engine=e, format=f, threads=n, metric=str(m), policy=pol,
                 value=1 / v if str(m).startswith("ttft") else v)
            for (e, f, n, m), (v, pol, _, _) in best.items()]


def at_threads(best: list[dict], n: int) -> dict:
    """A run's saved `best` at n threads -> {(engine, format, metric): (value, policy)}."""
    return {(b["engine"], b["format"], b["metric"]): (b["value"], b["policy"]) for b in best
            if b["threads"] == n}


def comparison(got: dict) -> str:
    """Stage 1 ÷ llama.cpp, a row per stage-1 kernel set, format and metric, each engine's figure
    with the wait policy that gave it (a ratio under one policy alone flatters whichever engine
    suffers less from it); for the time to the first token, llama.cpp's time ÷ stage 1's.
    got: at_threads(...). The run's summary prints it, and `bench report` writes the docs' table
    with it."""
    rows, has_ik = [], any(e == "ik_llama.cpp" for e, _, _ in got)
    for label in sorted({e for e, _, _ in got if e.startswith("stage1")}):
        for fmt, q in LLAMA_FORMAT.items():
            for m in sorted({m for e, f, m in got if (e, f) == (label, fmt)},
                            key=lambda m: (m[0] == "t", m != "decode", len(m), m)):
                s, ll, ttft = (got[(label, fmt, m)], got.get(("llama.cpp", q, m)),
                               m.startswith("ttft"))

                def show(v):
                    return ((f"{v[0] * 1e3:.0f} ms" if ttft else f"{v[0]:.1f}") + f" ({v[1]})"
                            if v else "–")

                ratio = (ll[0] / s[0] if ttft else s[0] / ll[0]) if ll else None
                what = (f"first token, {m[4:]}-token prompt" if ttft
                        else "decode tok/s" if m == "decode"
                        else f"prefill {m} tok/s")
                ik = got.get(("ik_llama.cpp", q, m))
                rows.append([label, f"{fmt} / {q}", what, show(s), show(ll),
                             "–" if ratio is None else f"{ratio:.2f}×"]
                            + [show(ik), f"{s[0] / ik[0]:.2f}×" if ik and not ttft else "–"]
                            * has_ik)
    header = (["stage 1", "formats", "what", "stage 1", "llama.cpp", "ratio"]
              + ["ik_llama.cpp", "÷ ik"] * has_ik)
    return markdown_table(header, rows)


def decode_roofline(cell: dict, nbytes: int | None) -> float:
    """The median over the runs of decode tok/s ÷ that run's roofline tok/s (the bandwidth
    measured next to it ÷ the bytes a token reads); nan where not measured."""
    bws = cell.get("decode_bw") or []
    if not bws or not nbytes:
        return float("nan")
    return median([d * nbytes / (b * 1e9) for d, b in zip(cell["decode"], bws)])


def engine_table(args, best: dict, check: dict, n: int) -> str:
    """Every engine at n threads, each figure its best median over the wait policies: weight bytes
    a decode token reads, decode tok/s, the GB/s that makes and its % of the roofline, prefill
    tok/s and the time to the first token per prompt length, peak RSS, and the logits against
    transformers fp32's (max abs error / max abs logit, cosine, same argmax)."""
    rows = []
    for (e, f, k, m), (v, _, row, cell) in best.items():
        if (k, m) == (n, "decode"):
            get = lambda metric: best.get((e, f, n, metric), [float("nan")])[0]  # noqa: E731
            c, mb = check.get((e, f)), row.weight_bytes / 1e6 if row.weight_bytes else None
            rows.append([e, f, fmt_num(mb, 0), fmt_num(v), fmt_num(mb and v * mb / 1e3),
                         fmt_num(100 * decode_roofline(cell, row.weight_bytes), 0),
                         *(fmt_num(get(p)) for p in args.prompt_lens),
                         *(fmt_num(1e3 / get(f"ttft{p}"), 0)
                                                                         for p in args.ttft_lens),
                         fmt_num(row.result.get("peak_rss_mib"), 0),
                         f"{c['max_rel_err']:.4f} / {c['cosine']:.6f} / {c['top1']:.0%}" if c
                         else "–"])
    return markdown_table(["engine", "format", "MB/token", "decode tok/s", "GB/s", "% roofline",
                           *(f"prefill {p} tok/s" for p in args.prompt_lens),
                           *(f"first token {p} ms" for p in args.ttft_lens), "peak RSS MiB",
                           f"logits of {CHECK_TOKENS} tokens vs fp32"], rows)


def report(args, shape: Shape, tables: list[dict], bw: dict, loads: tuple[float, float, float],
           ik: list[dict]) -> str:
    """The run as markdown: where it ran and what each engine ran on, then per thread count stage
    1 ÷ llama.cpp and every engine's figures, each engine at its best wait policy. The logits
    are checked as docs/benchmarks.md says (stage 1: the first half of the tokens in one forward,
    as prefill does, the rest one at a time, as decode does)."""
    busy = lambda cores: " **busy: numbers may be low**" if cores > 0.25 else ""  # noqa: E731
    moe = (f", E={shape.num_experts} experts of Fe={shape.moe_intermediate_size}, "
           f"top-{shape.num_experts_per_tok}"
           if shape.num_experts else "")
    out = [f"## CPU benchmark: {shape.name}" + (" (AVX2 machine stand-in)" if STAND_IN else ""), "",
           f"- machine: {machine_description()}",
           "- command: `" + " ".join(["python -m bench cpu", *args.argv]) + "`",
           f"- 1-minute load before {loads[0]:.2f}, after {loads[1]:.2f} (with the benchmark's own "
           f"threads); other processes used {loads[2]:.2f} cores on average{busy(loads[2])}; per "
           "OMP_WAIT_POLICY: " + "; ".join(
               f"{t['plan']['policy']} {t['wall_s'] / 60:.1f} min, "
               f"others {t['others']:.2f} cores{busy(t['others'])}"
               for t in tables),
           f"- model: {shape.num_hidden_layers} layers, C={shape.hidden_size}, "
           f"H/Hkv={shape.num_attention_heads}/{shape.num_key_value_heads}, D={shape.head_dim}, "
           f"F={shape.intermediate_size}{moe}, V={shape.vocab_size}; "
           f"{shape.linear_params() / 1e6:,.0f} M weights read per decode token",
           "- read bandwidth, the better of start / end: " + ", ".join(
               f"{t} thread{'s' * (t > 1)} {bw['read'][t]:.1f} GB/s ({bw['start']['read'][t]:.1f} "
               f"/ {bw['end']['read'][t]:.1f})" for t in args.threads)]
    rows = [row for t in tables for row in t["rows"]]
    out += sorted({f"- {r.engine} {r.fmt}: {r.result['isa']}" for r in tables[0]["rows"]
                   if r.result.get("isa")})
    out += sorted({f"- {r.engine} {r.fmt}: **{r.result['error']}**" for r in rows
                   if "error" in r.result})
    best, check = best_by_policy(args, tables), tables[0]["check"]
    out += headline(args, best, ik)
    for n in sorted({n for t in tables for n in t["plan"]["threads"]}):
        out += [f"### every engine at {n} thread{'s' * (n > 1)}, "
                "each figure at its best wait policy", "",
                engine_table(args, best, check, n), ""]
    return "\n".join(out + ["logits not checked (transformers fp32 did not run)"]
                     * (not check)) + "\n"


def headline(args, best: dict, ik: tuple = ()) -> list[str]:
    """Per thread count, stage 1 ÷ llama.cpp (comparison) from best_by_policy's figures."""
    out = []
    for n in sorted({k[2] for k in best}):
        out += ["",
                f"### {n} thread{'s' * (n > 1)}: stage 1 ÷ llama.cpp, "
                "each engine at its own best wait policy"
                + (f" (--activations {args.activations})" if args.activations != "auto" else ""),
                "",
                comparison(at_threads(saved_best(best) + list(ik), n)), ""]
    return out


def save_results(args, shape: Shape, tables: list[dict], bw: dict, others: float,
                 ik: list[dict]) -> None:
    """--save: the run as JSON, which `bench report` writes the docs' tables from and `bench
    figures` the roofline: machine, SIMD flags, whether it stood in for a Haswell, date, command,
    versions, each engine's decode at its best policy and the largest thread count (`rows`) and its
    best median over the policies per thread count and metric (`best`; ttftP in seconds)."""
    found = best_by_policy(args, tables)
    rows = [dict(policy=pol, threads=n, engine=e, format=f, mb_per_token=row.weight_bytes / 1e6,
                 decode_tok_s=v)
            for (e, f, n, m), (v, pol, row, _) in found.items()
            if m == "decode" and n == max(args.threads) and row.weight_bytes]
    save_json(args.save, "python -m bench cpu " + " ".join(args.argv),
              cpu_flags=sorted(f for f in cpu_flags()[1] if f.startswith(("avx", "fma", "f16c"))),
              cpu_profile="avx2" if STAND_IN else "native", shape=shape.name, quick=args.quick,
              threads=args.threads,
              others_cores=round(others, 2), versions=versions(),
              bandwidth_gb_s=max(bw["read"].values()), rows=rows,
              best=saved_best(found) + ik,
              isa=sorted({f"{r.engine} {r.fmt}: {r.result['isa']}" for r in tables[0]["rows"]
                                     if r.result.get("isa")}))


def busy_results(args, loads: list[dict]) -> dict:
    """A --busy run as --save writes it: per load, its busy processes, the cores they and the rest
    of the machine kept busy, each engine's best figures (`best`, as save_results saves them), those
    of its default wait policy (`default`) and what that was (`ran_as`: stage 1's own choice)."""
    def figures(tables: list[dict], policy: str | None = None) -> list[dict]:
        chosen = [t for t in tables if policy in (None, t["plan"]["policy"])]
        return saved_best(best_by_policy(args, chosen))
    return dict(shape=args.shape.name, threads=args.threads, versions=versions(), loads=[dict(
        busy=load["busy"], busy_cores=round(load["busy_cores"], 2),
        others_cores=round(load["others"], 2), best=figures(load["tables"]),
        default=figures(load["tables"], "default"),
        ran_as={r.engine: r.result.get("omp_wait_policy") for t in load["tables"] for r in t["rows"]
                if t["plan"]["policy"] == "default"}) for load in loads])


def busy_table(data: dict) -> str:
    """A --busy run (busy_results) as a table: per engine, format, thread count and metric (decode,
    prefill), its figure at its default wait policy and at its best, quiet and beside each number
    of busy processes, with the share of its own quiet figure it keeps there."""
    loads = data["loads"]
    got = [{kind: {(b["engine"], b["format"], b["threads"], b["metric"]): b for b in load[kind]}
            for kind in ("default", "best")} for load in loads]
    rows = []
    order = lambda k: (k[0] == "llama.cpp", k[:3], k[3] != "decode", len(k[3]), k[3])  # noqa: E731
    for key in sorted((k for k in got[0]["best"] if not k[3].startswith("ttft")), key=order):
        for kind in ("default", "best"):
            quiet, cells = got[0][kind].get(key), []
            for i, g in enumerate(got):
                b = g[kind].get(key)
                notes = [b["policy"]] * (kind == "best") if b else []
                notes += [f"{100 * b['value'] / quiet['value']:.0f} %"] if i and b and quiet else []
                notes = f" ({', '.join(notes)})" if notes else ""
                cells.append(f"{b['value']:.1f}{notes}" if b else "–")
            what = "decode tok/s" if key[3] == "decode" else f"prefill {key[3]} tok/s"
            ran_as = loads[0]["ran_as"].get(key[0], "?")
            policy = f"default ({ran_as})" if kind == "default" else kind
            rows.append([*key[:2], str(key[2]), what, policy, *cells])
    busy = [f"{x['busy']} busy core{'s' * (x['busy'] > 1)}" for x in loads[1:]]
    head = ["engine", "format", "threads", "what", "wait policy", "quiet", *busy]
    return markdown_table(head, rows)


# ------------------------------------------------------------------ the command line

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=list(SHAPES), default=None,
                   help="the model: 0.6b (Qwen3-0.6B), moe (Qwen3-30B-A3B's layers, 12 x 32 "
                        "experts), their small versions quick and moe-quick, or tiny / moe-tiny "
                        "(seconds: the tests). Default 0.6b; --quick: quick")
    p.add_argument("--quick", action="store_true",
                   help="one thread count, 2 runs, PASSIVE only (and the quick shape)")
    p.add_argument("--threads", type=items(int),
                   help="comma-separated thread counts (default 1,2; quick: 2)")
    p.add_argument("--formats", type=items(allowed=tuple(LLAMA_FORMAT)), default="bf16,int8,int4",
                   help="stage-1 formats (default %(default)s)")
    p.add_argument("--engines", type=items(allowed=("stage1", "llama.cpp", "transformers")),
                   default="stage1,llama.cpp,transformers", help="engines (default %(default)s)")
    p.add_argument("--kernels", type=items(allowed=("auto", "plain", "fast")), default="auto",
                   help="stage 1's kernel sets, a row each: auto (the fast path where it runs), "
                        "plain (the portable core), fast; e.g. auto,plain (default auto)")
    p.add_argument("--activations", default="auto", choices=["auto", "int8", "fp32"],
                   help="stage 1's --activations (int8: llama.cpp's rounding, prefill on int8 too)"
                        " (default auto)")
    p.add_argument("--runs", type=int, default=None, help="warm runs per measurement; the median "
                                                          "is reported (default 3; quick: 2)")
    p.add_argument("--decode-tokens", type=int, default=128, help="decode's tokens (default 128)")
    p.add_argument("--prompt-lens", type=items(int), default="32,128,512",
                   help="prompt lengths for prefill tok/s (default %(default)s)")
    p.add_argument("--decode-prompt", type=int, default=128, help="decode's prompt (default 128)")
    p.add_argument("--ttft-lens", type=items(int), default="37,300",
                   help="prompt lengths whose time to first token is reported (chat-sized "
                        "prompts; '' for none; default %(default)s)")
    p.add_argument("--omp-wait-policy", default=None, choices=list(POLICIES),
                   help="OMP_WAIT_POLICY for every engine: both (a table under PASSIVE, then one "
                        "under each engine's default, as users run it: unset; the headline takes "
                        "each engine at its best), all (ACTIVE too), PASSIVE, ACTIVE or default. "
                        "Default: both; --quick: PASSIVE")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="the same comparison quiet, then beside 1..N processes that each keep a "
                        "core busy (a busy laptop), each engine at its default wait policy and its "
                        "best; --save writes the busy table's JSON (docs/results/busy.json). "
                        "Default 0")
    p.add_argument("--ik-bench", type=Path, default=None,
                   help="ik_llama.cpp's llama-bench, built by hand: "
                   "its prefill and decode on the same GGUF files, "
                   "saved as a column beside llama.cpp's")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the markdown summary to this file")
    p.add_argument("--save", type=Path, default=None,
                   help="also write the results as JSON (docs/results/cpu-CLASS.json: python -m "
                        "bench report writes the docs' tables from it, bench figures the "
                        "roofline)")
    p.add_argument("--cache-dir", type=Path, default=CACHE,
                   help="where the models are built and kept (default %(default)s)")
    p.add_argument("--worker-timeout", type=float, default=2400,
                   help="seconds one engine may take in all (default 2400)")
    p.add_argument("--speculative", action="store_true",
                   help="bench/speculative.py instead: speculative decoding "
                   "on real text, stage 1 (plain, ngram, --draft-model) "
                   "against llama.cpp (plain, prompt lookup)")
    for name, what in (("model", "the model (default: the default one)"),
                       ("draft-model", "stage 1's draft model"),
                       ("draft-tokens",
                        "drafts at most (stage 1: default its own; llama.cpp: 10)")):
        p.add_argument(f"--{name}", type=int if name == "draft-tokens" else str,
                       help=f"--speculative: {what}")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return _defaults_checked(p, p.parse_args(argv), argv)


def _defaults_checked(p: argparse.ArgumentParser, args: argparse.Namespace,
                      argv: list[str]) -> argparse.Namespace:
    """parse_args' result with --quick's and the others' defaults filled in, or p.error."""
    args.argv = argv
    args.shape = SHAPES[args.shape or ("quick" if args.quick else "0.6b")]
    args.threads = args.threads or ([min(2, os.cpu_count() or 1)] if args.quick else [1, 2])
    args.runs = args.runs or (2 if args.quick else 3)
    quick = args.quick and not args.busy
    args.omp_wait_policy = args.omp_wait_policy or ("PASSIVE" if quick else "both")
    if (any(t < 1 for t in args.threads) or args.runs < 1 or args.decode_tokens < 1
            or not args.prompt_lens):
        p.error("--threads, --runs, --decode-tokens and --prompt-lens must be positive")
    if args.busy < 0 or args.busy and "default" not in POLICIES[args.omp_wait_policy]:
        p.error("--busy N compares each engine as users run it: N >= 0, with the default policy")
    if (max([*args.prompt_lens, *args.ttft_lens, args.decode_prompt]) + args.decode_tokens + 1
            > MAX_CTX):
        p.error(f"prompt length + decode tokens must stay under the {MAX_CTX}-token context the "
                "engines are given")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.speculative:
        from bench.speculative import run   # here: its own benchmark, sharing this command line
        # the Qwen3-0.6B shape's model: its verify-cost (T) curve
        shape_model = prepare_models(SHAPES["0.6b"], args.cache_dir, log, quants=())["hf"]
        return run(args, POLICIES[args.omp_wait_policy], shape_model, log)
    shape = args.shape
    t_start, load_before = time.perf_counter(), os.getloadavg()[0]
    log(check_load("before"))
    meter = NeighbourMeter()
    if not llama_cpp_installed() and "llama.cpp" in args.engines:
        log("llama-cpp-python is not installed (pip install 'qwen3-stages[bench]'): "
            "its cells are empty")
    paths = prepare_models(shape, args.cache_dir, log, [LLAMA_FORMAT[f] for f in args.formats]
                           if "llama.cpp" in args.engines and llama_cpp_installed() or args.ik_bench
                           else [])
    mib = 256 if args.quick else 1024
    log("measuring memory bandwidth ...")
    bw = measure_bandwidth(args.threads, mib=mib)
    loads = []
    for n in range(args.busy + 1):                # --busy N: quiet, then beside 1..N busy processes
        load_meter = NeighbourMeter()             # (the busy ones count as ours once reaped)
        with busy_cores(n) as busy:
            if n:
                log(f"=== beside {n} busy process{'es' * (n > 1)} (pids {busy['pids']})")
            tables = run_tables(args, shape, paths, log, check=n == 0)
        around = load_meter.cores_used_by_others()
        loads.append(dict(busy=n, busy_cores=busy["cores"], others=around, tables=tables))
    tables = loads[0]["tables"]
    ik = ik_llama_bench(args, paths, log) if args.ik_bench else []
    load_after, others = os.getloadavg()[0], meter.cores_used_by_others()
    log(check_load("after") + " (this counts the benchmark's own threads)")
    # measured again at the end: a neighbour busy at the start lowers one of the two, and
    # the roofline is what the memory *can* do, so it uses the better of the two
    end = measure_bandwidth(args.threads, mib=mib)
    bw = {"read": {n: max(bw["read"][n], end["read"][n]) for n in args.threads}, "start": bw,
          "end": end}
    text = report(args, shape, tables, bw, (load_before, load_after, others), ik)
    busy_run = busy_results(args, loads) if args.busy else None
    text += ("\n### Beside busy processes: each engine at its default wait policy and its best\n\n"
             + busy_table(busy_run) + "\n") if busy_run else ""
    text += f"\n(total {time.perf_counter() - t_start:.0f} s)\n"
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
    if args.save and busy_run:
        save_json(args.save, "python -m bench cpu " + shlex.join(args.argv), **busy_run)
    elif args.save:
        save_results(args, shape, tables, bw, others, ik)
    if args.save:
        log(f"results written to {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
