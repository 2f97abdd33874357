"""Load a model folder into stage 1's layout, quantizing tensor by tensor.

Each projection becomes a quant.Weight (fp32, bf16, int8 or int4) the moment it
is read, and the float32 copy is dropped before the next tensor is read: peak
memory stays near the size of the quantized model plus one fp32 tensor.

q_proj, k_proj and v_proj become one matrix, as do gate_proj and up_proj: they
multiply the same input, so one matmul reads that input once and starts the
threads once instead of three (two) times. On the per-op path, where a parallel
region costs tens of microseconds to start under OMP_WAIT_POLICY=PASSIVE, that is 3
of 7 starts per layer saved; fast/decode_step.py, which starts them once per token,
still reads the input once instead of three times.

This is also the one place that chooses the kernels (choose_kernels, --kernels): the
core alone, or stage1_cpu.fast's FastPath, imported here and only here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.progress import Progress

from common.config import ModelConfig
from common.loader import WeightLoader, open_weights
from .quant import FORMATS, Weight, quantize


@dataclass
class ExpertWeights:
    e_gate_up: Weight   # [2Fe, C]: gate_proj, up_proj stacked
    e_down: Weight      # [C, Fe]


@dataclass
class LayerWeights:
    attn_norm: np.ndarray           # [C]
    wqkv: Weight                    # [(H + 2*Hkv) * D, C]: q_proj, k_proj, v_proj stacked by rows
    wo: Weight                      # [C, H*D]
    mlp_norm: np.ndarray            # [C]
    bqkv: np.ndarray | None = None          # [(H + 2*Hkv) * D] q, k, v biases stacked (qwen2, qwen2_moe)
    q_norm: np.ndarray | None = None        # [D]   qwen3 only
    k_norm: np.ndarray | None = None        # [D]   qwen3 only
    w_gate_up: Weight | None = None         # [2F, C] dense MLP: gate_proj, up_proj stacked
    w_down: Weight | None = None            # [C, F]
    router: Weight | None = None            # [E, C] MoE router, kept in fp32 (it is tiny and decides everything)
    experts: list[ExpertWeights] = field(default_factory=list)   # views into the two stacks below
    experts_gate_up: Weight | None = None   # [E * 2Fe, C] every routed expert's gate_up, stacked by rows
    experts_down: Weight | None = None      # [E * C, Fe] every routed expert's down, stacked by rows
    shared_expert: ExpertWeights | None = None  # qwen2_moe: [2Fs, C] and [C, Fs], every token goes through it
    shared_gate: Weight | None = None       # [1, C] its sigmoid gate, fp32 like the router


@dataclass
class Weights:
    config: ModelConfig
    embed: Weight                   # [V, C] read row by row (rows(ids))
    lm_head: Weight                 # [V, C] the same object as embed when tied
    final_norm: np.ndarray          # [C]
    layers: list[LayerWeights]
    fmt: str                        # none | bf16 | int8 | int4
    fast: object = None             # the fast path (stage1_cpu.fast.FastPath) with --kernels fast, else None
    source: str = ""                # a GGUF's types and what each became, for the banner

    @property
    def kernels(self) -> str:
        return "fast" if self.fast else "plain"


KERNELS = ("auto", "plain", "fast")


def choose_kernels(kernels: str, activations: str, fmt: str):
    """--kernels auto | plain | fast -> stage1_cpu.fast.FastPath, or None for the core alone.
    auto is fast wherever it runs (fast.available()). The import is here, lazy: nothing of
    the fast path is loaded, let alone compiled, with plain."""
    if kernels not in KERNELS:
        raise ValueError(f"unknown --kernels {kernels!r}; choose one of {', '.join(KERNELS)}")
    if kernels == "plain":
        if activations not in ("auto", "fp32"):
            raise ValueError(f"--activations {activations} needs the fast kernels; use --kernels fast or auto")
        return None
    from . import fast
    why_not = fast.available()
    if why_not and kernels == "fast":
        raise ValueError(f"--kernels fast is not available here: {why_not}; use --kernels plain")
    return None if why_not else fast.FastPath(fmt, activations)


def load_weights(folder: str | Path, fmt: str = "none", group_size: int = 32,
                 progress: bool = True, kernels: str = "auto", activations: str = "auto") -> Weights:
    if fmt not in FORMATS + ("stored",):   # stored: a GGUF's blocks as they are (common/gguf_quant.py)
        raise ValueError(f"unknown --quant {fmt!r}; choose one of {', '.join(FORMATS)}")
    fast = choose_kernels(kernels, activations, fmt)  # a wrong --kernels / --activations fails before any reading

    def quantizer(fmt: str, lm_head: bool = False):
        """A tensor from the loader -> Weight (the core) or FastWeight (the fast path). The loader
        hands over fp32 arrays [O, K], or blocks it kept quantized (--quant stored: a GGUF's
        int8 / int4 groups, common/gguf_quant.py), which stay in the format they came in."""
        def kept(a):
            return getattr(a, "fmt", "none") if fmt == "stored" else fmt
        if fast:
            return lambda a: fast.quantize(a, kept(a), group_size, lm_head)
        return lambda a: quantize(a, kept(a), group_size)

    loader = open_weights(folder, keep_quantized=fmt == "stored")
    cfg = loader.config
    q = quantizer(fmt)
    # The embedding / lm_head stays at int8 when the rest is int4, as llama.cpp's Q4 files keep
    # token_embd at Q8_0 and the output at Q6_K. It is the one matrix every logit goes through:
    # on the default model, all-int4 flips the first token of "What is the capital of France?"
    # (fp32 margin 0.09 logits) while int8 keeps it; see docs/stage1.md for the measurements.
    embed_fmt = "int8" if fmt == "int4" else fmt
    # For the same reason its decode activations are rounded to int16, not int8, unless int8 is
    # asked for by name: on the default model, int4 weights with int8 activations everywhere flip
    # that same first token (margin 0.08 logits); with the lm_head's at int16 (or fp32) they do not.
    head_q = quantizer(embed_fmt, lm_head=True)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    n_shared = n_moe if cfg.shared_expert_intermediate_size else 0
    total = 2 + cfg.num_layers * 4 + n_moe * (cfg.num_experts - 1) * 2 + n_shared * 2  # one step per Weight
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task(f"loading weights ({fmt})", total=total)

        def step(value):
            bar.advance(task)
            return value

        embed = step(_quantize_by_rows(loader, "embed", head_q, embed_fmt))
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in loader
        lm_head = embed if tied else step(_quantize_by_rows(loader, "lm_head", head_q, embed_fmt))
        layers = []
        for i in range(cfg.num_layers):
            L = LayerWeights(
                attn_norm=loader.layer("attn_norm", i),
                wqkv=step(q(loader.fused(["wq", "wk", "wv"], i))),
                wo=step(q(loader.layer("wo", i))),
                mlp_norm=loader.layer("mlp_norm", i),
            )
            if cfg.qkv_bias:
                L.bqkv = loader.fused(["bq", "bk", "bv"], i)   # biases stay fp32: they are added, not multiplied
            if cfg.qk_norm:
                L.q_norm, L.k_norm = loader.layer("q_norm", i), loader.layer("k_norm", i)
            if cfg.is_moe_layer(i):
                L.router = quantize(loader.layer("router", i), "none")
                experts = [ExpertWeights(step(q(loader.fused(["e_gate", "e_up"], i, e))),
                                         step(q(loader.layer("e_down", i, e))))
                           for e in range(cfg.num_experts)]
                # one matrix per projection for all E experts, each expert a view of its rows: the
                # one-region decode step reads the k chosen experts' rows as one work list
                L.experts_gate_up = _stack([ex.e_gate_up for ex in experts])
                L.experts_down = _stack([ex.e_down for ex in experts])
                del experts
                Fe2, C = L.experts_gate_up.out_features // cfg.num_experts, cfg.hidden_size
                L.experts = [ExpertWeights(L.experts_gate_up.part(e * Fe2, (e + 1) * Fe2),
                                           L.experts_down.part(e * C, (e + 1) * C))
                             for e in range(cfg.num_experts)]
                if cfg.shared_expert_intermediate_size:
                    L.shared_expert = ExpertWeights(step(q(loader.fused(["s_gate", "s_up"], i))),
                                                    step(q(loader.layer("s_down", i))))
                    L.shared_gate = quantize(loader.layer("shared_gate", i), "none")
            else:
                L.w_gate_up = step(q(loader.fused(["w_gate", "w_up"], i)))
                L.w_down = step(q(loader.layer("w_down", i)))
            layers.append(L)
        final_norm = step(loader.glob("final_norm"))
    if fmt == "stored":     # e.g. int4+int8: what the warm-up mark and the banner name
        fmt = "+".join(sorted({w.fmt for l in layers for w in (l.wqkv, l.wo, l.w_gate_up, l.w_down,
                                                                 l.experts_gate_up, l.experts_down) if w}))
    return Weights(cfg, embed, lm_head, final_norm, layers, fmt, fast, getattr(loader, "describe", lambda: "")())


def _quantize_by_rows(loader: WeightLoader, key: str, q, fmt: str, block: int = 16384) -> Weight:
    """The embedding / lm_head [V, C] is by far the largest tensor (Qwen3-0.6B: 622 MB in
    fp32). Quantize it a block of rows at a time straight from the mapped file (q: a
    quantizer()), so its fp32 form never exists whole. -> one Weight, the blocks' rows stacked."""
    V = loader.config.vocab_size
    if fmt == "none":
        return q(loader.glob(key))                            # fp32 is the format itself
    parts = [q(loader.glob(key, rows=slice(r, r + block))) for r in range(0, V, block)]
    return parts[0] if len(parts) == 1 else _stack(parts)


def _stack(ws: list[Weight]) -> Weight:
    """Weights of one format and in_features -> one Weight, their rows stacked in order."""
    cat = lambda name: (None if getattr(ws[0], name) is None  # noqa: E731
                        else np.concatenate([getattr(w, name) for w in ws]))
    return dataclasses.replace(ws[0], out_features=sum(w.out_features for w in ws), data=cat("data"),
                               scales=cat("scales"), mins=cat("mins"))

