"""Tiny random-weight models written by transformers itself: the test oracle.

make_model() builds a model folder with save_pretrained (real architecture, real
file layout) and caches it for the whole pytest session, so the suite pays for
each model once. initializer_range=0.2 makes greedy outputs vary (with the default
0.02 a tied tiny model repeats one token forever). transformers initialises the
q/k/v biases of qwen2 / qwen2_moe to zero; they are drawn at random here, so a
model that ignored them would fail the comparison.
"""
from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

from .qwen_tokenizer import build_qwen3_tokenizer

ROOT = Path(tempfile.mkdtemp(prefix="qwen3-stages-models-"))
# the 0.6B-shape model alone is 2.4 GB: a session's models go when the session ends
atexit.register(shutil.rmtree, ROOT, ignore_errors=True)
_cache: dict = {}

# Small but awkward: head_dim 32 with 4/2 heads, hidden 96 (not a power of two)
BASE = dict(vocab_size=512, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
            rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)
QWEN3_VOCAB = 151936      # the real Qwen3 vocabulary size, used with the real tokenizer
# a greedy step whose top two logits differ by less than this is a near-tie for a bf16 engine
# (stage 3): either token is right; twice the largest bf16 logit error seen
BF16_MARGIN = 0.2


def make_model(family: str = "qwen3", dtype: str = "float32", sharded: bool = False,
               tokenizer: bool = False, seed: int = 0, **overrides) -> Path:
    """-> a model folder (config.json, *.safetensors, generation_config.json[, tokenizer])."""
    key = (family, dtype, sharded, tokenizer, seed, repr(sorted(overrides.items())))
    if key in _cache:
        return _cache[key]
    import torch
    import transformers as tf

    kw = dict(BASE)
    if tokenizer:
        kw.update(vocab_size=QWEN3_VOCAB, bos_token_id=None, eos_token_id=[151645, 151643])
    if family == "qwen3":
        kw["rope_theta"] = 1000000.0
        cfg_cls, model_cls = tf.Qwen3Config, tf.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0)
        cfg_cls, model_cls = tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM
    elif family == "llama":
        kw["rope_theta"] = 100000.0
        cfg_cls, model_cls = tf.LlamaConfig, tf.LlamaForCausalLM
    elif family == "qwen2":
        kw["rope_theta"] = 1000000.0
        cfg_cls, model_cls = tf.Qwen2Config, tf.Qwen2ForCausalLM
    elif family == "qwen2_moe":
        # Qwen2-MoE's defaults: no renormalisation of the top k; a shared expert wider
        # than a routed one (the real 14B-A2.7B: 5632 against 1408)
        kw.update(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=48,
                  shared_expert_intermediate_size=80, norm_topk_prob=False, decoder_sparse_step=1,
                  mlp_only_layers=[], rope_theta=1000000.0)
        cfg_cls, model_cls = tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM
    else:
        raise ValueError(family)
    kw.update(overrides)
    torch.manual_seed(seed)
    config = cfg_cls(**kw)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name and p.std() < 0.05:
                # transformers 5 initialises Qwen3-MoE's expert weights with the default 0.02
                # whatever initializer_range says; scale them up so the experts matter
                p.normal_(0.0, kw["initializer_range"])
            elif name.endswith(".bias"):
                # zero in transformers' init; large enough here to move every logit
                p.normal_(0.0, 0.5)
    model = model.to(getattr(torch, dtype))
    out = ROOT / f"{family}-{dtype}-{'sh' if sharded else 'one'}-{'tok' if tokenizer else 'notok'}-{seed}-{len(_cache)}"
    model.save_pretrained(out, max_shard_size="200KB" if sharded else "10GB")
    gen = {"bos_token_id": kw.get("bos_token_id"), "eos_token_id": kw["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen))
    if tokenizer:
        build_qwen3_tokenizer(out)
    _cache[key] = out
    return out


def load_hf(folder: Path, dtype: str = "float32"):
    """The transformers model for a folder, in eval mode (the oracle)."""
    import torch
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()


def hf_logits(folder: Path, ids: list[int], dtype: str = "float32"):
    """Logits of every position [T, V] as float32 numpy, from transformers."""
    import torch
    model = load_hf(folder, dtype)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def hf_greedy(folder: Path, ids: list[int], steps: int, dtype: str = "float32") -> list[int]:
    """transformers' greedy continuation of ids (steps new tokens, EOS ignored)."""
    import torch
    model = load_hf(folder, dtype)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_on_bf16_weights(folder: Path, dtype: str = "float32"):
    """transformers' model with every parameter rounded to bf16 (to nearest even, as stage 3
    rounds) and kept as dtype: the oracle for an engine that stores bf16 weights."""
    import torch
    model = load_hf(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model.to(getattr(torch, dtype))
