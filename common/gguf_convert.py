"""Convert a llama-architecture GGUF file into a Hugging Face model folder.

A GGUF file (llama.cpp's format) holds everything a model needs in one file:
hyper-parameters and the tokenizer as key/value metadata, and the weights as
(usually quantized) tensors. Every stage reads GGUF files directly (common/gguf.py,
which uses this file's rotary un-permutation and token constants); this converter
remains for a float32 Hugging Face folder that other tools can read. It unpacks a llama
GGUF into:

  config.json             LlamaForCausalLM hyper-parameters
  generation_config.json  the ids that end a turn
  model.safetensors       the weights, dequantized to float32, Hugging Face names
  tokenizer.json          the byte-level BPE tokenizer for the `tokenizers` library
  tokenizer_config.json   chat template and special tokens

Three things are not a plain copy:

1. Names: GGUF says `blk.3.attn_q.weight`, Hugging Face `model.layers.3.self_attn.q_proj.weight`.
2. Q and K rows: llama.cpp's converter reorders the rows of each head of
   q_proj / k_proj so that its RoPE can rotate *adjacent* pairs (x0,x1), (x2,x3), ...
   ("interleaved"), while Hugging Face's Llama rotates the two *halves* of a head,
   pairs (x0, x_{D/2}), (x1, x_{D/2+1}), ... ("rotate-half"). We undo that
   reordering (`unpermute_rotary_rows`), or the model attends to the wrong
   positions and babbles.
3. Values: Q4_1 / Q8_0 blocks are dequantized with `gguf.quants.dequantize`
   and stored as float32. float32 keeps every dequantized value exactly (a Q4_1
   value is d*q + m with fp16 d and m, which bfloat16 would round), so the folder
   computes the very same function as llama.cpp's file, and stage 1's INT8/INT4
   quantization starts from the true weights. The cost is size: 4 bytes a weight
   (about 540 MB for SmolLM2-135M).

Usage: python -m common.gguf_convert MODEL.gguf OUT_DIR
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

# GGUF tensor name -> Hugging Face tensor name, for the llama architecture.
# `{i}` is the layer index.
LLAMA_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = (
    1, 2, 3, 4, 5, 6)

# Control tokens that end a turn in common chat formats. llama.cpp treats these
# as end-of-generation by their text even when the file names only one eos id.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>",
                      "<EOT>")


class GGUFConvertError(ValueError):
    """A GGUF file this converter cannot turn into a Hugging Face folder; the message says why."""


# ----------------------------------------------------------------------------- metadata

def read_metadata(reader) -> dict:
    """All key/value fields of a GGUFReader as Python values (str, int, float, bool, lists)."""
    import gguf

    meta = {}
    for key, field in reader.fields.items():
        types = field.types
        if not types:
            continue

        def value(part_index: int, kind):
            part = field.parts[part_index]
            if kind == gguf.GGUFValueType.STRING:
                return bytes(part).decode("utf-8")
            v = part[0]
            return bool(v) if kind == gguf.GGUFValueType.BOOL else v.item()

        if types[0] == gguf.GGUFValueType.ARRAY:
            # field.data holds the index into field.parts of every element
            meta[key] = [value(i, types[-1]) for i in field.data]
        else:
            meta[key] = value(field.data[0], types[0])
    return meta


def _shortest_float(x: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); write the
    shortest decimal that is the same float32, as the original config.json had it."""
    return float(str(np.float32(x)))


def llama_config(meta: dict, vocab_size: int, tied: bool) -> dict:
    """config.json for LlamaForCausalLM from the GGUF's `llama.*` keys."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFConvertError(f"GGUF architecture {arch!r} is not supported; this converter "
                               "handles 'llama' (SmolLM2, Llama 2/3, TinyLlama). Download a "
                               "Hugging Face folder of the model instead.")

    def need(key: str):
        if f"llama.{key}" not in meta:
            raise GGUFConvertError(f"the GGUF file has no 'llama.{key}' key; it is incomplete or "
                                   "not a llama model")
        return meta[f"llama.{key}"]

    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise GGUFConvertError(f"RoPE scaling {scaling!r} is not supported; only plain RoPE "
                               "(SmolLM2, Llama 2)")

    hidden, heads = need("embedding_length"), need("attention.head_count")
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    head_dim = meta.get("llama.attention.key_length", hidden // heads)
    rotary_dim = meta.get("llama.rope.dimension_count", head_dim)
    if rotary_dim != head_dim:
        raise GGUFConvertError(f"partial rotary embedding (rope dimension {rotary_dim} < head dim "
                               f"{head_dim}) is not supported")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,                                  # V
        "hidden_size": hidden,                                     # C
        "intermediate_size": need("feed_forward_length"),          # F
        "num_hidden_layers": need("block_count"),                  # L
        "num_attention_heads": heads,                              # H
        "num_key_value_heads": kv_heads,                           # Hkv
        "head_dim": head_dim,                                      # D
        "hidden_act": "silu",
        "max_position_embeddings": need("context_length"),
        "rms_norm_eps": _shortest_float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest_float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "use_cache": True,
    }


def end_of_turn_ids(meta: dict) -> list[int]:
    """The file's eos id first, then the control tokens that end a turn by their text."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    ids = [meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else []
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind == TOKEN_CONTROL and tok in END_OF_TURN_TOKENS and i not in ids:
            ids.append(i)
    return ids


# ----------------------------------------------------------------------------- weights

def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: interleaved rotary pairs -> rotate-half.

    w: [n_heads*D, C] as stored in the GGUF. Within one head, llama.cpp put
    Hugging Face row r = j*D/2 + i (half j, pair i) at row 2*i + j, so that
    the two rows RoPE rotates together sit next to each other. Reading the
    head as [D/2, 2] (pair i, member j) and swapping the two axes gives back
    [2, D/2], the Hugging Face order.
    """
    rows, cols = w.shape
    half = rows // n_heads // 2                      # D/2
    w = w.reshape(n_heads, half, 2, cols)            # [heads, D/2 pairs, 2 members, C]
    return w.transpose(0, 2, 1, 3).reshape(rows, cols)   # [heads, 2 halves, D/2, C] -> [heads*D, C]


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> Hugging Face tensor name (llama architecture)."""
    layer = re.match(r"blk\.(\d+)\.", gguf_name)
    pattern = gguf_name.replace(f"blk.{layer.group(1)}.", "blk.{i}.", 1) if layer else gguf_name
    if pattern not in LLAMA_TENSOR_NAMES:
        raise GGUFConvertError(f"unexpected tensor {gguf_name!r} in a llama GGUF file (e.g. "
                               "rope_freqs for Llama 3.1 RoPE scaling, which is not supported)")
    return LLAMA_TENSOR_NAMES[pattern].format(i=layer.group(1) if layer else "")


# ----------------------------------------------------------------------------- tokenizer

def build_tokenizer(meta: dict):
    """A `tokenizers.Tokenizer` equal to the byte-level BPE the GGUF describes.

    The GGUF keeps the vocabulary and merges exactly as the original
    tokenizer.json spelled them (GPT-2's byte-to-unicode alphabet, 'Ġ' for a
    space), so they go into a BPE model unchanged. What the file does not keep
    is the pre-tokenizer; its `tokenizer.ggml.pre` names it:
      smollm / starcoder / gpt2 ...: GPT-2's regex split, and for smollm and
      starcoder every digit on its own first (SmolLM2's tokenizer.json has
      Digits(individual_digits=True) before ByteLevel, and llama.cpp's 'smollm'
      rule splits `\\p{N}` first the same way).
    Control tokens (<|im_start|>, <|im_end|>, ...) become special added tokens,
    so that written in a prompt they are one id and never cut into pieces.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConvertError(f"tokenizer type {kind!r} is not supported; only byte-level BPE "
                               "('gpt2')")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    steps = []
    if meta.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "codeshell"):
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    # GPT-2's regex split, then bytes -> the printable byte alphabet; no added leading space
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == TOKEN_CONTROL])
    user = [AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    if user:
        tok.add_tokens(user)
    return tok


def tokenizer_config(meta: dict) -> dict:
    """tokenizer_config.json: the chat template and the special tokens by text."""
    tokens = meta["tokenizer.ggml.tokens"]

    def text(key: str):
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",   # "use tokenizer.json as it is"
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "bos_token": text("bos_token_id"),
        "eos_token": text("eos_token_id"),
        "unk_token": text("unknown_token_id"),
        "pad_token": text("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get("llama.context_length", 2048),
    }
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


# ----------------------------------------------------------------------------- the conversion

def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = False) -> Path:
    """Write a Hugging Face folder for the llama GGUF `gguf_path` into `out_dir`
    (created; must not hold files already). Returns `out_dir`.

    Not atomic by itself: common/models.py converts into a temporary folder and
    renames it, so an interrupted run never leaves a half folder behind.
    """
    import gguf
    from gguf.quants import dequantize
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise GGUFConvertError(f"{gguf_path} is not a file; pass the path of a .gguf file")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise GGUFConvertError(f"{out_dir} is not empty; pass a new folder to write the model into")

    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:       # a truncated download or another format
        raise GGUFConvertError(f"{gguf_path} is not a readable GGUF file ({e}); "
                               "download it again") from e
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names     # no separate lm_head: it reuses the embedding
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFConvertError(f"{gguf_path} has no token_embd.weight tensor")
    vocab_size = int(embd.shape[-1])        # GGUF shapes list the fastest dimension first: [C, V]
    config = llama_config(meta, vocab_size, tied)
    n_heads, n_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    tensors = {}
    console = Console(stderr=True)
    bar = Progress(TextColumn("[bold]converting[/] {task.description}"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                   disable=not progress, transient=False)
    with bar:
        task = bar.add_task(gguf_path.name, total=len(reader.tensors))
        for t in reader.tensors:
            # dequantize gives numpy order: rows = output features, [out, in]
            w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if ".attn_q." in t.name:
                w = unpermute_rotary_rows(w, n_heads)        # [H*D, C]
            elif ".attn_k." in t.name:
                w = unpermute_rotary_rows(w, n_kv_heads)     # [Hkv*D, C]
            tensors[hf_name(t.name)] = w
            bar.advance(task)

    expected = 3 + 9 * config["num_hidden_layers"] - int(tied)
    if len(tensors) != expected:
        raise GGUFConvertError(f"{gguf_path} has {len(tensors)} tensors, a llama model of this "
                               f"size needs {expected}")

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    # save_file writes 0600; the cache is readable like its siblings
    (out_dir / "model.safetensors").chmod(0o644)
    eos_ids = end_of_turn_ids(meta)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos_ids if len(eos_ids) > 1 else (eos_ids[0] if eos_ids else None),
        "pad_token_id": config["pad_token_id"],
    }, indent=2) + "\n")
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(meta), indent=2) + "\n")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Convert a llama-architecture GGUF file into a Hugging Face folder.")
    ap.add_argument("gguf", type=Path, help="the .gguf file")
    ap.add_argument("out", type=Path, help="a new folder to write config.json, model.safetensors, "
                                           "tokenizer.json into")
    args = ap.parse_args(argv)
    try:
        convert_gguf(args.gguf, args.out, progress=True)
    except GGUFConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
