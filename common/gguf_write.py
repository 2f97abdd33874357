"""Write a Hugging Face model folder as a GGUF file, the way llama.cpp's convert_hf_to_gguf.py does.

For the tests (files of every supported architecture in F32, F16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, from tiny random models) and the CPU benchmark (BF16, Q8_0 and Q4_0 files of
its dense and MoE shapes, which stage 1 and llama.cpp both run). The `gguf` package
quantizes; it cannot write K-quants (llama.cpp's llama-quantize does).

What the converter does, and this file with it:
  * names: model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight;
  * llama only: the rows of q_proj / k_proj are permuted per head into llama.cpp's
    interleaved RoPE order (common/gguf.py undoes it);
  * MoE: the experts of a layer become one 3-D tensor [E, rows, C] (ffn_gate_exps, ...);
    Qwen2-MoE's shared-expert gate [1, C] is stored as [C];
  * 1-D tensors (norms, biases) and the router stay F32, every other matrix gets `qtype`
    (the token embedding / output `embed_qtype`, default the same).

Usage: python -m common.gguf_write HF_FOLDER OUT.gguf [--type Q8_0] [--embed-type Q8_0]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

ARCH = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3moe", "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2moe"}
NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# llama.cpp never quantizes the router
KEEP_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def _byte_level_alphabet() -> list[str]:
    """GPT-2's 256 printable stand-ins for the bytes 0..255 (byte-level BPE)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def permute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order (the inverse of gguf_convert.unpermute_rotary_rows)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(folder: Path):
    """Every tensor of the folder as float32 numpy (safetensors, any dtype)."""
    import torch
    from safetensors import safe_open
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name).to(torch.float32).numpy()


def _tokenizer_metadata(w, folder: Path, cfg: dict, pre: str) -> None:
    """The folder's tokenizer.json (vocab, merges, added tokens), or with none a minimal
    byte-level vocabulary of V tokens (the tests feed token ids)."""
    import gguf
    V = cfg["vocab_size"]
    tok_path = folder / "tokenizer.json"
    eos = cfg.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    if tok_path.is_file():
        tj = json.loads(tok_path.read_text(encoding="utf-8"))
        vocab = tj["model"]["vocab"]
        added = {a["id"]: a for a in tj.get("added_tokens", [])}
        n = max(V, max(vocab.values()) + 1, max(added, default=-1) + 1)
        tokens = [f"[PAD{i}]" for i in range(n)]
        types = [gguf.TokenType.UNUSED] * n
        for t, i in vocab.items():
            tokens[i], types[i] = t, gguf.TokenType.NORMAL
        for i, a in added.items():
            tokens[i] = a["content"]
            types[i] = gguf.TokenType.CONTROL if a.get("special") else gguf.TokenType.USER_DEFINED
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    else:
        tokens = _byte_level_alphabet() + ["Ġt"]
        tokens += [f"tok{i}" for i in range(len(tokens), V)]
        types = [gguf.TokenType.NORMAL] * V
        for e in eos:
            tokens[e], types[e] = f"<|end{e}|>", gguf.TokenType.CONTROL
        merges = ["Ġ t"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if eos:
        w.add_eos_token_id(eos[0])
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    w.add_add_bos_token(bool(tc.get("add_bos_token", False)))
    if isinstance(tc.get("chat_template"), str):
        w.add_chat_template(tc["chat_template"])
    elif (folder / "chat_template.jinja").is_file():
        w.add_chat_template((folder / "chat_template.jinja").read_text())


def write_gguf(folder: str | Path, path: str | Path, qtype: str = "F32",
               embed_qtype: str | None = None, pre: str | None = None,
               tokenizer: bool = True) -> Path:
    """The Hugging Face folder `folder` as a GGUF file at `path`; -> path. Each tensor is
    spooled to a temporary file as it is converted, and a layer's experts are stacked as soon
    as the last of them is read, so a large model needs about one layer in memory."""
    import gguf

    folder, path = Path(folder), Path(path)
    cfg = json.loads((folder / "config.json").read_text())
    arch = ARCH[cfg["architectures"][0]]
    w = gguf.GGUFWriter(str(path), arch, use_temp_file=True)
    _model_metadata(w, folder, cfg, arch)
    if tokenizer:
        _tokenizer_metadata(w, folder, cfg, pre or ("smollm" if arch == "llama" else "qwen2"))
    _add_tensors(w, folder, cfg, arch, qtype, embed_qtype or qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _heads(cfg: dict) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of a config.json."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return heads, cfg.get("num_key_value_heads") or heads, head_dim


def _model_metadata(w, folder: Path, cfg: dict, arch: str) -> None:
    """The model's shape and hyperparameters, under GGUF's keys for `arch`."""
    rope = cfg.get("rope_parameters") or {}
    heads, kv_heads, head_dim = _heads(cfg)
    w.add_name(folder.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_vocab_size(cfg["vocab_size"])
    if arch in ("qwen3moe", "qwen2moe"):
        w.add_expert_count(cfg.get("num_experts", cfg.get("num_local_experts")))
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _add(w, name: str, data: np.ndarray, kind: str) -> None:
    """One tensor into the writer, as GGUF type `kind` (F32, F16 or a quantized type)."""
    import gguf
    from gguf.quants import quantize
    t = gguf.GGMLQuantizationType[kind]
    if t == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, np.ascontiguousarray(data, np.float32))
    elif t == gguf.GGMLQuantizationType.F16:
        w.add_tensor(name, np.ascontiguousarray(data, np.float16))
    else:
        w.add_tensor(name, quantize(np.ascontiguousarray(data, np.float32), t), raw_dtype=t)


def _add_tensors(w, folder: Path, cfg: dict, arch: str, qtype: str, embed_qtype: str) -> None:
    """Every tensor of the folder under its GGUF name and type: the embedding and output
    embed_qtype, 1-D tensors and KEEP_F32 F32, the other matrices qtype; a layer's experts
    stacked into one [E, rows, C] tensor as soon as the last of them is read."""
    heads, kv_heads, _ = _heads(cfg)
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    experts: dict = {}
    for name, data in _tensors(folder):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            _add(w, "token_embd.weight" if "embed" in name else "output.weight", data, embed_qtype)
            continue
        if name == "model.norm.weight":
            _add(w, "output_norm.weight", data, "F32")
            continue
        _, _, layer, rest = name.split(".", 3)
        m = EXPERT.fullmatch(rest)
        if m:
            by_e = experts.setdefault((int(layer), m.group(2)), {})
            by_e[int(m.group(1))] = data
            if len(by_e) == n_experts:                # the layer's last expert: [E, rows, C]
                stacked = np.stack([by_e[e] for e in range(n_experts)])
                _add(w, f"blk.{layer}.ffn_{m.group(2)}_exps.weight", stacked, qtype)
                del experts[(int(layer), m.group(2))]
            continue
        gname = NAMES[rest]
        if arch == "llama" and gname in ("attn_q.weight", "attn_k.weight"):
            data = permute_rotary_rows(data, heads if gname == "attn_q.weight" else kv_heads)
        if gname == "ffn_gate_inp_shexp.weight":
            data = data.reshape(-1)
        kind = "F32" if data.ndim == 1 or gname in KEEP_F32 else qtype
        _add(w, f"blk.{layer}.{gname}", data, kind)
    if experts:
        raise ValueError(f"{folder}: experts missing from the weights: {sorted(experts)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write a Hugging Face folder as a GGUF file.")
    ap.add_argument("folder", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--type", default="Q8_0",
                    help="F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (default Q8_0)")
    ap.add_argument("--embed-type", default=None,
                    help="the token embedding / output's type (default: --type)")
    args = ap.parse_args(argv)
    print(write_gguf(args.folder, args.out, args.type, args.embed_type))
    return 0


if __name__ == "__main__":
    sys.exit(main())
