"""CPU benchmark: stage 1 against llama.cpp and transformers, and against the roofline.

    python -m bench.cpu                      # Qwen3-0.6B shapes, both wait policies (~25 min idle)
    python -m bench.cpu --quick              # a small model, one thread count, PASSIVE (< 2 min, CI)
    python -m bench.cpu --threads 2 --formats int8 --runs 5 --out /tmp/bench.md
    python -m bench.cpu --kernels plain      # stage 1 without its fast path (stage1_cpu/fast/)
    python -m bench.cpu --cpu-profile avx2   # an AVX-512 host standing in for an AVX2 CPU

What it does, in one run (so every number saw the same machine):
  1. builds a random-weight model with the real Qwen3-0.6B shapes in bf16 with
     transformers' save_pretrained, and writes the *same* weights as GGUF files
     (BF16, Q8_0, Q4_0) for llama.cpp; all cached under ~/.cache/qwen3-stages/bench/;
  2. checks that llama.cpp reads those GGUF files the way transformers reads the
     folder (BF16 logits of a few tokens, printed);
  3. measures the memory bandwidth (the roofline's denominator);
  4. runs every engine in its own subprocess (peak RSS is then that engine's alone),
     once per OpenMP wait policy (PASSIVE, and the runtime's default, under which
     idle threads spin a while): prefill tok/s for a 128- and a 512-token prompt,
     decode tok/s over 128 greedy tokens with EOS ignored, the median of several
     runs, at each thread count; each worker reports the instructions it used;
  5. prints the headline, stage 1 ÷ llama.cpp per format with each engine at its
     own best policy, then one table per policy, and each decode as a fraction of
     its roofline = bandwidth ÷ weight bytes one decode token reads.

Decode of one sequence reads every weight once per token and does ~2 FLOP per
weight, so on a CPU it is bound by memory bandwidth: bytes per token *is* the
speed. The napkin maths is printed with the table and explained in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.gguf_write import _byte_level_alphabet  # noqa: F401  (bench/moe.py imports it from here)
from bench.common import (BandwidthProbe, NeighbourMeter, check_load, cpu_flags, emit_result, fmt_num,
                          load_1min, machine_description, markdown_table, measure_bandwidth, median, run_worker)

CACHE = Path(os.environ.get("QWEN3_STAGES_CACHE", Path.home() / ".cache" / "qwen3-stages")) / "bench"
CHECK_TOKENS = 16      # tokens whose logits every engine must agree on (see the correctness table)
BUILD_VERSION = 1          # bump when the HF model changes, so old caches are rebuilt
GGUF_VERSION = 2           # bump when the GGUF writing changes (2: Q4_0 files keep token_embd in Q8_0)

# stage-1 weight format -> the llama.cpp format that stores the same numbers
LLAMA_FORMAT = {"bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}
# the issue's targets, checked at 2 threads: (decode ratio, prefill-512 ratio, % of roofline)
TARGETS = {"bf16": (1.0, 0.8, 0.9), "int8": (1.0, 0.8, 0.9), "int4": (1.0, 0.8, None)}
POLICIES = {"both": ["PASSIVE", "default"], "PASSIVE": ["PASSIVE"], "ACTIVE": ["ACTIVE"], "default": ["default"]}

# --cpu-profile avx2: an "AVX2 machine" on an AVX-512 host. numba compiles stage 1 for a
# Haswell (no AVX-512, no VNNI; the fast path then picks its AVX2 int8 dot product), llama.cpp
# loads a second build made without AVX-512 (bench/build_llama_avx2.sh), torch caps its kernels
# at AVX2. The feature list is LLVM's names for what a Haswell has (a CPU name alone would leave
# stage1_cpu/fast/cpu.py assuming no features at all).
HASWELL_FEATURES = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+fsgsbase,+fxsr,+invpcid,+lzcnt,"
                    "+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,"
                    "+xsave,+xsaveopt")
AVX2_LLAMA_LIB = CACHE.parent / "llama-avx2" / "lib"     # where bench/build_llama_avx2.sh puts it


# ------------------------------------------------------------------ the model

@dataclass
class Shape:
    """The architecture numbers of the benchmark model (Qwen3 config.json keys)."""
    name: str
    num_hidden_layers: int           # L
    hidden_size: int                 # C
    num_attention_heads: int         # H
    num_key_value_heads: int         # Hkv
    head_dim: int                    # D
    intermediate_size: int           # F
    vocab_size: int                  # V
    eos_token_id: list[int] = field(default_factory=list)

    def linear_params(self) -> int:
        """Weights of all matmuls a token goes through, the tied lm_head included."""
        C, H, Hkv, D, F = (self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
                           self.head_dim, self.intermediate_size)
        per_layer = C * H * D + 2 * C * Hkv * D + H * D * C + 3 * C * F   # q, k+v, o, gate+up+down
        return self.num_hidden_layers * per_layer + self.vocab_size * C   # + lm_head [V, C]


QWEN3_0_6B = Shape("qwen3-0.6b-shape", 28, 1024, 16, 8, 128, 3072, 151936, [151645, 151643])
QUICK = Shape("qwen3-quick", 4, 512, 8, 4, 64, 1536, 32000, [31999])


def build_hf_model(shape: Shape, folder: Path) -> None:
    """A random-weight Qwen3ForCausalLM in bf16, saved by transformers itself."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=None, eos_token_id=shape.eos_token_id)
    model = tf.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    gen = {"eos_token_id": shape.eos_token_id, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen))


# HF tensor name (after "model.") -> llama.cpp name; convert_hf_to_gguf permutes q/k only
# for the llama architecture, and llama.cpp runs qwen3 with NEOX (rotate-half) RoPE, which
# is exactly HF's layout, so the weights are copied in their HF order.
GGUF_NAMES = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name == "lm_head.weight":
        return "output.weight"
    rest = hf_name.removeprefix("model.")
    if rest.startswith("layers."):
        _, layer, rest = rest.split(".", 2)
        return f"blk.{layer}.{GGUF_NAMES[rest]}"
    return GGUF_NAMES[rest]


def write_gguf(hf_folder: Path, shape: Shape, qtype_name: str, path: Path) -> None:
    """The HF folder's weights as a llama.cpp GGUF file (qwen3 architecture).

    Like llama.cpp's convert script: 1-D tensors (norms) stay F32, every matrix is
    stored in `qtype_name` (BF16, Q8_0 or Q4_0), with one exception in Q4_0 files:
    the matrix every logit goes through (the tied token_embd, or output) is Q8_0.
    llama-quantize keeps it finer too (Q6_K, which the gguf package cannot write),
    and stage 1's int4 keeps it in int8, so both engines read the same kind of bytes.
    The tokenizer is a minimal gpt2-style vocabulary of V tokens: the benchmark feeds
    token ids, never text.
    """
    import gguf
    import torch
    from safetensors import safe_open

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    ftype = {"BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype_name]
    cfg = json.loads((hf_folder / "config.json").read_text())
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "qwen3")
    w.add_name(shape.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(shape.hidden_size)
    w.add_block_count(shape.num_hidden_layers)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_head_count(shape.num_attention_heads)
    w.add_head_count_kv(shape.num_key_value_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta"))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(shape.vocab_size)
    w.add_file_type(ftype)

    # tokenizer: 256 byte tokens, one merge ("Ġ t" -> "Ġt"), fillers, the end-of-sequence ids
    tokens = _byte_level_alphabet() + ["Ġt"]
    tokens += [f"tok{i}" for i in range(len(tokens), shape.vocab_size)]
    types = [gguf.TokenType.NORMAL] * shape.vocab_size
    for eos in shape.eos_token_id:              # end-of-sequence ids are control tokens
        name = "<|endoftext|>" if eos == shape.eos_token_id[-1] else f"<|special{eos}|>"
        tokens[eos], types[eos] = name, gguf.TokenType.CONTROL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(shape.eos_token_id[0])
    w.add_bos_token_id(shape.eos_token_id[-1])
    w.add_add_bos_token(False)

    files = sorted(hf_folder.glob("*.safetensors"))
    tied = "lm_head.weight" not in {n for f in files for n in safe_open(f, framework="pt").keys()}
    logits_matrix = "token_embd.weight" if tied else "output.weight"
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                data = st.get_tensor(name).to(torch.float32).numpy()   # [out, in] as HF stores it
                if data.ndim == 1:
                    w.add_tensor(gguf_name(name), data)                 # norms: F32
                    continue
                t = qtype
                if qtype_name == "Q4_0" and gguf_name(name) == logits_matrix:
                    t = gguf.GGMLQuantizationType.Q8_0
                w.add_tensor(gguf_name(name), gguf.quants.quantize(data, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of every tensor in a GGUF file: with tied embeddings the lm_head reads
    all of token_embd each token, so this is what one decode step streams."""
    import gguf
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def prepare_models(shape: Shape, cache: Path, log=print, quants=("BF16", "Q8_0", "Q4_0")) -> dict:
    """-> {"hf": folder, "BF16": path, "Q8_0": path, "Q4_0": path}, built once and cached;
    only the GGUF files in `quants` are written (none when llama.cpp is not measured)."""
    root = cache / f"{shape.name}-v{BUILD_VERSION}"
    hf = root / "hf"
    paths = {"hf": hf, **{q: root / f"{shape.name}-{q}-g{GGUF_VERSION}.gguf" for q in ("BF16", "Q8_0", "Q4_0")}}
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
            write_gguf(hf, shape, q, paths[q])
            log(f"  done in {time.perf_counter() - t0:.0f} s")
    return paths


# ------------------------------------------------------------------ the engines

class Stage1Runner:
    """Stage 1 through the Engine protocol, exactly as the chat and the server use it."""

    def __init__(self, folder: str, fmt: str, threads: int, max_ctx: int, kernels: str = "auto",
                 activations: str = "auto"):
        from stage1_cpu.engine import LLMEngine
        self.kernels = kernels
        quant = {"fp32": "none"}.get(fmt, fmt)
        self.engine = LLMEngine(folder, quant=quant, threads=threads, max_ctx=max_ctx, progress=False,
                                kernels=kernels, activations=activations)
        self.count = 0

    def set_threads(self, n: int) -> None:
        from stage1_cpu import kernels
        kernels.set_threads(n)                 # numba's thread count is process-wide

    def weight_bytes(self) -> int:
        """What one decode token reads (for MoE only the routed experts' share; all of it
        for a dense model): bench/weight_bytes.py."""
        from bench.weight_bytes import stage1_bytes
        return stage1_bytes(self.engine.weights, decode=True)

    def isa(self) -> str:
        from stage1_cpu.fast import cpu
        return (f"--kernels {self.kernels}: {self.engine.describe_kernels()}; numba target {cpu.target_name()}, "
                f"the fast path's instructions there: {cpu.instructions()}")

    def all_logits(self, ids: list[int]) -> np.ndarray:
        """[T, V]: the first half in one forward (the prefill path), the second half one
        token at a time (the decode path): each rounds activations its own way (quant.py)."""
        self.engine.reset()
        model, half = self.engine.model, len(ids) // 2
        logits = [model.forward(np.asarray(ids[:half], dtype=np.int64), 0, all_logits=True)]
        logits += [model.forward(np.asarray([t], dtype=np.int64), half + i)[None] for i, t in enumerate(ids[half:])]
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
        from common.engine import Request
        from common.sampling import SamplingParams
        self.count += 1
        params = SamplingParams(temperature=0.0, max_tokens=n_decode + 2 if n_decode else 1, ignore_eos=True)
        tokens: list[int] = []
        times: list[float] = []                    # when each token's event arrived
        t0 = time.perf_counter()
        self.engine.add_request(Request(id=f"bench-{self.count}", prompt_ids=list(prompt), params=params))
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

    def __init__(self, path: str, threads: int, max_ctx: int, logits_all: bool = False, mmap: bool = True):
        import llama_cpp
        self.llama_cpp = llama_cpp
        batch = 64 if logits_all else 512      # every position's logits: keep that buffer small
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=64 if logits_all else max_ctx,
                                   n_batch=batch, n_ubatch=batch,
                                   n_threads=threads, n_threads_batch=threads,
                                   logits_all=logits_all, use_mmap=mmap, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def set_threads(self, n: int) -> None:
        self.llama_cpp.llama_set_n_threads(self.llm.ctx, n, n)

    def isa(self) -> str:
        """llama.cpp's system info (the instruction sets its ggml-cpu was built with) and its library."""
        info = self.llama_cpp.llama_print_system_info()
        info = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
        lib = getattr(self.llama_cpp.llama_cpp, "_base_path", "?")
        return f"llama-cpp-python {getattr(self.llama_cpp, '__version__', '?')} from {lib}: {info.strip()}"

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
    """transformers on CPU with its KV cache; only the last position's logits are
    computed (logits_to_keep=1), as the other engines do."""

    def __init__(self, folder: str, fmt: str, threads: int):
        import torch
        import transformers as tf
        self.torch = torch
        torch.set_num_threads(threads)
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[fmt]
        self.model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    def set_threads(self, n: int) -> None:
        self.torch.set_num_threads(n)

    def isa(self) -> str:
        torch = self.torch
        return f"torch {torch.__version__}, ATen CPU capability {torch.backends.cpu.get_cpu_capability()}"

    def generate(self, prompt, n_decode):
        torch = self.torch
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model(input_ids=torch.tensor([list(prompt)]), use_cache=True, logits_to_keep=1)
            tokens = [int(out.logits[0, -1].argmax())]
            t_first = time.perf_counter()
            cache = out.past_key_values
            for _ in range(n_decode):
                out = self.model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                                 use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                tokens.append(int(out.logits[0, -1].argmax()))
        return tokens, t_first - t0, time.perf_counter() - t_first

    def all_logits(self, ids):
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.tensor([list(ids)]))
        return out.logits[0].float().numpy()


class ReadOnlyRunner:
    """The ceiling: a "decode" that only reads, with 2 threads, the bytes a stage-1
    step must read, and computes nothing: the format's weight bytes, plus stage 1's
    fp32 KV cache up to the position (the roofline counts weights only, but attention
    reads the cache too). Measured like every engine, next to the same bandwidth
    probe, its % roofline is how close *anything* reading those bytes got."""

    def __init__(self, weight_bytes: int, kv_bytes_per_position: int, threads: int, max_ctx: int):
        from bench.common import _read_sum_kernel
        import numba
        self.read_sum = _read_sum_kernel()
        self.weights = np.ones(weight_bytes // 4, dtype=np.float32)
        self.kv = np.ones((max_ctx, kv_bytes_per_position // 4), dtype=np.float32)   # [T, L*2*Hkv*D]
        self.read_sum(self.weights[:1024])
        self.set_threads = lambda n: numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        self.set_threads(threads)

    def isa(self) -> str:
        from stage1_cpu.fast import cpu
        return f"a numba sum, target {cpu.target_name()}"

    def generate(self, prompt, n_decode):
        """Prefill is not modelled (nan); each decode step reads the weights and the
        cache's first len(prompt) + i positions."""
        t0 = time.perf_counter()
        for i in range(n_decode):
            self.read_sum(self.weights)
            self.read_sum(self.kv[:len(prompt) + i].reshape(-1))
        return [0] * (n_decode + 1), float("nan"), time.perf_counter() - t0


def prompt_ids(vocab: int, length: int, seed: int) -> list[int]:
    """Random token ids; a new prompt per run, so no engine can reuse a cached prefix."""
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab - 300, size=length).tolist()


def worker(spec: dict) -> None:
    """Runs in its own process: one engine, one format, every thread count."""
    result = {"cells": {}}
    vocab = spec["vocab"]
    n0 = spec["threads"][0]
    try:
        if spec.get("check_ids") and spec["engine"] == "llama.cpp":
            # llama.cpp keeps every position's logits only in a context made for that:
            # check first, then free it, so the two never count twice in the peak RSS
            checker = make_runner(spec, n0, check=True)
            result["check_file"] = save_check_logits(checker, spec)
            del checker
        t0 = time.perf_counter()
        runner = make_runner(spec, n0)
        result["load_s"] = time.perf_counter() - t0
        try:
            result["isa"] = runner.isa()
        except Exception as e:                  # a report line, never a failed cell
            result["isa"] = f"unknown ({type(e).__name__}: {e})"
        if spec.get("check_ids") and spec["engine"] != "llama.cpp":
            result["check_file"] = save_check_logits(runner, spec)
    except Exception as e:                      # a missing package or engine is one cell, not the run
        emit_result({"error": f"{type(e).__name__}: {e}"})
        return

    # the read bandwidth just before and just after each decode run: this VM's moves
    # within seconds, and the run's roofline is what the memory could do meanwhile
    probe = BandwidthProbe()
    ttft_lens = spec.get("ttft_lens", [])
    decode_prompt = spec.get("decode_prompt") or spec["prompt_lens"][0]
    for n in spec["threads"]:
        if n != spec["threads"][0]:
            runner = set_threads(runner, spec, n)
        # warm-up, not counted: every size that is measured below, once (JIT, allocations, the
        # weights' pages, gemm.py's packed copies, llama.cpp's compute buffers for a full batch)
        for p in [*spec["prompt_lens"], *ttft_lens]:
            runner.generate(prompt_ids(vocab, p, seed=1 + p), 0)
        runner.generate(prompt_ids(vocab, decode_prompt, seed=2), spec["decode_tokens"])
        cell = {"prefill": {str(p): [] for p in spec["prompt_lens"]}, "decode": [], "decode_bw": [],
                "ttft": {str(p): [] for p in ttft_lens}}
        t_cell = time.perf_counter()
        for r in range(spec["runs"]):
            # a fresh random prompt each time, so no engine can reuse a cached prefix
            for p in spec["prompt_lens"]:
                _, t_prefill, _ = runner.generate(prompt_ids(vocab, p, seed=1000 * n + 10 * r + p), 0)
                cell["prefill"][str(p)].append(p / t_prefill)
            for p in ttft_lens:                # time to the first token of a chat-sized prompt, seconds
                _, t_first, _ = runner.generate(prompt_ids(vocab, p, seed=1000 * n + 10 * r + p + 3), 0)
                cell["ttft"][str(p)].append(t_first)
            before = probe.read(n)
            _, _, t_decode = runner.generate(prompt_ids(vocab, decode_prompt, seed=1000 * n + 10 * r + 5),
                                             spec["decode_tokens"])
            after = probe.read(n)
            cell["decode"].append(spec["decode_tokens"] / t_decode)
            cell["decode_bw"].append(max(before, after))    # the better one, as for the run's figure
            # at least min_runs runs for the median, more while the cell is cheap
            if r + 1 >= spec["min_runs"] and time.perf_counter() - t_cell > spec["cell_seconds"]:
                break
        cell["runs"] = r + 1
        result["cells"][str(n)] = cell
        print(f"{spec['engine']} {spec['fmt']} threads={n}: decode {median(cell['decode']):.1f} tok/s "
              f"({cell['runs']} runs)", flush=True)
    probe.close()
    if spec["engine"] == "stage1":
        result["weight_bytes"] = stage1_weight_bytes(runner)
    emit_result(result)


def save_check_logits(runner, spec: dict) -> str:
    """Logits [T, V] of the check prompt, saved for the parent to compare."""
    np.save(spec["check_out"], runner.all_logits(spec["check_ids"]))
    return spec["check_out"]


def make_runner(spec: dict, threads: int, check: bool = False):
    if spec["engine"] == "stage1":
        return Stage1Runner(spec["path"], spec["fmt"], threads, spec["max_ctx"], spec.get("kernels", "auto"),
                            spec.get("activations", "auto"))
    if spec["engine"] == "llama.cpp":
        return LlamaCppRunner(spec["path"], threads, spec["max_ctx"], logits_all=check,
                              mmap=spec.get("llama_mmap", "on") == "on")
    if spec["engine"] == "read only":
        return ReadOnlyRunner(spec["weight_bytes"], spec["kv_bytes_per_position"], threads, spec["max_ctx"])
    return TransformersRunner(spec["path"], spec["fmt"], threads)


def set_threads(runner, spec: dict, n: int):
    """Change the thread count in place where the engine allows it, else rebuild it."""
    if hasattr(runner, "set_threads"):
        runner.set_threads(n)
        return runner
    del runner
    return make_runner(spec, n)


def stage1_weight_bytes(runner) -> int | None:
    """Weight bytes one stage-1 decode step reads, as the engine counts them; None if
    it cannot say (the parent then uses the nominal size of the format)."""
    try:
        return runner.weight_bytes()
    except Exception:
        return None


def nominal_stage1_bytes(shape: Shape, fmt: str, group_size: int = 32) -> int:
    """Bytes per token of stage 1's formats if the engine does not report them
    (stage1_cpu/quant.py): bf16 2 bytes a weight; int8 one byte plus an fp16 scale
    per group; int4 half a byte plus an fp16 scale and minimum per group, with the
    lm_head kept in int8."""
    int8 = 1 + 2 / group_size
    lm_head = shape.vocab_size * shape.hidden_size
    layers = shape.linear_params() - lm_head
    if fmt == "int4":
        return int(layers * (0.5 + 4 / group_size) + lm_head * int8)
    return int(shape.linear_params() * {"bf16": 2.0, "fp32": 4.0, "int8": int8}[fmt])


# ------------------------------------------------------------------ the report

@dataclass
class Row:
    engine: str
    fmt: str
    weight_bytes: int | None
    result: dict
    wall_s: float = float("nan")     # what this engine's worker cost, start to finish


def table_plans(args) -> list[dict]:
    """Which runs each table makes: one table per wait policy. The first measures
    everything asked for (every thread count, transformers fp32 and the logits check);
    the second, in a full run, only the largest thread count and transformers bf16,
    so that two policies cost ~1.5x one, not 2x (a full run stays under ~40 min)."""
    plans = []
    for i, policy in enumerate(POLICIES[args.omp_wait_policy]):
        first = i == 0
        threads = args.threads if first or args.quick else [max(args.threads)]
        hf = (["fp32"] if first else []) + (["bf16"] if "bf16" in args.formats else [])
        plans.append({"policy": policy, "threads": threads, "check": first, "transformers": hf})
    return plans


def profile_env(args, engine: str) -> dict:
    """The variables that make a worker an "AVX2 machine" under --cpu-profile avx2."""
    if args.cpu_profile != "avx2":
        return {}
    if engine in ("stage1", "read only"):
        return {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": HASWELL_FEATURES}
    if engine == "llama.cpp":
        return {"LLAMA_CPP_LIB_PATH": str(args.llama_lib)} if args.llama_lib else {}
    if engine == "transformers":
        return {"ATEN_CPU_CAPABILITY": "avx2"}
    return {}


def add_cpu_profile_args(p: argparse.ArgumentParser) -> None:
    """--cpu-profile and --llama-avx2-lib, which profile_env and choose_llama_lib read (bench cpu,
    bench prefill-pair)."""
    p.add_argument("--cpu-profile", default="native", choices=["native", "avx2"],
                   help="avx2: stand in for an AVX2-only CPU on an AVX-512 host (stage 1 under "
                        "NUMBA_CPU_NAME=haswell, llama.cpp from bench/build_llama_avx2.sh's build)")
    p.add_argument("--llama-avx2-lib", type=Path, default=None,
                   help=f"--cpu-profile avx2: the folder of the AVX2 build's libllama.so (default {AVX2_LLAMA_LIB})")


def resolve_cpu_profile(args) -> None:
    """After parsing (bench cpu, bench moe): args.llama_lib, args.llama_missing and args.llama_line from
    --cpu-profile (choose_llama_lib's answer under avx2; no library, nothing missing, no line natively)."""
    args.llama_lib, args.llama_missing, args.llama_line = None, None, ""
    if args.cpu_profile == "avx2":
        args.llama_lib, args.llama_missing, args.llama_line = choose_llama_lib(args)


def cpu_profile_lines(args) -> list[str]:
    """The report's line saying what --cpu-profile avx2 ran (none under native)."""
    if args.cpu_profile != "avx2":
        return []
    return ["- --cpu-profile avx2: stage 1 compiled for NUMBA_CPU_NAME=haswell with Haswell's features "
            "(no AVX-512); transformers with ATEN_CPU_CAPABILITY=avx2; " + args.llama_line]


def choose_llama_lib(args) -> tuple[Path | None, str | None, str]:
    """--cpu-profile avx2: (LLAMA_CPP_LIB_PATH or None for the installed build, why llama.cpp
    cannot run as an AVX2 build (or None), a line for the report)."""
    lib = args.llama_avx2_lib or AVX2_LLAMA_LIB
    if (lib / "libllama.so").exists() or (lib / "libllama.dylib").exists():
        return lib, None, f"llama.cpp: the AVX2 build in {lib} (LLAMA_CPP_LIB_PATH)"
    if args.llama_avx2_lib is None and "avx512f" not in cpu_flags()[1]:
        return None, None, ("llama.cpp: the installed build (this host has no AVX-512, so its native build "
                            "already is an AVX2 build)")
    why = f"no AVX2 build of llama.cpp in {lib}: run bench/build_llama_avx2.sh"
    return None, why, "llama.cpp: " + why


def run_all(args, shape: Shape, paths: dict, log, plan: dict) -> tuple[list[Row], dict]:
    """One table: every engine and format of the plan, under its wait policy."""
    threads = plan["threads"]
    base = dict(vocab=shape.vocab_size, max_ctx=1024, threads=threads, prompt_lens=args.prompt_lens,
                decode_tokens=args.decode_tokens, runs=args.runs, min_runs=args.runs,
                cell_seconds=args.cell_seconds, kernels=args.kernels, activations=args.activations,
                ttft_lens=args.ttft_lens,
                decode_prompt=args.decode_prompt, llama_mmap=args.llama_mmap)
    tmp = Path(tempfile.mkdtemp(prefix="bench-cpu-"))
    check_ids = prompt_ids(shape.vocab_size, CHECK_TOKENS, seed=7)
    check = lambda out: {"check_ids": check_ids, "check_out": str(tmp / out)} if plan["check"] else {}
    jobs: list[tuple[str, str, str, int | None, dict]] = []
    if "transformers" in args.engines:
        for fmt in plan["transformers"]:
            extra = check("hf.npy") if fmt == "fp32" else {}
            nbytes = shape.linear_params() * (4 if fmt == "fp32" else 2)
            jobs.append(("transformers", fmt, str(paths["hf"]), nbytes, extra))
    for fmt in args.formats:
        if "stage1" in args.engines:
            extra = check(f"stage1-{fmt}.npy")
            jobs.append(("stage1", fmt, str(paths["hf"]), nominal_stage1_bytes(shape, fmt), extra))
        if "llama.cpp" in args.engines:
            q = LLAMA_FORMAT[fmt]
            extra = check(f"llama.cpp-{q}.npy")
            jobs.append(("llama.cpp", q, str(paths[q]), gguf_weight_bytes(paths[q]), extra))
        if "stage1" in args.engines:          # the ceiling for stage 1's bytes (ReadOnlyRunner)
            nbytes = nominal_stage1_bytes(shape, fmt)
            kv = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * 4
            jobs.append(("read only", fmt, "", nbytes, {"weight_bytes": nbytes, "kv_bytes_per_position": kv}))

    rows = []
    for engine, fmt, path, nbytes, extra in jobs:
        if engine == "llama.cpp" and not llama_cpp_installed():
            rows.append(Row(engine, fmt, nbytes, {"error": "not installed"}))
            continue
        if engine == "llama.cpp" and args.llama_missing:
            rows.append(Row(engine, fmt, nbytes, {"error": args.llama_missing}))
            continue
        log(f"running {engine} {fmt} (OMP_WAIT_POLICY={plan['policy']}) ...")
        t0 = time.perf_counter()
        res = run_worker("bench.cpu", dict(base, engine=engine, fmt=fmt, path=path, **extra),
                         timeout=args.worker_timeout, log=log, omp_wait_policy=plan["policy"],
                         env_extra=profile_env(args, engine))
        wall = time.perf_counter() - t0
        if "error" in res:
            log(f"  {engine} {fmt}: {res['error']}")
        else:
            log(f"  done in {wall:.0f} s, peak RSS {res['peak_rss_mib']:.0f} MiB")
        rows.append(Row(engine, fmt, res.get("weight_bytes") or nbytes, res, wall))
    # every engine's logits for the same CHECK_TOKENS tokens against transformers fp32's
    check = {}
    if (tmp / "hf.npy").exists():
        ref = np.load(tmp / "hf.npy")
        for row in rows:
            f = row.result.get("check_file")
            if f and row.engine != "transformers" and Path(f).exists():
                check[(row.engine, row.fmt)] = logits_agreement(ref, np.load(f))
    shutil.rmtree(tmp, ignore_errors=True)
    return rows, check


def logits_agreement(ref: np.ndarray, got: np.ndarray) -> dict:
    """How close an engine's logits [T, V] are to transformers fp32's on the same weights."""
    err = np.abs(ref - got).max() / np.abs(ref).max()
    cos = float(np.mean(np.sum(ref * got, -1) / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(got, axis=-1))))
    top1 = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
    return {"max_rel_err": float(err), "cosine": cos, "top1": top1, "tokens": len(ref)}


def llama_cpp_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None


def report(args, shape: Shape, tables: list[dict], bw: dict, loads: tuple[float, float, float]) -> str:
    """The whole result as markdown: machine and instructions, the headline (each engine at
    its best policy), then per policy one table and its ratios; correctness; napkin maths."""
    out = [f"## CPU benchmark: {shape.name} ({'quick' if args.quick else 'full'}"
           + (", AVX2 machine stand-in" if args.cpu_profile == "avx2" else "") + ")", "",
           f"- machine: {machine_description()}",
           "- command: `" + " ".join(["python -m bench cpu", *args.argv]) + "`",
           f"- 1-minute load before {loads[0]:.2f}, after {loads[1]:.2f} (with the benchmark's own threads); "
           f"other processes used {loads[2]:.2f} cores on average during the run"
           + ("  **busy: numbers may be low**" if loads[2] > 0.25 else ""),
           f"- model: {shape.num_hidden_layers} layers, C={shape.hidden_size}, H/Hkv={shape.num_attention_heads}/"
           f"{shape.num_key_value_heads}, D={shape.head_dim}, F={shape.intermediate_size}, V={shape.vocab_size}, tied "
           f"embeddings; {shape.linear_params() / 1e6:.0f} M weights read per token",
           f"- memory bandwidth of the run (numba prange read of {bw['start']['mib']} MiB, best of 5, the better of start / end): "
           + ", ".join(f"{n} thread{'s' * (n > 1)} {bw['read'][n]:.1f} GB/s "
                       f"({bw['start']['read'][n]:.1f} / {bw['end']['read'][n]:.1f})" for n in args.threads)
           + f"; numpy copy (1 thread, read+write) {bw['copy']:.1f} GB/s",
           "- tables (one per OMP_WAIT_POLICY, every engine in its own subprocess; `default` = the variable "
           "unset, the OpenMP runtime's choice: libgomp spins a while before it sleeps): "
           + "; ".join(f"{t['plan']['policy']}: threads {','.join(map(str, t['plan']['threads']))}, "
                       f"cost {t['wall_s'] / 60:.1f} min, other processes {t['others']:.2f} cores"
                       + (" **busy**" if t["others"] > 0.25 else "") for t in tables)]
    out += cpu_profile_lines(args)
    out.append("- llama.cpp files: the same weights, every matrix in BF16 / Q8_0 / Q4_0, except that the Q4_0 "
               "file keeps the tied token_embd (the lm_head) in Q8_0, as stage 1's int4 keeps it in int8")
    out.append(f"- every engine first runs each measured size once, uncounted (every prefill length, every "
               f"time-to-first-token prompt, a full decode); then medians of {args.runs} warm "
               f"run{'s' * (args.runs > 1)}; prefill = prompt tokens ÷ time to the first token; decode = "
               f"{args.decode_tokens} greedy tokens (EOS ignored) after a {args.decode_prompt}-token prompt ÷ their time; "
               f"llama.cpp with use_mmap {args.llama_mmap}, n_batch = n_ubatch = 512"
               + ("; --quick: the model fits in the L3 cache, so % roofline can pass 100 %" if args.quick else ""))
    out += ["", "### instruction sets each engine used", ""]
    seen = set()
    for t in tables[:1]:
        for row in t["rows"]:
            isa = row.result.get("isa")
            if isa and (row.engine, isa) not in seen:
                seen.add((row.engine, isa))
                out.append(f"- {row.engine} {row.fmt}: {isa}")
    out += [""] + prefill_headline(args, tables) + headline(args, tables)
    for t in tables:
        plan = t["plan"]
        out += [f"### OMP_WAIT_POLICY={plan['policy']} (this table: {t['wall_s'] / 60:.1f} min, other processes "
                f"{t['others']:.2f} cores{'  **busy**' if t['others'] > 0.25 else ''})", ""]
        out += engine_table(args, t["rows"], plan["threads"])
        out += ratio_table(args, t["rows"], plan["threads"])
        if plan["check"]:
            out += correctness(t["check"])
    out += ["roofline = read bandwidth ÷ weight bytes one decode token reads (stage 1: `bench/weight_bytes.py`), "
            "with the bandwidth *of that decode run*: the same read, 256 MiB, best of 3, from a process of its own, "
            "just before and just after each run (the better of the two); `GB/s` is their median and `% roofline` "
            "the median over the runs of decode ÷ the run's roofline (this VM's bandwidth moves within seconds: "
            "see docs/benchmarks.md). `read only`: the ceiling — a numba sum over the format's weight bytes plus "
            "stage 1's fp32 KV cache up to the position, per token, nothing computed.", ""]
    out += napkin(shape, tables[0]["rows"], bw, args.threads)
    return "\n".join(out)


def best_by_policy(args, tables: list[dict]) -> dict:
    """(engine, format, threads, metric) -> (best median, the policy that gave it), over every table."""
    best = {}
    for t in tables:
        for row in t["rows"]:
            for n, cell in row.result.get("cells", {}).items():
                values = {"decode": median(cell["decode"])}
                values.update({p: median(cell["prefill"][str(p)]) for p in args.prompt_lens})
                # time to first token: seconds, so the best is the smallest (kept as 1 / s to compare alike)
                values.update({f"ttft{p}": 1 / median(v) for p, v in cell.get("ttft", {}).items() if v})
                for metric, v in values.items():
                    key = (row.engine, row.fmt, int(n), metric)
                    if v == v and (key not in best or v > best[key][0]):
                        best[key] = (v, t["plan"]["policy"])
    return best


# issue 28's targets (stage 1 ÷ llama.cpp, 2 threads, each engine at its best policy)
PREFILL_TARGETS = {"int8": {32: 1.0, 128: 1.6, 512: 1.5, "decode": 1.0},
                   "int4": {32: 1.0, 128: 1.3, 512: 1.3, "decode": 1.0}}


def prefill_headline(args, tables: list[dict]) -> list[str]:
    """Per format at the largest thread count: every prefill length, decode and the time to first
    token, stage 1 against llama.cpp, each at its best policy, with the prefill targets."""
    best = best_by_policy(args, tables)
    n = max(n for t in tables for n in t["plan"]["threads"])
    metrics = [*args.prompt_lens, "decode", *(f"ttft{p}" for p in args.ttft_lens)]
    rows = []
    for fmt in args.formats:
        q = LLAMA_FORMAT[fmt]
        for m in metrics:
            s, l = best.get(("stage1", fmt, n, m)), best.get(("llama.cpp", q, n, m))
            ttft = isinstance(m, str) and m.startswith("ttft")
            show = (lambda v: f"{1e3 / v:.0f} ms") if ttft else (lambda v: f"{v:.1f} tok/s")
            what = f"time to first token, {m[4:]}-token prompt" if ttft else (
                "decode" if m == "decode" else f"prefill {m}")
            ratio = s[0] / l[0] if s and l else float("nan")
            target = PREFILL_TARGETS.get(fmt, {}).get(m)
            verdict = "" if target is None or ratio != ratio else \
                f"{'met' if ratio >= target else 'NOT met'} (≥{target:.1f}×)"
            rows.append([fmt, q, what, f"{show(s[0])} ({s[1]})" if s else "–",
                         f"{show(l[0])} ({l[1]})" if l else "–",
                         f"{ratio:.2f}×" if ratio == ratio else "–", verdict])
    return [f"### prefill, decode and time to first token at {n} threads: stage 1 ÷ llama.cpp "
            f"(--kernels {args.kernels}{_acts(args)}), each engine at its own best wait policy", "",
            "(speed ratio: for the time to first token llama.cpp's time ÷ stage 1's; the policy in brackets; "
            f"medians of {args.runs} warm runs after a warm-up of every size)", "",
            markdown_table(["stage 1", "llama.cpp", "what", "stage 1", "llama.cpp", "ratio", "target"], rows), ""]


def _acts(args) -> str:
    """The --activations asked of stage 1, where it is not the default, for a table's heading."""
    return "" if args.activations == "auto" else f", --activations {args.activations}"


def headline(args, tables: list[dict]) -> list[str]:
    """stage 1 ÷ llama.cpp per format, decode and the longest prefill, each engine at its own
    best policy (a ratio under one policy alone flatters whichever engine suffers less from it)."""
    best = best_by_policy(args, tables)
    p = max(args.prompt_lens)
    rows = []
    threads = sorted({n for t in tables for n in t["plan"]["threads"]})
    for n in threads:
        for fmt in args.formats:
            q = LLAMA_FORMAT[fmt]
            cells = []
            ratios = {}
            for metric in ("decode", p):
                s, l = best.get(("stage1", fmt, n, metric)), best.get(("llama.cpp", q, n, metric))
                ratios[metric] = s[0] / l[0] if s and l else float("nan")
                cells += [f"{s[0]:.1f} ({s[1]})" if s else "–", f"{l[0]:.1f} ({l[1]})" if l else "–",
                          f"{ratios[metric]:.2f}×" if ratios[metric] == ratios[metric] else "–"]
            verdict = ""
            if not args.quick and n == 2 and fmt in TARGETS and ratios["decode"] == ratios["decode"]:
                t_dec, t_pre, _ = TARGETS[fmt]
                verdict = f"decode {'met' if ratios['decode'] >= t_dec else 'NOT met'} (≥{t_dec:.1f}×)"
                if ratios[p] == ratios[p]:
                    verdict += f"; prefill {p} {'met' if ratios[p] >= t_pre else 'NOT met'} (≥{t_pre:.1f}×)"
            rows.append([fmt, q, n, *cells, verdict])
    header = ["stage 1", "llama.cpp", "threads", "stage 1 decode tok/s", "llama.cpp decode tok/s", "decode ratio",
              f"stage 1 prefill {p}", f"llama.cpp prefill {p}", f"prefill {p} ratio", "targets (2 threads)"]
    return [f"### headline: stage 1 ÷ llama.cpp, each engine at its own best wait policy (--kernels {args.kernels}"
            f"{_acts(args)})",
            "", "(the policy that gave each figure in brackets; the bf16 decode target applies where AVX-512 BF16 "
            "exists, the int8 / int4 ones everywhere)", "", markdown_table(header, rows), ""]


def engine_table(args, rows: list[Row], threads: list[int]) -> list[str]:
    header = ["engine", "format", "threads", "MB/token", *(f"prefill {p} tok/s" for p in args.prompt_lens),
              "decode tok/s", "GB/s", "roofline tok/s", "% roofline", "runs", "load s", "peak RSS MiB", "wall s"]
    table = []
    for n in threads:
        for row in rows:
            cell = row.result.get("cells", {}).get(str(n))
            if cell is None:
                table.append([row.engine, row.fmt, n, fmt_num(row.weight_bytes / 1e6 if row.weight_bytes else None, 0),
                              row.result.get("error", "failed")[:60]] + [""] * (len(header) - 5))
                continue
            gbs, frac = decode_roofline(cell, row.weight_bytes)
            table.append([row.engine, row.fmt, n, fmt_num(row.weight_bytes / 1e6, 0),
                          *(fmt_num(median(cell["prefill"][str(p)])) for p in args.prompt_lens),
                          fmt_num(median(cell["decode"])), fmt_num(gbs),
                          fmt_num(gbs * 1e9 / row.weight_bytes if row.weight_bytes else None),
                          fmt_num(100 * frac, 0) + "%" * (frac == frac), cell["runs"],
                          fmt_num(row.result.get("load_s")), fmt_num(row.result.get("peak_rss_mib"), 0),
                          fmt_num(row.wall_s, 0)])
    return [markdown_table(header, table), ""]


def ratio_table(args, rows: list[Row], threads: list[int]) -> list[str]:
    """stage 1 ÷ llama.cpp under this table's policy, and how close each got to its roofline."""
    by = {(r.engine, r.fmt): r for r in rows}
    ratio_rows = []
    for n in threads:
        for fmt in args.formats:
            s, l = by.get(("stage1", fmt)), by.get(("llama.cpp", LLAMA_FORMAT[fmt]))
            sc = s.result.get("cells", {}).get(str(n)) if s else None
            lc = l.result.get("cells", {}).get(str(n)) if l else None
            if not sc or not lc:
                why = (l.result.get("error") if l and l.result.get("error") else "not measured")[:60]
                ratio_rows.append([fmt, LLAMA_FORMAT[fmt], n, why] + [""] * (len(args.prompt_lens) + 2))
                continue
            r = [median(sc["prefill"][str(p)]) / median(lc["prefill"][str(p)]) for p in args.prompt_lens]
            rd = median(sc["decode"]) / median(lc["decode"])
            roof = decode_roofline(sc, s.weight_bytes)[1]
            ro = by.get(("read only", fmt))
            rc = ro.result.get("cells", {}).get(str(n)) if ro else None
            ceiling = decode_roofline(rc, ro.weight_bytes)[1] if rc else float("nan")
            ratio_rows.append([fmt, LLAMA_FORMAT[fmt], n, *(f"{x:.2f}×" for x in r), f"{rd:.2f}×",
                               fmt_num(100 * roof, 0) + "%" * (roof == roof),
                               fmt_num(100 * ceiling, 0) + "%" * (ceiling == ceiling)])
    rh = ["stage 1", "llama.cpp", "threads", *(f"prefill {p}" for p in args.prompt_lens), "decode",
          "stage 1 % roofline", "read only % roofline"]
    return ["stage 1 ÷ llama.cpp under this policy:", "", markdown_table(rh, [r[:len(rh)] for r in ratio_rows]), ""]


def correctness(check: dict) -> list[str]:
    out = [f"#### correctness: logits of {CHECK_TOKENS} tokens against transformers fp32 (same weights)", "",
           f"(stage 1 computes the first {CHECK_TOKENS // 2} in one forward, as prefill does, and the other "
           f"{CHECK_TOKENS // 2} one at a time, as decode does: both ways of rounding the activations are in it)", ""]
    if not check:
        return out + ["not checked (transformers fp32 did not run)", ""]
    return out + [markdown_table(["engine", "format", "max abs error / max abs logit", "cosine", "same argmax"],
                                 [[e, f, f"{c['max_rel_err']:.4f}", f"{c['cosine']:.6f}", f"{c['top1']:.0%}"]
                                  for (e, f), c in check.items()]), ""]


def decode_roofline(cell: dict, nbytes: int | None) -> tuple[float, float]:
    """(median read GB/s next to the decode runs, median over the runs of decode
    tok/s ÷ that run's roofline tok/s); nan where not measured."""
    bws = cell.get("decode_bw") or []
    if not bws or not nbytes:
        return float("nan"), float("nan")
    return median(bws), median([d * nbytes / (b * 1e9) for d, b in zip(cell["decode"], bws)])


def napkin(shape: Shape, rows: list[Row], bw: dict, threads: list[int]) -> list[str]:
    """Bytes per token per format and the decode speed memory alone allows."""
    n = max(threads)
    lines = ["### napkin maths", "",
             f"decode reads every weight once per token: {shape.linear_params() / 1e6:.0f} M weights "
             f"(lm_head {shape.vocab_size * shape.hidden_size / 1e6:.0f} M of them). "
             f"At {bw['read'][n]:.1f} GB/s ({n} threads):", ""]
    seen = set()
    for r in rows:
        if r.weight_bytes and (r.engine, r.fmt) not in seen and r.engine != "read only":
            seen.add((r.engine, r.fmt))
            bpw = r.weight_bytes / shape.linear_params()
            lines.append(f"- {r.engine} {r.fmt}: {bpw:.4f} bytes/weight → {r.weight_bytes / 1e6:.0f} MB/token "
                         f"→ at most {bw['read'][n] * 1e9 / r.weight_bytes:.1f} tok/s")
    return lines + [""]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a small model (4 layers, C=512, V=32000), one thread count, 2 runs: for CI")
    p.add_argument("--moe", action="store_true",
                   help="the MoE benchmark instead (the same as python -m bench moe; its options, "
                        "see python -m bench moe --help)")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default 1,2; quick: 2)")
    p.add_argument("--formats", default="bf16,int8,int4", help="stage-1 formats: bf16,int8,int4")
    p.add_argument("--engines", default="stage1,llama.cpp,transformers", help="which engines to run")
    p.add_argument("--runs", type=int, default=None,
                   help="warm runs per measurement, after a warm-up of every size; the median is reported (default 3; quick: 2)")
    p.add_argument("--cell-seconds", type=float, default=None,
                   help="stop adding runs after the first --runs once one engine/thread count took this long "
                        "(bench cpu makes exactly --runs runs, so this only matters to bench moe; default 60; quick 15)")
    p.add_argument("--decode-tokens", type=int, default=128, help="greedy tokens generated for the decode figure")
    p.add_argument("--prompt-lens", default="32,128,512", help="prompt lengths for prefill tok/s")
    p.add_argument("--decode-prompt", type=int, default=128, help="the prompt length decode follows")
    p.add_argument("--ttft-lens", default="37,300",
                   help="prompt lengths whose time to first token is reported (chat-sized prompts; '' for none)")
    p.add_argument("--llama-mmap", default="on", choices=["on", "off"],
                   help="llama.cpp's use_mmap (on: its fastest load here, decode the same; docs/benchmarks.md)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    p.add_argument("--save", type=Path, default=None,
                   help="also write the decode results as JSON (docs/figures/stage1_roofline.json: "
                        "python -m bench figures draws the roofline from it)")
    p.add_argument("--cache-dir", type=Path, default=CACHE, help="where the models are built and kept")
    p.add_argument("--worker-timeout", type=float, default=1800, help="seconds one engine may take in all")
    p.add_argument("--omp-wait-policy", default=None, choices=list(POLICIES),
                   help="OMP_WAIT_POLICY for every engine: both (a table under PASSIVE, then one under the "
                        "runtime's default, where idle threads spin a while; the headline takes each engine at "
                        "its best), PASSIVE, ACTIVE or default. Default: both; --quick: PASSIVE")
    p.add_argument("--kernels", default="auto", choices=["auto", "plain", "fast"],
                   help="stage 1's kernels: plain (the portable core) or fast (stage1_cpu/fast/); default auto")
    p.add_argument("--activations", default="auto", choices=["auto", "int8", "fp32"],
                   help="stage 1's --activations (default auto; int8: llama.cpp's rounding, prefill on int8 too)")
    add_cpu_profile_args(p)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    cpus = os.cpu_count() or 1
    args.threads = [int(t) for t in (args.threads or (str(min(2, cpus)) if args.quick else "1,2")).split(",")]
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    args.ttft_lens = [int(x) for x in args.ttft_lens.split(",") if x.strip()]
    args.runs = args.runs or (2 if args.quick else 3)
    args.omp_wait_policy = args.omp_wait_policy or ("PASSIVE" if args.quick else "both")
    resolve_cpu_profile(args)
    args.cell_seconds = args.cell_seconds or (15 if args.quick else 60)
    bad = [f for f in args.formats if f not in LLAMA_FORMAT]
    if bad:
        p.error(f"unknown format {bad[0]!r}; choose from {', '.join(LLAMA_FORMAT)}")
    bad = [e for e in args.engines if e not in ("stage1", "llama.cpp", "transformers")]
    if bad:
        p.error(f"unknown engine {bad[0]!r}; choose from stage1, llama.cpp, transformers")
    if any(t < 1 for t in args.threads) or args.runs < 1 or args.decode_tokens < 1:
        p.error("--threads, --runs and --decode-tokens must be positive")
    if max([*args.prompt_lens, *args.ttft_lens, args.decode_prompt]) + args.decode_tokens + 1 > 1024:
        p.error("prompt length + decode tokens must stay under the 1024-token context the engines are given")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--moe" in argv and "--worker" not in argv:            # python -m bench cpu --moe: bench/moe.py
        from bench import moe
        return moe.main([a for a in argv if a != "--moe"])
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    log = lambda s: print(s, flush=True)
    shape = QUICK if args.quick else QWEN3_0_6B
    t_start = time.perf_counter()
    load_before = load_1min()
    log(check_load("before"))
    meter = NeighbourMeter()
    paths = prepare_models(shape, args.cache_dir, log, [LLAMA_FORMAT[f] for f in args.formats]
                           if "llama.cpp" in args.engines else [])
    log("measuring memory bandwidth ...")
    bw = measure_bandwidth(args.threads, mib=256 if args.quick else 1024)
    log("  " + ", ".join(f"{n} threads: {bw['read'][n]:.1f} GB/s" for n in args.threads))
    if not llama_cpp_installed():
        log("llama-cpp-python is not installed (pip install 'qwen3-stages[bench]'): its columns are skipped")
    if args.cpu_profile == "avx2":
        log("--cpu-profile avx2: stage 1 under NUMBA_CPU_NAME=haswell; " + args.llama_line)
    tables = []
    for plan in table_plans(args):
        log(f"--- table: OMP_WAIT_POLICY={plan['policy']}, threads {plan['threads']}")
        t0, table_meter = time.perf_counter(), NeighbourMeter()
        rows, check = run_all(args, shape, paths, log, plan)
        tables.append({"plan": plan, "rows": rows, "check": check, "wall_s": time.perf_counter() - t0,
                       "others": table_meter.cores_used_by_others()})
        log(f"--- that table took {tables[-1]['wall_s'] / 60:.1f} min")
    load_after = load_1min()
    others = meter.cores_used_by_others()
    log(check_load("after") + " (this counts the benchmark's own threads)")
    log(f"other processes used {others:.2f} cores on average during the run"
        + ("  WARNING: speeds may be low (rerun when idle)" if others > 0.25 else ""))
    # measured again at the end: a neighbour busy at the start lowers one of the two, and
    # the roofline is what the memory *can* do, so it uses the better of the two
    end = measure_bandwidth(args.threads, mib=256 if args.quick else 1024)
    log("bandwidth at the end: " + ", ".join(f"{n} threads: {end['read'][n]:.1f} GB/s" for n in args.threads))
    bw = {"read": {n: max(bw["read"][n], end["read"][n]) for n in args.threads},
          "copy": max(bw["copy"], end["copy"]), "start": bw, "end": end}
    text = report(args, shape, tables, bw, (load_before, load_after, others))
    text += f"\n(total {time.perf_counter() - t_start:.0f} s)\n"
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
        log(f"report written to {args.out}")
    if args.save:
        save_roofline(args, tables, bw)
        log(f"results written to {args.save}")
    return 0


def save_roofline(args, tables, bw) -> None:
    """--save: per table, every engine's decode tok/s and MB/token, and the read bandwidth
    (the schema bench/figures.py reads)."""
    out = []
    for tab in tables:
        for n in tab["plan"]["threads"]:
            for row in tab["rows"]:
                cell = row.result.get("cells", {}).get(str(n))
                if cell is None or not row.weight_bytes:
                    continue
                out.append(dict(policy=tab["plan"]["policy"], threads=n, engine=row.engine, format=row.fmt,
                                mb_per_token=row.weight_bytes / 1e6, decode_tok_s=float(median(cell["decode"]))))
    args.save.parent.mkdir(parents=True, exist_ok=True)
    args.save.write_text(json.dumps(dict(
        command="python -m bench cpu " + " ".join(sys.argv[1:]), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=machine_description(), bandwidth_gb_s=max(bw["read"].values()),
        rows=out), indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
