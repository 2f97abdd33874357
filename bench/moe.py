"""MoE CPU benchmark: stage 1 against llama.cpp (qwen3moe) and transformers on a Qwen3-MoE shape.

    python -m bench moe                     # the Qwen3-30B-A3B layer shape, 12 layers x 32 experts (bf16 4.7 GB)
    python -m bench moe --quick             # a tiny MoE (4 layers, 16 experts, top-4), a couple of minutes
    python -m bench moe --kernels plain --formats int8 --out /tmp/moe.md
    python -m bench moe --cpu-profile avx2 --activations int8   # as on an AVX2-only CPU (bench cpu's options)

The model keeps what makes Qwen3-30B-A3B's decode cost what it is, per layer:
its attention (32 query / 4 KV heads x 128, hidden 2048) and its experts
(gate / up / down of 2048 x 768, top-8 with norm_topk_prob); it has fewer
experts (32, not 128) and layers (12, not 48) so that the bf16 file fits a 24 GiB,
2-core machine. A decode token reads the attention, the router, the 8 chosen
experts of each layer and the lm_head; the 24 experts it skips per layer are
on disk and in RAM but cost no bandwidth. So the roofline of MoE decode is
bandwidth / (bytes actually read per token), weight_bytes.stage1_bytes(decode=True) for stage 1.

What one run does (the same steps as bench/cpu.py, whose engines and worker it
reuses, so each engine runs in its own process exactly as in the dense benchmark):
  1. builds the random-weight Qwen3MoeForCausalLM in bf16 with transformers, and
     writes the *same* weights as qwen3moe GGUF files (BF16, Q8_0, Q4_0) with the
     experts stacked as llama.cpp stores them (ffn_gate_exps / ffn_up_exps /
     ffn_down_exps [E, out, in], the router ffn_gate_inp in F32);
  2. runs every engine under both OpenMP wait policies (PASSIVE, and the runtime's
     default that spins a while): stage 1 with its fast path (--kernels auto) and
     with the portable core (--kernels plain), llama.cpp, transformers bf16;
     prefill of 128 and 512 tokens, decode of 128 greedy tokens;
  3. prints the headline (stage 1 / llama.cpp, each engine at its best policy),
     one table per policy, the logits of every engine against transformers fp32,
     and the napkin maths: bytes per token, and what grouping prefill tokens per
     expert saves (an expert read once per step instead of once per token).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import (NeighbourMeter, check_load, emit_result, fmt_num, load_1min, machine_description,
                          markdown_table, measure_bandwidth, median, run_worker)
from bench.cpu import (CACHE, CHECK_TOKENS, LLAMA_FORMAT, Row, Shape, _byte_level_alphabet, add_cpu_profile_args,
                       cpu_profile_lines, decode_roofline, gguf_name, llama_cpp_installed, logits_agreement,
                       profile_env, prompt_ids, resolve_cpu_profile)

BUILD_VERSION = 1      # bump when the HF model changes, so old caches are rebuilt
GGUF_VERSION = 1       # bump when the GGUF writing changes
POLICIES = {"both": ["PASSIVE", "default"], "PASSIVE": ["PASSIVE"], "ACTIVE": ["ACTIVE"], "default": ["default"]}
# the issue's targets at 2 threads, each engine at its best policy: decode / llama.cpp,
# prefill 512 / llama.cpp, decode as a fraction of the roofline of the bytes it reads
TARGETS = {"bf16": (1.0, 0.8, 0.80), "int8": (1.0, 0.8, 0.80), "int4": (1.0, 0.8, 0.65)}


# ------------------------------------------------------------------ the model

@dataclass
class MoeShape(Shape):
    """Shape plus Qwen3-MoE's config.json keys. Every layer is an MoE layer
    (decoder_sparse_step 1, no mlp_only_layers), so intermediate_size (the dense F)
    is only written to the config, as Qwen3-30B-A3B's is."""
    num_experts: int = 32                # E routed experts per layer
    num_experts_per_tok: int = 8         # k chosen per token (norm_topk_prob: their weights sum to 1)
    moe_intermediate_size: int = 768     # Fe, one expert's MLP width

    def attention_params(self) -> int:
        """q, k, v and o of one layer."""
        C, H, Hkv, D = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        return C * H * D + 2 * C * Hkv * D + H * D * C

    def expert_params(self) -> int:
        """gate, up [Fe, C] and down [C, Fe] of one expert."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def router_params(self) -> int:
        return self.num_experts * self.hidden_size          # [E, C]

    def linear_params(self) -> int:
        """Weights of the matmuls one token goes through (Shape's meaning): attention,
        router and the k chosen experts of every layer, and the tied lm_head."""
        per_layer = self.attention_params() + self.router_params() + self.num_experts_per_tok * self.expert_params()
        return self.num_hidden_layers * per_layer + self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        """Every weight in the file (all E experts; the embedding once: it is tied)."""
        per_layer = self.attention_params() + self.router_params() + self.num_experts * self.expert_params()
        return self.num_hidden_layers * per_layer + self.vocab_size * self.hidden_size


# 12 layers put the lm_head clearly under a third of the bf16 decode bytes (311 M of 991 M
# weights read per token, 31 %; 11 layers would sit on the line at 33.3 %), 2.35 G weights in
# all: bf16 4.7 GB, under the ~6 GB a 24 GiB, 2-core machine can build and run.
MOE = MoeShape("qwen3-moe-a3b-layers", 12, 2048, 32, 4, 128, 6144, 151936, [151645, 151643],
               num_experts=32, num_experts_per_tok=8, moe_intermediate_size=768)
MOE_QUICK = MoeShape("qwen3-moe-quick", 4, 512, 8, 2, 64, 1024, 32000, [31999],
                     num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256)


def build_moe_model(shape: MoeShape, folder: Path) -> None:
    """A random-weight Qwen3MoeForCausalLM in bf16, saved by transformers itself
    (bench.cpu.build_hf_model's approach, with Qwen3-MoE's config). The model is
    built in bf16 from the start, so the full shape never exists in fp32 (9.4 GB)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, moe_intermediate_size=shape.moe_intermediate_size,
        num_experts=shape.num_experts, num_experts_per_tok=shape.num_experts_per_tok, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=None, eos_token_id=shape.eos_token_id)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = tf.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(saved)
    model.save_pretrained(folder)
    gen = {"eos_token_id": shape.eos_token_id, "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(gen))


def moe_gguf_names(shape: MoeShape, layer: int) -> dict[str, tuple[str, list[str]]]:
    """The MoE part of one layer: GGUF name -> (how it is made, HF names).
    ("stack", E names): llama.cpp keeps a layer's experts as one tensor per projection,
    [E, Fe, C] for gate / up and [E, C, Fe] for down (ggml lists the dims the other way
    round: {C, Fe, E}), expert e's matrix at index e; ("router", [name]): [E, C] in F32,
    as llama.cpp's converter keeps it."""
    pre = f"model.layers.{layer}.mlp"
    experts = lambda proj: [f"{pre}.experts.{e}.{proj}_proj.weight" for e in range(shape.num_experts)]  # noqa: E731
    return {f"blk.{layer}.ffn_gate_inp.weight": ("router", [f"{pre}.gate.weight"]),
            f"blk.{layer}.ffn_gate_exps.weight": ("stack", experts("gate")),
            f"blk.{layer}.ffn_up_exps.weight": ("stack", experts("up")),
            f"blk.{layer}.ffn_down_exps.weight": ("stack", experts("down"))}


def write_moe_gguf(hf_folder: Path, shape: MoeShape, qtype_name: str, path: Path) -> None:
    """The HF folder's weights as a llama.cpp GGUF file, architecture qwen3moe.

    bench.cpu.write_gguf's approach (its name table for attention and norms, its
    token_embd at Q8_0 in Q4_0 files); what it cannot reuse is its architecture
    ("qwen3"), its per-tensor loop (experts are stacked here) and its tokenizer block,
    which is copied below (a function of its own there would have been the minimum).
    Tensors are spooled to a temporary file as they are made (use_temp_file), so the
    full shape needs about one layer in memory, not the whole model.
    """
    import gguf
    import torch
    from safetensors import safe_open

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    ftype = {"BF16": gguf.LlamaFileType.MOSTLY_BF16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype_name]
    cfg = json.loads((hf_folder / "config.json").read_text())
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "qwen3moe", use_temp_file=True)
    w.add_name(shape.name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(shape.hidden_size)
    w.add_block_count(shape.num_hidden_layers)
    w.add_feed_forward_length(shape.intermediate_size)
    w.add_expert_feed_forward_length(shape.moe_intermediate_size)   # n_ff_exp
    w.add_expert_count(shape.num_experts)
    w.add_expert_used_count(shape.num_experts_per_tok)            # llama.cpp's qwen3moe always renormalises the top k
    w.add_head_count(shape.num_attention_heads)
    w.add_head_count_kv(shape.num_key_value_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta"))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(shape.vocab_size)
    w.add_file_type(ftype)

    # tokenizer (copied from bench.cpu.write_gguf): 256 byte tokens, one merge, fillers, the EOS ids
    tokens = _byte_level_alphabet() + ["Ġt"]
    tokens += [f"tok{i}" for i in range(len(tokens), shape.vocab_size)]
    types = [gguf.TokenType.NORMAL] * shape.vocab_size
    for eos in shape.eos_token_id:
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
    handles = [safe_open(f, framework="pt") for f in files]
    where = {n: h for h in handles for n in h.keys()}             # HF name -> its file
    if "lm_head.weight" in where:
        raise ValueError("the MoE benchmark model ties its embeddings; this folder has an lm_head")
    get = lambda n: where[n].get_tensor(n).to(torch.float32).numpy()   # noqa: E731  [out, in] as HF stores it

    def add_matrix(name: str, data: np.ndarray, keep_f32: bool = False) -> None:
        t = qtype
        if keep_f32:
            w.add_tensor(name, data.astype(np.float32))
            return
        if qtype_name == "Q4_0" and name == "token_embd.weight":   # the tied lm_head: Q8_0, as in bench.cpu
            t = gguf.GGMLQuantizationType.Q8_0
        w.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)   # quantized along the last axis

    moe_names = set()
    for i in range(shape.num_hidden_layers):
        for gname, (kind, hf_names) in moe_gguf_names(shape, i).items():
            moe_names.update(hf_names)
            if kind == "router":
                add_matrix(gname, get(hf_names[0]), keep_f32=True)
            else:
                add_matrix(gname, np.stack([get(n) for n in hf_names]))   # [E, out, in]
    for name in sorted(set(where) - moe_names):                    # attention, norms, the embedding
        data = get(name)
        if data.ndim == 1:
            w.add_tensor(gguf_name(name), data)                   # norms: F32
        else:
            add_matrix(gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)


def gguf_decode_bytes(path: Path, shape: MoeShape) -> int:
    """Bytes of weights one llama.cpp decode token reads from a GGUF file, counted as
    stage 1's weight_bytes.stage1_bytes(decode=True) counts its own: every matrix (the tied token_embd
    once, as the lm_head), each stacked expert tensor for k of its E experts; the 1-D
    norms (KBs) left out."""
    import gguf
    total = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        if len(t.shape) < 2:
            continue
        share = shape.num_experts_per_tok / shape.num_experts if "_exps." in t.name else 1.0
        total += round(int(t.n_bytes) * share)
    return total


def check_gguf_layout(path: Path, hf_folder: Path, shape: MoeShape) -> str:
    """A report line: the BF16 file's expert 1 of layer 0 (gate and down) and its router,
    read back, equal the HF tensors; catches a transposed or misordered stack
    without llama.cpp."""
    import gguf
    import torch
    from safetensors import safe_open

    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    where = {n: f for f in sorted(hf_folder.glob("*.safetensors")) for n in safe_open(f, framework="pt").keys()}
    e = min(1, shape.num_experts - 1)
    pairs = [("blk.0.ffn_gate_exps.weight", f"model.layers.0.mlp.experts.{e}.gate_proj.weight", e),
             ("blk.0.ffn_down_exps.weight", f"model.layers.0.mlp.experts.{e}.down_proj.weight", e),
             ("blk.0.ffn_gate_inp.weight", "model.layers.0.mlp.gate.weight", None)]
    worst = 0.0
    for gname, hname, idx in pairs:
        t = tensors[gname]
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        got = got[idx] if idx is not None else got
        with safe_open(where[hname], framework="pt") as st:
            ref = st.get_tensor(hname).to(torch.float32).numpy()
        if got.shape != ref.shape:
            return f"GGUF layout check FAILED: {gname} is {got.shape}, HF {hname} is {ref.shape}"
        worst = max(worst, float(np.abs(got - ref).max()))
    ok = worst == 0.0
    return (f"GGUF layout check ({path.name}): layer 0's expert {e} (gate, down) and router read back "
            + ("bit-exact" if ok else f"with max error {worst:.3g}: FAILED"))


def prepare_models(shape: MoeShape, cache: Path, log=print) -> dict:
    """-> {"hf": folder, "BF16": path, "Q8_0": path, "Q4_0": path}, built once and cached."""
    root = cache / f"{shape.name}-v{BUILD_VERSION}"
    hf = root / "hf"
    paths = {"hf": hf, **{q: root / f"{shape.name}-{q}-g{GGUF_VERSION}.gguf" for q in ("BF16", "Q8_0", "Q4_0")}}
    if not (hf / "DONE").exists():
        t0 = time.perf_counter()
        log(f"building the random-weight {shape.name} model in {hf} ...")
        hf.mkdir(parents=True, exist_ok=True)
        build_moe_model(shape, hf)
        (hf / "DONE").write_text("ok")
        log(f"  done in {time.perf_counter() - t0:.0f} s")
    for q in ("BF16", "Q8_0", "Q4_0"):
        if not paths[q].exists():
            t0 = time.perf_counter()
            log(f"writing {paths[q].name} ...")
            write_moe_gguf(hf, shape, q, paths[q])
            log(f"  done in {time.perf_counter() - t0:.0f} s")
    return paths


# ------------------------------------------------------------------ bytes per token

def stage1_decode_bytes(shape: MoeShape, fmt: str, group_size: int = 32) -> int:
    """What weight_bytes.stage1_bytes(decode=True) reports for stage 1's formats (stage1_cpu/quant.py), before
    any engine has run: matrices at the format's bytes per weight (int8: a byte and an fp16
    scale per group; int4: half a byte and an fp16 scale and minimum per group; the lm_head
    in int8 when the rest is int4), the routers in fp32, k of E experts per layer."""
    per_weight = {"bf16": 2.0, "int8": 1 + 2 / group_size, "int4": 0.5 + 4 / group_size}[fmt]
    head = per_weight if fmt != "int4" else 1 + 2 / group_size
    L = shape.num_hidden_layers
    layers = L * (shape.attention_params() + shape.num_experts_per_tok * shape.expert_params())
    return int(layers * per_weight + L * shape.router_params() * 4 + shape.vocab_size * shape.hidden_size * head)


def napkin(shape: MoeShape, bw: float, threads: int, prompt_len: int) -> list[str]:
    """Bytes per decode token by part, against a dense model of the same size; and
    what grouping tokens per expert saves in prefill."""
    L, C, V = shape.num_hidden_layers, shape.hidden_size, shape.vocab_size
    E, k = shape.num_experts, shape.num_experts_per_tok
    attn, expert, head = L * shape.attention_params(), shape.expert_params(), V * C
    routed, every = L * k * expert, L * E * expert
    bf16 = 2 * shape.linear_params()
    lines = ["### napkin maths", "",
             f"Weights one decode token reads (bf16 bytes): attention {2 * attn / 1e6:,.0f} MB, the k={k} chosen "
             f"experts in each of the {L} layers {2 * routed / 1e6:,.0f} MB, routers {2 * L * shape.router_params() / 1e6:,.1f} MB, "
             f"lm_head {2 * head / 1e6:,.0f} MB ({head / shape.linear_params():.0%} of the "
             f"{bf16 / 1e6:,.0f} MB). The file holds {2 * shape.total_params() / 1e9:.2f} GB: the {E - k} experts a "
             f"token skips per layer ({2 * (every - routed) / 1e9:.2f} GB) cost memory, not bandwidth. A dense model "
             f"reading every expert would read {2 * (shape.total_params()) / 1e6:,.0f} MB per token, "
             f"{shape.total_params() / shape.linear_params():.1f}x more.",
             f"At {bw:.1f} GB/s ({threads} threads) bf16 decode can reach at most {bw * 1e9 / bf16:.1f} tok/s; "
             f"each format's roofline is in the tables (bandwidth of the run / its MB/token).", ""]
    # prefill: per token, each token reads its k experts; grouped per expert, each expert used
    # by any of the P tokens is read once. With routing spread over the experts, the expected
    # number of distinct experts a layer uses is E * (1 - (1 - k/E)^P).
    per_token = prompt_len * k
    distinct = E * (1 - (1 - k / E) ** prompt_len)
    lines += [f"Prefill of {prompt_len} tokens, per layer: one token at a time reads {per_token:,} experts' weights "
              f"({per_token * 2 * expert / 1e9:.2f} GB in bf16); grouped per expert, each expert that any token "
              f"chose is read once: at most {E}, about {distinct:.1f} with routing spread over them "
              f"({distinct * 2 * expert / 1e6:.0f} MB), {per_token / distinct:.0f}x fewer bytes (all {L} layers: "
              f"{L * per_token * 2 * expert / 1e9:.1f} GB against {L * distinct * 2 * expert / 1e9:.2f} GB). Each expert's "
              f"matmul then has about {per_token / distinct:.0f} rows (P·k/E tokens), which is what turns the "
              f"experts from a bandwidth-bound matvec into a compute-bound matmul.", ""]
    return lines


# ------------------------------------------------------------------ the runs

@dataclass
class Job:
    label: str          # the row's engine name in the report ("stage1", "stage1 plain", ...)
    fmt: str
    nbytes: int | None  # decode bytes per token, before the engine reports its own
    spec: dict          # what bench.cpu's worker needs (engine, fmt, path, kernels, ...)


def worker(spec: dict) -> None:
    """One engine in its own process: bench.cpu's worker, with two MoE additions:
    - stage 1 reports weight_bytes.stage1_bytes(decode=True) (the bytes a token reads), not all the bytes (every
      expert); bench/cpu.py's Stage1Runner does the same from the bench branch on;
    - check_only: only the logits of the check prompt (transformers fp32, the oracle: its
      timings would cost minutes at the full shape and no headline needs them)."""
    from bench import cpu
    if spec.get("check_only"):
        try:
            runner = cpu.make_runner(spec, spec["threads"][0])
            emit_result({"check_file": cpu.save_check_logits(runner, spec)})
        except Exception as e:
            emit_result({"error": f"{type(e).__name__}: {e}"})
        return
    if spec["engine"] == "stage1":
        from bench.weight_bytes import stage1_bytes
        cpu.stage1_weight_bytes = lambda runner: stage1_bytes(runner.engine.weights, decode=True)
    cpu.worker(spec)


def jobs_for(args, shape: MoeShape, paths: dict, plan: dict, tmp: Path) -> list[Job]:
    check_ids = prompt_ids(shape.vocab_size, CHECK_TOKENS, seed=7)
    check = lambda out: {"check_ids": check_ids, "check_out": str(tmp / out)} if plan["check"] else {}  # noqa: E731
    jobs = []
    if "transformers" in args.engines:
        if plan["check"]:
            jobs.append(Job("transformers", "fp32", None, dict(engine="transformers", fmt="fp32", path=str(paths["hf"]),
                                                              check_only=True, **check("hf.npy"))))
        if "bf16" in args.formats:
            jobs.append(Job("transformers", "bf16", 2 * shape.linear_params(),
                            dict(engine="transformers", fmt="bf16", path=str(paths["hf"]))))
    for fmt in args.formats:
        nominal = stage1_decode_bytes(shape, fmt)
        if "stage1" in args.engines:
            for kernels in args.kernels:
                label = "stage1" if kernels == "auto" else f"stage1 {kernels}"
                jobs.append(Job(label, fmt, nominal, dict(engine="stage1", fmt=fmt, path=str(paths["hf"]),
                                                          kernels=kernels, **check(f"{label}-{fmt}.npy"))))
        if "llama.cpp" in args.engines:
            q = LLAMA_FORMAT[fmt]
            jobs.append(Job("llama.cpp", q, gguf_decode_bytes(paths[q], shape),
                            dict(engine="llama.cpp", fmt=q, path=str(paths[q]), **check(f"llama.cpp-{q}.npy"))))
        if "stage1" in args.engines and args.read_only:   # the ceiling for stage 1's bytes (bench.cpu.ReadOnlyRunner)
            kv = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * 4
            jobs.append(Job("read only", fmt, nominal, dict(engine="read only", fmt=fmt, path="",
                                                            weight_bytes=nominal, kv_bytes_per_position=kv)))
    return jobs


def run_table(args, shape: MoeShape, paths: dict, log, plan: dict) -> tuple[list[Row], dict]:
    """One table: every job of the plan under its wait policy, one worker each."""
    base = dict(vocab=shape.vocab_size, max_ctx=1024, threads=plan["threads"], prompt_lens=args.prompt_lens,
                decode_tokens=args.decode_tokens, runs=args.runs, min_runs=min(2, args.runs),
                cell_seconds=args.cell_seconds, activations=args.activations)
    tmp = Path(tempfile.mkdtemp(prefix="bench-moe-"))
    rows = []
    for job in jobs_for(args, shape, paths, plan, tmp):
        if job.label == "llama.cpp" and not llama_cpp_installed():
            rows.append(Row(job.label, job.fmt, job.nbytes, {"error": "not installed"}))
            continue
        if job.label == "llama.cpp" and args.llama_missing:      # --cpu-profile avx2 without its build
            rows.append(Row(job.label, job.fmt, job.nbytes, {"error": args.llama_missing}))
            continue
        log(f"running {job.label} {job.fmt} (OMP_WAIT_POLICY={plan['policy']}) ...")
        t0 = time.perf_counter()
        res = run_worker("bench.moe", dict(base, **job.spec), timeout=args.worker_timeout, log=log,
                         omp_wait_policy=plan["policy"], env_extra=profile_env(args, job.spec["engine"]))
        if "error" in res:
            log(f"  {job.label} {job.fmt}: {res['error']}")
        else:
            log(f"  done in {time.perf_counter() - t0:.0f} s, peak RSS {res['peak_rss_mib']:.0f} MiB")
        if not job.spec.get("check_only"):
            rows.append(Row(job.label, job.fmt, res.get("weight_bytes") or job.nbytes, res))
        elif "error" in res:
            rows.append(Row(job.label, job.fmt, None, res))
        else:
            plan["check_file"] = res["check_file"]
    check = {}
    if plan.get("check_file") and Path(plan["check_file"]).exists():
        ref = np.load(plan["check_file"])
        for row in rows:
            f = row.result.get("check_file")
            if f and Path(f).exists():
                check[(row.engine, row.fmt)] = logits_agreement(ref, np.load(f))
    shutil.rmtree(tmp, ignore_errors=True)
    return rows, check


# ------------------------------------------------------------------ the report

def best_by_policy(args, tables: list[dict]) -> dict:
    """(engine, format, threads, metric) -> (best median, its policy, its row, its cell)."""
    best = {}
    for t in tables:
        for row in t["rows"]:
            for n, cell in row.result.get("cells", {}).items():
                values = {"decode": median(cell["decode"])}
                values.update({p: median(cell["prefill"][str(p)]) for p in args.prompt_lens})
                for metric, v in values.items():
                    key = (row.engine, row.fmt, int(n), metric)
                    if v == v and (key not in best or v > best[key][0]):
                        best[key] = (v, t["plan"]["policy"], row, cell)
    return best


def headline(args, tables: list[dict]) -> list[str]:
    """stage 1 (each kernel set) / llama.cpp per format, and stage 1's % of roofline,
    each engine at its own best policy."""
    best = best_by_policy(args, tables)
    p = max(args.prompt_lens)
    threads = sorted({n for t in tables for n in t["plan"]["threads"]})
    labels = ["stage1" if k == "auto" else f"stage1 {k}" for k in args.kernels]
    rows = []
    for n in threads:
        for fmt in args.formats:
            q = LLAMA_FORMAT[fmt]
            for label in labels:
                s_dec, l_dec = best.get((label, fmt, n, "decode")), best.get(("llama.cpp", q, n, "decode"))
                s_pre, l_pre = best.get((label, fmt, n, p)), best.get(("llama.cpp", q, n, p))
                ratio = lambda a, b: a[0] / b[0] if a and b else float("nan")  # noqa: E731
                r_dec, r_pre = ratio(s_dec, l_dec), ratio(s_pre, l_pre)
                roof = decode_roofline(s_dec[3], s_dec[2].weight_bytes)[1] if s_dec else float("nan")
                cell = lambda b: f"{b[0]:.1f} ({b[1]})" if b else "–"  # noqa: E731
                x = lambda r: f"{r:.2f}×" if r == r else "–"  # noqa: E731
                verdict = []
                if not args.quick and n == 2 and fmt in TARGETS:
                    t_dec, t_pre, t_roof = TARGETS[fmt]
                    if r_dec == r_dec:
                        verdict.append(f"decode {'met' if r_dec >= t_dec else 'NOT met'} (≥{t_dec:.1f}×)")
                    if r_pre == r_pre:
                        verdict.append(f"prefill {p} {'met' if r_pre >= t_pre else 'NOT met'} (≥{t_pre:.1f}×)")
                    if roof == roof:
                        verdict.append(f"roofline {'met' if roof >= t_roof else 'NOT met'} (≥{t_roof:.0%})")
                elif args.quick:
                    verdict.append("(targets apply to the full run)")
                if not l_dec:
                    l_row = next((r for t in tables for r in t["rows"] if r.engine == "llama.cpp" and r.fmt == q), None)
                    why = (l_row.result.get("error", "not measured") if l_row else "not run")[:40]
                    verdict.insert(0, f"llama.cpp: {why}")
                rows.append([label, fmt, q, n, cell(s_dec), cell(l_dec), x(r_dec),
                             fmt_num(100 * roof, 0) + "%" * (roof == roof),
                             cell(s_pre), cell(l_pre), x(r_pre), "; ".join(verdict)])
    header = ["stage 1", "format", "llama.cpp", "threads", "stage 1 decode tok/s", "llama.cpp decode tok/s",
              "decode ratio", "stage 1 % roofline", f"stage 1 prefill {p}", f"llama.cpp prefill {p}",
              f"prefill {p} ratio", "targets (2 threads)"]
    return ["### headline: stage 1 ÷ llama.cpp on MoE, each engine at its own best wait policy", "",
            "(tok/s, the policy that gave each figure in brackets; `stage1` = --kernels auto, the fast path where "
            "this CPU has it; `stage1 plain` = --kernels plain, the portable core)", "",
            markdown_table(header, rows), ""]


def engine_table(args, rows: list[Row], threads: list[int]) -> list[str]:
    header = ["engine", "format", "threads", "MB/token", *(f"prefill {p} tok/s" for p in args.prompt_lens),
              "decode tok/s", "GB/s", "roofline tok/s", "% roofline", "runs", "load s", "peak RSS MiB"]
    table = []
    for n in threads:
        for row in rows:
            mb = fmt_num(row.weight_bytes / 1e6 if row.weight_bytes else None, 0)
            cell = row.result.get("cells", {}).get(str(n))
            if cell is None:
                table.append([row.engine, row.fmt, n, mb, row.result.get("error", "failed")[:60]]
                             + [""] * (len(header) - 5))
                continue
            gbs, frac = decode_roofline(cell, row.weight_bytes)
            table.append([row.engine, row.fmt, n, mb, *(fmt_num(median(cell["prefill"][str(p)]))
                                                        for p in args.prompt_lens),
                          fmt_num(median(cell["decode"])), fmt_num(gbs),
                          fmt_num(gbs * 1e9 / row.weight_bytes if row.weight_bytes else None),
                          fmt_num(100 * frac, 0) + "%" * (frac == frac), cell["runs"],
                          fmt_num(row.result.get("load_s")), fmt_num(row.result.get("peak_rss_mib"), 0)])
    return [markdown_table(header, table), ""]


def report(args, shape: MoeShape, paths: dict, tables: list[dict], bw: dict, loads: tuple, layout: str) -> str:
    n = max(args.threads)
    out = [f"## MoE CPU benchmark: {shape.name} ({'quick' if args.quick else 'full'})", "",
           f"- machine: {machine_description()}",
           "- command: `" + " ".join(["python -m bench moe", *args.argv]) + "`",
           f"- 1-minute load before {loads[0]:.2f}, after {loads[1]:.2f} (with the benchmark's own threads); "
           f"other processes used {loads[2]:.2f} cores on average during the run"
           + ("  **busy: numbers may be low**" if loads[2] > 0.25 else ""),
           f"- model: Qwen3-MoE, {shape.num_hidden_layers} layers, C={shape.hidden_size}, "
           f"H/Hkv={shape.num_attention_heads}/{shape.num_key_value_heads}, D={shape.head_dim}, "
           f"E={shape.num_experts} experts of Fe={shape.moe_intermediate_size}, top-{shape.num_experts_per_tok} "
           f"with norm_topk_prob, every layer MoE, V={shape.vocab_size}, tied embeddings; "
           f"{shape.total_params() / 1e6:,.0f} M weights ({2 * shape.total_params() / 1e9:.2f} GB in bf16), "
           f"{shape.linear_params() / 1e6:,.0f} M read per decode token (lm_head "
           f"{shape.vocab_size * shape.hidden_size / shape.linear_params():.0%} of them)",
           f"- memory bandwidth (numba prange read, best of 5, the better of start / end): {n} threads "
           f"{bw['read'][n]:.1f} GB/s ({bw['start']['read'][n]:.1f} / {bw['end']['read'][n]:.1f})",
           f"- OpenMP wait policies: {', '.join(t['plan']['policy'] for t in tables)} (one table each); "
           f"stage 1 kernels: {', '.join(args.kernels)}, --activations {args.activations}",
           *cpu_profile_lines(args),
           "- llama.cpp files: the same weights as qwen3moe GGUF, every matrix in BF16 / Q8_0 / Q4_0 (the Q4_0 "
           "file keeps the tied token_embd in Q8_0, as stage 1's int4 keeps its lm_head in int8), routers in F32; "
           + (layout if layout else "layout not checked"),
           "- llama.cpp: " + ("llama-cpp-python installed" if llama_cpp_installed()
                              else "**not installed** (pip install 'qwen3-stages[bench]'): its cells are empty"),
           f"- medians of up to {args.runs} run{'s' * (args.runs > 1)}; prefill = prompt tokens ÷ time to the first "
           f"token; decode = {args.decode_tokens} greedy tokens (EOS ignored) ÷ their time; MB/token = weight "
           "bytes one decode token reads (attention, routers, the k chosen experts, lm_head: stage 1's "
           "weight_bytes.stage1_bytes(decode=True), the GGUF tensors with the stacked experts counted for k of E); roofline = the "
           "read bandwidth measured just before and after each decode run ÷ MB/token"
           + ("; --quick: the model fits in the L3 cache, so % roofline can pass 100 %" if args.quick else ""),
           ""]
    isa = {}
    for t in tables:
        for r in t["rows"]:
            if r.result.get("isa"):
                isa.setdefault(r.engine, r.result["isa"])
    if isa:
        out += [f"- {e}: {i}" for e, i in isa.items()] + [""]
    out += headline(args, tables)
    for t in tables:
        plan = t["plan"]
        out += [f"### OMP_WAIT_POLICY={plan['policy']}", ""] + engine_table(args, t["rows"], plan["threads"])
    check = next((t["check"] for t in tables if t["plan"]["check"]), {})
    out += [f"### correctness: logits of {CHECK_TOKENS} tokens against transformers fp32 (same weights)", "",
            f"(stage 1 computes the first {CHECK_TOKENS // 2} in one forward, the prefill path with experts "
            f"grouped, the other {CHECK_TOKENS // 2} one at a time, the decode path with the k experts in one "
            "region per projection)", ""]
    if check:
        out += [markdown_table(["engine", "format", "max abs error / max abs logit", "cosine", "same argmax"],
                               [[e, f, f"{c['max_rel_err']:.4f}", f"{c['cosine']:.6f}", f"{c['top1']:.0%}"]
                                for (e, f), c in check.items()]), ""]
    else:
        out += ["not checked (transformers fp32 did not run)", ""]
    out += napkin(shape, bw["read"][n], n, max(args.prompt_lens))
    return "\n".join(out)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a tiny MoE (4 layers, C=512, 16 experts, top-4), 1 run, 32 decode tokens: a couple of minutes")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default 2, or the cores if fewer)")
    p.add_argument("--formats", default="bf16,int8,int4", help="stage-1 formats: bf16,int8,int4")
    p.add_argument("--engines", default="stage1,llama.cpp,transformers", help="which engines to run")
    p.add_argument("--kernels", default="auto,plain",
                   help="stage 1's kernel sets, each a row: auto (the fast path where it runs), plain, fast")
    p.add_argument("--omp-wait-policy", default="both", choices=list(POLICIES),
                   help="both (a table under PASSIVE, one under the runtime's default; the headline takes each "
                        "engine at its best), PASSIVE, ACTIVE or default")
    p.add_argument("--runs", type=int, default=None, help="runs per measurement, the median is reported (default 3; quick 1)")
    p.add_argument("--cell-seconds", type=float, default=None,
                   help="stop adding runs (after 2) once one engine took this long (default 60; quick 10)")
    p.add_argument("--decode-tokens", type=int, default=None, help="greedy tokens for the decode figure (default 128; quick 32)")
    p.add_argument("--prompt-lens", default="128,512", help="prefill prompt lengths (decode follows the first)")
    p.add_argument("--read-only", default=None, choices=["yes", "no"],
                   help="the read-only ceiling rows (a numba sum over stage 1's bytes per token); default yes, quick no")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    p.add_argument("--cache-dir", type=Path, default=CACHE, help="where the models are built and kept")
    p.add_argument("--worker-timeout", type=float, default=2400, help="seconds one engine may take in all")
    p.add_argument("--activations", default="auto", choices=["auto", "int8", "fp32"],
                   help="stage 1's --activations (default auto; int8: llama.cpp's rounding, prefill on int8 too)")
    add_cpu_profile_args(p)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    args.threads = [int(t) for t in (args.threads or str(min(2, os.cpu_count() or 1))).split(",")]
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    args.runs = args.runs or (1 if args.quick else 3)
    args.cell_seconds = args.cell_seconds or (10 if args.quick else 60)
    args.decode_tokens = args.decode_tokens or (32 if args.quick else 128)
    args.read_only = (args.read_only or ("no" if args.quick else "yes")) == "yes"
    for name, given, allowed in (("format", args.formats, LLAMA_FORMAT), ("kernels", args.kernels, ("auto", "plain", "fast")),
                                 ("engine", args.engines, ("stage1", "llama.cpp", "transformers"))):
        bad = [g for g in given if g not in allowed]
        if bad:
            p.error(f"unknown {name} {bad[0]!r}; choose from {', '.join(allowed)}")
    if any(t < 1 for t in args.threads) or args.runs < 1 or args.decode_tokens < 1:
        p.error("--threads, --runs and --decode-tokens must be positive")
    if max(args.prompt_lens) + args.decode_tokens + 1 > 1024:
        p.error("prompt length + decode tokens must stay under the 1024-token context the engines are given")
    resolve_cpu_profile(args)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    log = lambda s: print(s, flush=True)  # noqa: E731
    shape = MOE_QUICK if args.quick else MOE
    t_start, load_before = time.perf_counter(), load_1min()
    log(check_load("before"))
    meter = NeighbourMeter()
    paths = prepare_models(shape, args.cache_dir, log)
    layout = check_gguf_layout(paths["BF16"], paths["hf"], shape)
    log(layout)
    mib = 256 if args.quick else 1024
    log("measuring memory bandwidth ...")
    bw = measure_bandwidth(args.threads, mib=mib)
    if "llama.cpp" in args.engines and not llama_cpp_installed():
        log("llama-cpp-python is not installed (pip install 'qwen3-stages[bench]'): llama.cpp is reported as not installed")
    tables = []
    for i, policy in enumerate(POLICIES[args.omp_wait_policy]):
        # the first table measures every thread count and checks the logits; the next only the largest
        plan = {"policy": policy, "threads": args.threads if i == 0 else [max(args.threads)], "check": i == 0}
        log(f"--- table: OMP_WAIT_POLICY={policy}, threads {plan['threads']}")
        rows, check = run_table(args, shape, paths, log, plan)
        tables.append({"plan": plan, "rows": rows, "check": check})
    load_after, others = load_1min(), meter.cores_used_by_others()
    log(check_load("after") + " (this counts the benchmark's own threads)")
    end = measure_bandwidth(args.threads, mib=mib)
    bw = {"read": {n: max(bw["read"][n], end["read"][n]) for n in args.threads}, "start": bw, "end": end}
    text = report(args, shape, paths, tables, bw, (load_before, load_after, others), layout)
    text += f"\n(total {time.perf_counter() - t_start:.0f} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n"
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
        log(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
