"""Load a model folder into stage 2's layout: float32 arrays on the device.

Changed from stage 1: no quantization (fp32 in this stage, stage 3 goes bf16);
each tensor is read from the memory-mapped file and copied to the device (a
cupy array on "cuda", the numpy array itself on "cpu"). `Weight` keeps stage 1's
two methods, so the model's lines stay the same: `.matmul(x)` is one cuBLAS GEMM
(x @ W.T, cupy.matmul) and `.rows(ids)` is the embedding gather kernel; both write
into the `out=` buffer they are given (model.py's Scratch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.config import ModelConfig
from common.loader import loading, open_weights
from . import kernels


class Weight:
    """A float32 matrix [out, in] on the device, in Hugging Face's layout."""

    def __init__(self, data):
        self.data = data                    # [out, in] cupy or numpy

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def matmul(self, x, out=None):
        """x [N, in] -> x @ W.T [N, out] (cuBLAS on the GPU reads W transposed, no copy),
        into out when given, else a new array."""
        return kernels.matmul(x, self.data.T, out)

    def rows(self, ids, out=None):
        """The embedding lookup: ids [N] -> rows [N, in] (kernels.embedding)."""
        return kernels.embedding(ids, self.data, out)


@dataclass
class ExpertWeights:
    e_gate: Weight      # [Fe, C]
    e_up: Weight        # [Fe, C]
    e_down: Weight      # [C, Fe]


@dataclass
class LayerWeights:
    attn_norm: object               # [C]
    wq: Weight                      # [H*D, C]
    wk: Weight                      # [Hkv*D, C]
    wv: Weight                      # [Hkv*D, C]
    wo: Weight                      # [C, H*D]
    mlp_norm: object                # [C]
    bq: object | None = None        # [H*D]   q_proj's bias (qwen2, qwen2_moe)
    bk: object | None = None        # [Hkv*D] k_proj's bias
    bv: object | None = None        # [Hkv*D] v_proj's bias
    q_norm: object | None = None    # [D]   qwen3 only
    k_norm: object | None = None    # [D]   qwen3 only
    w_gate: Weight | None = None    # [F, C] dense MLP
    w_up: Weight | None = None      # [F, C]
    w_down: Weight | None = None    # [C, F]
    router: Weight | None = None    # [E, C] MoE router (its logits go to the host for top-k)
    experts: list[ExpertWeights] = field(default_factory=list)
    # qwen2_moe: [Fs, C] x 2, [C, Fs]; every token goes through it
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
        for w in [self.lm_head] + [getattr(l, n) for l in self.layers
                                   for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
                                             "router", "shared_gate")]:
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
    q = lambda a: Weight(dev(a))                                              # noqa: E731
    # one step per matrix: wq, wk, wv and wo per layer (attn=4), gate, up and down per MLP (mlp=3)
    with loading(cfg, "loading weights (float32)", attn=4, mlp=3, show=progress) as step:
        embed = step(q(loader.glob("embed")))
        tied = cfg.tie_word_embeddings or "lm_head.weight" not in loader
        lm_head = step(embed if tied else q(loader.glob("lm_head")))
        layers = []
        for i in range(cfg.num_layers):
            L = LayerWeights(
                attn_norm=dev(loader.layer("attn_norm", i)),
                wq=step(q(loader.layer("wq", i))),
                wk=step(q(loader.layer("wk", i))),
                wv=step(q(loader.layer("wv", i))),
                wo=step(q(loader.layer("wo", i))),
                mlp_norm=dev(loader.layer("mlp_norm", i)),
            )
            if cfg.qkv_bias:
                L.bq, L.bk, L.bv = (dev(loader.layer(b, i)) for b in ("bq", "bk", "bv"))
            if cfg.qk_norm:
                L.q_norm, L.k_norm = dev(loader.layer("q_norm", i)), dev(loader.layer("k_norm", i))
            if cfg.is_moe_layer(i):
                L.router = q(loader.layer("router", i))
                L.experts = [ExpertWeights(step(q(loader.layer("e_gate", i, e))),
                                           step(q(loader.layer("e_up", i, e))),
                                           step(q(loader.layer("e_down", i, e))))
                             for e in range(cfg.num_experts)]
                if cfg.shared_expert_intermediate_size:
                    L.shared_expert = ExpertWeights(step(q(loader.layer("s_gate", i))),
                                                    step(q(loader.layer("s_up", i))),
                                                    step(q(loader.layer("s_down", i))))
                    L.shared_gate = q(loader.layer("shared_gate", i))
            else:
                L.w_gate = step(q(loader.layer("w_gate", i)))
                L.w_up = step(q(loader.layer("w_up", i)))
                L.w_down = step(q(loader.layer("w_down", i)))
            layers.append(L)
        final_norm = step(dev(loader.glob("final_norm")))
    return Weights(cfg, embed, lm_head, final_norm, layers, xp)
