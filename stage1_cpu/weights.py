"""Load a model folder into stage 1's layout, quantizing tensor by tensor (to_weight): each
projection becomes a quant.Weight the moment it is read, its float32 copy dropped before the next
is read (peak memory: the quantized model plus one fp32 tensor). q/k/v and gate/up are stacked
into one matrix each (docs/stage1.md, section 3, says why). choose_kernels picks the core alone
or stage1_cpu.fast's FastPath: the one place the core imports the fast path."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.config import ModelConfig
from common.loader import loading, open_weights, stack
from .quant import FORMATS, Weight, quantize


@dataclass
class LayerWeights:
    attn_norm: np.ndarray           # [C]
    wqkv: Weight                    # [(H + 2*Hkv) * D, C]: q_proj, k_proj, v_proj stacked by rows
    wo: Weight                      # [C, H*D]
    mlp_norm: np.ndarray            # [C]
    # [(H + 2*Hkv) * D] q, k, v biases stacked (qwen2, qwen2_moe)
    bqkv: np.ndarray | None = None
    q_norm: np.ndarray | None = None        # [D]   qwen3 only
    k_norm: np.ndarray | None = None        # [D]   qwen3 only
    w_gate_up: Weight | None = None         # [2F, C] dense MLP: gate_proj, up_proj stacked
    w_down: Weight | None = None            # [C, F]
    # [E, C] MoE router, kept in fp32 (it is tiny and decides everything)
    router: Weight | None = None
    # [E * 2Fe, C] every routed expert's gate_up, stacked by rows
    experts_gate_up: Weight | None = None
    # [E * C, Fe] every routed expert's down, stacked by rows
    experts_down: Weight | None = None
    # qwen2_moe's shared expert, a dense MLP every token goes through: [2Fs, C] and [C, Fs]
    shared_gate_up: Weight | None = None
    shared_down: Weight | None = None
    shared_gate: Weight | None = None       # [1, C] its sigmoid gate, fp32 like the router


@dataclass
class Weights:
    config: ModelConfig
    embed: Weight                   # [V, C] read row by row (rows(ids))
    lm_head: Weight                 # [V, C] the same object as embed when tied
    final_norm: np.ndarray          # [C]
    layers: list[LayerWeights]
    # the fast path (stage1_cpu.fast.FastPath) with --kernels fast, else None
    fast: object = None
    source: str = ""                # a GGUF's types and what each became, for the banner


def choose_kernels(kernels: str, activations: str, fmt: str):
    """--kernels auto | plain | fast -> stage1_cpu.fast.FastPath, or None for the core alone
    (fast.choose: auto is fast wherever it runs). The import is here, lazy: nothing of the fast
    path is loaded, let alone compiled, with plain."""
    if kernels != "plain":
        from . import fast
        return fast.choose(kernels, activations, fmt)
    if activations not in ("auto", "fp32"):
        raise ValueError(f"--activations {activations} needs the fast kernels; use "
                         "--kernels fast or auto")
    return None


def to_weight(a, fmt: str, group_size: int, fast, lm_head: bool = False) -> Weight:
    """A matrix from the loader, fp32 [O, K] or a GGUF's int8 / int4 blocks kept as they are
    (--quant stored, common/gguf_quant.py) -> Weight (the core) or FastWeight (fast: choose_kernels'
    FastPath)."""
    kept = getattr(a, "fmt", "none") if fmt == "stored" else fmt
    return fast.quantize(a, kept, group_size, lm_head) if fast else quantize(a, kept, group_size)


def embedding(loader, key: str, fmt: str, group_size: int, fast, block: int = 16384) -> Weight:
    """The embedding / lm_head [V, C], by far the largest tensor (Qwen3-0.6B: 622 MB in fp32), a
    block of rows at a time straight from the mapped file, so its fp32 form never exists whole; then
    stacked."""
    if fmt == "none":                                  # fp32 is the format itself
        return to_weight(loader.glob(key), fmt, group_size, fast, lm_head=True)
    parts = [to_weight(loader.glob(key, rows=slice(r, r + block)), fmt,
                       group_size, fast, lm_head=True)
             for r in range(0, loader.config.vocab_size, block)]
    return parts[0] if len(parts) == 1 else stack(parts)


def load_weights(folder: str | Path, cfg: ModelConfig, fmt: str = "none", group_size: int = 32,
                 progress: bool = True, kernels: str = "auto",
                 activations: str = "auto") -> Weights:
    # stored: a GGUF's blocks as they are (common/gguf_quant.py)
    if fmt not in FORMATS + ("stored",):
        raise ValueError(f"unknown --quant {fmt!r}; choose one of {', '.join(FORMATS)}")
    # a wrong --kernels / --activations fails before any reading
    fast = choose_kernels(kernels, activations, fmt)
    loader = open_weights(folder, cfg, keep_quantized=fmt == "stored")

    def q(a):                     # a matrix of the layers -> a Weight in this model's format
        return to_weight(a, fmt, group_size, fast)

    # The embedding / lm_head, the one matrix every logit goes through, stays int8 when the rest is
    # int4 (as llama.cpp's Q4 files keep it at Q8_0), and the fast path rounds its decode
    # activations to int16, not int8: on the default model either flips the first answer token
    # (docs/stage1.md, sections 6, 12).
    embed_fmt = "int8" if fmt == "int4" else fmt
    # one step per Weight: wqkv and wo per layer (attn=2), gate_up and down per MLP (mlp=2)
    with loading(cfg, f"loading weights ({fmt})", attn=2, mlp=2, show=progress) as step:
        embed = step(embedding(loader, "embed", embed_fmt, group_size, fast))
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in loader
        lm_head = step(embed if tied else embedding(loader, "lm_head", embed_fmt, group_size, fast))
        layers = []
        for i in range(cfg.num_layers):
            L = LayerWeights(
                attn_norm=loader.layer("attn_norm", i),
                wqkv=step(q(loader.fused(["wq", "wk", "wv"], i))),
                wo=step(q(loader.layer("wo", i))),
                mlp_norm=loader.layer("mlp_norm", i),
            )
            if cfg.qkv_bias:
                # biases stay fp32: they are added, not multiplied
                L.bqkv = loader.fused(["bq", "bk", "bv"], i)
            if cfg.qk_norm:
                L.q_norm, L.k_norm = loader.layer("q_norm", i), loader.layer("k_norm", i)
            if cfg.is_moe_layer(i):
                L.router = quantize(loader.layer("router", i), "none")
                # one matrix per projection for all E experts, each expert a block of its rows: the
                # one-region decode step reads the k chosen experts' rows as one work list
                E = cfg.num_experts
                L.experts_gate_up = stack([step(q(loader.fused(["e_gate", "e_up"], i, e)))
                                           for e in range(E)])
                L.experts_down = stack([step(q(loader.layer("e_down", i, e))) for e in range(E)])
                if cfg.shared_expert_intermediate_size:
                    L.shared_gate_up = step(q(loader.fused(["s_gate", "s_up"], i)))
                    L.shared_down = step(q(loader.layer("s_down", i)))
                    L.shared_gate = quantize(loader.layer("shared_gate", i), "none")
            else:
                L.w_gate_up = step(q(loader.fused(["w_gate", "w_up"], i)))
                L.w_down = step(q(loader.layer("w_down", i)))
            layers.append(L)
        final_norm = step(loader.glob("final_norm"))
    return Weights(cfg, embed, lm_head, final_norm, layers, fast,
                   getattr(loader, "describe", lambda: "")())

