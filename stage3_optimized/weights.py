"""Load a model folder into stage 3's layout: arrays on the device, projections fused.

Changed from stage 2, lesson by lesson (docs/lessons/stage3):
  * Fused QKV: q, k and v are one [(H + 2 Hkv) * D, C] matrix (`wqkv`), concatenated along
    the output rows at load time, and Qwen2's biases one vector (`bqkv`): one GEMM reads h
    once and launches once instead of three times.
  * Fused gate/up: one [2F, C] matrix (`w_gate_up`), and the same for every MoE expert
    (Qwen2-MoE's shared one too).
  * bf16: every matrix is rounded to bf16 once, here, and kept as its 16 bits (uint16): half
    the bytes a decode step reads. `.matmul(x)` is cuBLAS's GEMM with bf16 inputs and fp32
    sums (kernels.linear); `.rows(ids)` starts the fp32 residual stream from the bf16
    embedding. Norms and biases keep float32 storage of their bf16-rounded values.
  * The norm weights are stored as bf16 too (rmsnorm and qk_norm_rope_store read them).
  * `.matmul(x)` writes bf16 (float32 with out_f32).
  * `.matmul(x, add_into=...)`: a block's last GEMM adds into the residual stream.
  * `.norm_matmul` and `.swiglu_matmul`: the GEMM with the RMSNorm or SwiGLU in front (one
    gemv.cu launch for a decode batch).

As in stage 2, each tensor is read from the memory-mapped file and copied to the device;
`.matmul(x)` and `.rows(ids)` write into the `out=` buffer they are given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.config import ModelConfig
from common.loader import loading, open_weights
from . import kernels
from .ops import bf16_bits, round_bf16


class Weight:
    """A bf16 matrix [out, in] (uint16 bits) on the device, in Hugging Face's layout."""

    def __init__(self, data):
        self.data = data                    # [out, in] cupy or numpy

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def matmul(self, x, out_f32: bool = False, out=None, add_into=None):
        """x [N, in] bf16 -> x @ W.T [N, out] bf16 (float32 with out_f32: the logits), or added
        into add_into [N, out] float32 (a block's last GEMM into the residual stream), which
        is returned. cuBLAS on the GPU reads W transposed, no copy; fp32 accumulation."""
        return kernels.linear(x, self.data, out_f32, out=out, add_into=add_into)

    def norm_matmul(self, x, norm_w, eps: float, h=None, bias=None, out_f32: bool = False,
                    out=None):
        """A block's first GEMM: rmsnorm(x [N, in] fp32) * norm_w @ W.T -> [N, out] bf16
        (+ bias before rounding; float32 with out_f32). h: a buffer for the normed rows."""
        return kernels.rmsnorm_linear(x, norm_w, eps, self.data, h=h, bias=bias, out_f32=out_f32,
                                      out=out)

    def swiglu_matmul(self, gate_up, add_into, act=None):
        """The MLP's down projection, added into the stream: add_into + swiglu(gate_up) @ W.T,
        returned. act: a buffer for swiglu's output [N, in]."""
        return kernels.swiglu_linear(gate_up, self.data, add_into, act=act)

    def rows(self, ids, out=None):
        """The embedding lookup: ids [N] -> rows [N, in] (kernels.embedding)."""
        return kernels.embedding(ids, self.data, out)


@dataclass
class ExpertWeights:
    e_gate_up: Weight   # [2Fe, C]  gate_proj, up_proj stacked
    e_down: Weight      # [C, Fe]


@dataclass
class LayerWeights:
    attn_norm: object               # [C]
    wqkv: Weight                    # [(H + 2*Hkv)*D, C]  q_proj, k_proj, v_proj stacked
    wo: Weight                      # [C, H*D]
    mlp_norm: object                # [C]
    q_norm: object | None = None    # [D]   qwen3 only
    k_norm: object | None = None    # [D]   qwen3 only
    w_gate_up: Weight | None = None # [2F, C] dense MLP: gate_proj, up_proj stacked
    w_down: Weight | None = None    # [C, F]
    router: Weight | None = None    # [E, C] MoE router (its logits go to the host for top-k)
    experts: list[ExpertWeights] = field(default_factory=list)
    # [(H + 2*Hkv)*D] float32: q, k, v biases stacked (qwen2, qwen2_moe)
    bqkv: object | None = None
    # qwen2_moe: [2Fs, C], [C, Fs]; every token goes through it
    shared_expert: ExpertWeights | None = None
    shared_gate: Weight | None = None           # [1, C] its sigmoid gate


@dataclass
class Weights:
    config: ModelConfig
    embed: Weight                   # [V, C]
    lm_head: Weight                 # [V, C] the same object as embed when tied
    final_norm: object              # [C]
    layers: list[LayerWeights]
    xp: object                      # the array module: cupy ("cuda") or numpy ("cpu")

    @property
    def nbytes(self) -> int:
        """Bytes of every matrix a decode step may read: attention, dense MLPs, all the
        experts of MoE layers (routed and shared), routers and shared-expert gates, and
        the lm_head. Not counted: the embedding (one row per token; counted once as the
        lm_head when tied), norms and biases. For a dense model this is what one decode
        step reads; for MoE, decode_nbytes is."""
        return self._matrix_bytes(routed_share=1.0)

    @property
    def decode_nbytes(self) -> int:
        """Bytes of weights one token's decode reads (the roofline's numerator): nbytes with
        each MoE layer's routed experts counted for only the k of E a token goes to."""
        cfg = self.config
        return self._matrix_bytes(routed_share=cfg.num_experts_per_tok / cfg.num_experts
                                  if cfg.num_experts else 1.0)

    def _matrix_bytes(self, routed_share: float) -> int:
        seen, total, routed = set(), 0, 0
        names = ("wqkv", "wo", "w_gate_up", "w_down", "router", "shared_gate")
        for w in [self.lm_head] + [getattr(l, n) for l in self.layers for n in names]:
            if w is not None and id(w) not in seen:
                seen.add(id(w))
                total += w.nbytes
        for l in self.layers:
            if l.shared_expert is not None:
                total += sum(w.nbytes for w in vars(l.shared_expert).values())
            routed += sum(w.nbytes for ex in l.experts for w in vars(ex).values())
        return total + round(routed * routed_share)


def load_weights(folder: str | Path, cfg: ModelConfig, xp=np, progress: bool = True) -> Weights:
    loader = open_weights(folder, cfg)   # a Hugging Face folder or a GGUF file (dequantized)
    # host -> device
    dev = lambda a: xp.asarray(np.ascontiguousarray(a, dtype=np.float32))  # noqa: E731
    # the matrices: rounded to bf16 on the host (round to nearest even), one copy of the bits each
    q = lambda a: Weight(xp.asarray(np.ascontiguousarray(bf16_bits(a))))     # noqa: E731
    fuse = lambda *ps: q(np.concatenate([np.asarray(p, np.float32) for p in ps]))  # noqa: E731
    # the norms, stored as bf16 too; the biases, bf16-rounded and held as float32 for their add
    vec = lambda a: xp.asarray(np.ascontiguousarray(bf16_bits(a)))         # noqa: E731
    bias = lambda *ps: dev(np.concatenate([round_bf16(p) for p in ps]))   # noqa: E731
    # one step per matrix: wqkv and wo per layer (attn=2), gate_up and down per MLP (mlp=2)
    with loading(cfg, "loading weights (bf16)", attn=2, mlp=2, show=progress) as step:
        embed = step(q(loader.glob("embed")))
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in loader
        lm_head = step(embed if tied else q(loader.glob("lm_head")))
        layers = []
        for i in range(cfg.num_layers):
            L = LayerWeights(
                attn_norm=vec(loader.layer("attn_norm", i)),
                wqkv=step(fuse(loader.layer("wq", i), loader.layer("wk", i),
                               loader.layer("wv", i))),
                wo=step(q(loader.layer("wo", i))),
                mlp_norm=vec(loader.layer("mlp_norm", i)),
            )
            if cfg.qkv_bias:
                L.bqkv = bias(loader.layer("bq", i), loader.layer("bk", i), loader.layer("bv", i))
            if cfg.qk_norm:
                L.q_norm, L.k_norm = vec(loader.layer("q_norm", i)), vec(loader.layer("k_norm", i))
            if cfg.is_moe_layer(i):
                L.router = q(loader.layer("router", i))
                L.experts = [ExpertWeights(step(fuse(loader.layer("e_gate", i, e),
                                                     loader.layer("e_up", i, e))),
                                           step(q(loader.layer("e_down", i, e))))
                             for e in range(cfg.num_experts)]
                if cfg.shared_expert_intermediate_size:
                    L.shared_expert = ExpertWeights(step(fuse(loader.layer("s_gate", i),
                                                              loader.layer("s_up", i))),
                                                    step(q(loader.layer("s_down", i))))
                    L.shared_gate = q(loader.layer("shared_gate", i))
            else:
                L.w_gate_up = step(fuse(loader.layer("w_gate", i), loader.layer("w_up", i)))
                L.w_down = step(q(loader.layer("w_down", i)))
            layers.append(L)
        final_norm = step(vec(loader.glob("final_norm")))
    return Weights(cfg, embed, lm_head, final_norm, layers, xp)
