"""A tiny random Qwen3 model folder, for the course: every stage and every rung runs it in seconds.

    python -m common.tiny_model DIR  # writes DIR: config.json, model.safetensors, tokenizer ...
    python -m stage1_cpu.chat --model DIR
    python -m stage3_optimized.chat --model DIR --device cpu --page-size 16

The folder is what a Hugging Face Qwen3 checkpoint holds, small: a `Qwen3ForCausalLM`
config.json (2 layers, C=128, 4 query heads and 2 KV heads of D=32, F=384, V=512), random
fp32 weights in model.safetensors under Hugging Face's names (transformers loads it as it is),
and a real byte-level BPE tokenizer: `tokenizers` learns its merges from the short English
text below, then Qwen3's chat tokens are added (<|im_start|>, <|im_end|>, <think>, ...). The
tokenizer encodes any UTF-8 text and decodes it back, and the chat template is the package's
own ChatML (common/chatml.jinja). The answers are random words: the weights are random, and
generation_config.json caps them at 32 tokens (`max_new_tokens`; the chat's --max-tokens
overrides it), since a random model rarely ends an answer by itself. Nothing is downloaded; the
same seed writes the same files.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import (AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        trainers)

# Qwen3-0.6B's layout at a toy size: GQA with 2 query heads per KV head, q/k norms, tied embeddings
CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=512,
              hidden_size=128, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0,
              hidden_act="silu", tie_word_embeddings=True, attention_bias=False,
              torch_dtype="float32")
# the chat's answer length (generation_config.json's max_new_tokens): random weights seldom draw
# the end-of-turn token, so an answer would otherwise run to the context's end
MAX_NEW_TOKENS = 32
# control tokens (skipped when decoding)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>"]
# what the BPE merges are learned from: chat-like English, so a prompt takes a few tokens a word
TEXT = """What is the capital of France? The capital of France is Paris.
Give me three tips for learning a new language. Read, listen, and speak a little every day.
Repeat the city you just named. You are a helpful assistant. Answer the question in one sentence.
A language model reads tokens and writes the next token, one at a time, until the answer ends.
The quick brown fox jumps over the lazy dog. Hello, how are you today? I am fine, thank you.
Prefill reads the whole prompt at once; decode writes one token per step and reads every weight.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Code: def main(): return 0. "Quotes", (brackets) and more.
"""


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE (as Qwen3's: any text, byte by byte, merged where it learned to), its
    merges learned from TEXT, with Qwen3's chat tokens added after the vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL) - len(MARKERS),
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    return tok


def random_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Hugging Face's tensor names and shapes; normal weights of std 0.2 (wide enough that
    greedy answers vary: at the usual 0.02 a tiny tied model repeats one token), norms of 1."""
    rng = np.random.default_rng(seed)
    C, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w = lambda *shape: (0.2 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": w(V, C), "model.norm.weight": ones(C)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": ones(C),
                    p + "post_attention_layernorm.weight": ones(C),
                    p + "self_attn.q_proj.weight": w(H * D, C),
                    p + "self_attn.k_proj.weight": w(Hkv * D, C),
                    p + "self_attn.v_proj.weight": w(Hkv * D, C),
                    p + "self_attn.o_proj.weight": w(C, H * D),
                    p + "self_attn.q_norm.weight": ones(D), p + "self_attn.k_norm.weight": ones(D),
                    p + "mlp.gate_proj.weight": w(F, C), p + "mlp.up_proj.weight": w(F, C),
                    p + "mlp.down_proj.weight": w(C, F)})
    return out


def write_tiny_model(folder: str | Path, seed: int = 0) -> Path:
    """Write the tiny model into `folder` (created; it must not hold files already) -> the
    folder."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} exists and is not an empty folder: give a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(CONFIG["vocab_size"])
    assert tok.get_vocab_size() <= CONFIG["vocab_size"], tok.get_vocab_size()
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
         "add_bos_token": False,
         "model_max_length": CONFIG["max_position_embeddings"]}, indent=1) + "\n")
    (folder / "config.json").write_text(
        json.dumps(dict(CONFIG, bos_token_id=None, eos_token_id=eos), indent=1) + "\n")
    # Qwen3's sampling; answers of at most MAX_NEW_TOKENS (random weights rarely draw <|im_end|>)
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
         "max_new_tokens": MAX_NEW_TOKENS}, indent=1) + "\n")
    save_file(random_weights(CONFIG, seed), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.tiny_model",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="where to write the model (a new or empty folder)")
    ap.add_argument("--seed", type=int, default=0, help="the weights' random seed (default 0)")
    args = ap.parse_args(argv)
    try:
        folder = write_tiny_model(args.folder, args.seed)
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote a tiny random Qwen3 model to {folder}: "
          f"try python -m stage1_cpu.chat --model {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
