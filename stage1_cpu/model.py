"""The forward pass, top to bottom: token ids in, logits out. One sequence at a time.

    x = embed(tokens)                                   [T, C]
    for each layer:
        h = rmsnorm(x)                                  attention block
        q, k, v = h @ wq.T, h @ wk.T, h @ wv.T          (one matmul: wqkv = [wq; wk; wv])
                                                        (+ bq, bk, bv: qwen2, qwen2_moe)
        q, k = rmsnorm per head (qwen3), then RoPE
        cache k, v; attend causally over the cache (GQA)
        x = x + attn @ wo.T
        h = rmsnorm(x)                                  MLP block
        x = x + down(silu(gate(h)) * up(h))             (or the routed experts of a MoE layer,
                                                         plus a gated shared expert: qwen2_moe)
    logits = rmsnorm(x) @ lm_head.T                     [V] for the last position

Each step is one kernel of `kern` (build_model picks them), each matmul a quant.Weight in any
format; with --kernels fast a step of a few tokens runs in one parallel region instead
(fast/decode_step.py), bit for bit the same. Weight names are Hugging Face's (common/loader.py).
"""
from __future__ import annotations

import numpy as np

from . import kernels, ops
from .kv_cache import KVCache
from .quant import Weight
from .weights import LayerWeights, Weights


def build_model(weights: Weights, max_ctx: int, use_numba: bool = True):
    """The model with its kernels, chosen once: kernels.py's, ops.py's numpy definitions to check
    them (use_numba=False), or the fast path's with its one-region decode step in front."""
    if weights.fast is None or not use_numba:
        return Model(weights, max_ctx, kernels if use_numba else ops)
    return weights.fast.one_region(Model(weights, max_ctx, weights.fast.kernels()))


class Model:
    def __init__(self, weights: Weights, max_ctx: int, kern):
        self.w = weights
        self.config = cfg = weights.config
        self.cache = KVCache(cfg, max_ctx)
        self.kernels = kern                                    # the namespace of the per-op kernels
        self.cos, self.sin = ops.rope_tables(max_ctx, cfg.head_dim, cfg.rope_theta,   # [T_max, D/2]
                                             cfg.rope_scaling)

    def forward(self, tokens: np.ndarray, start_pos: int, all_logits: bool = False) -> np.ndarray:
        """tokens [T] at positions start_pos..start_pos+T-1 (the cache already holds
        0..start_pos-1) -> logits [V] of the last position, or [T, V] with all_logits."""
        cfg, w, kern = self.config, self.w, self.kernels
        T = len(tokens)
        H, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        if start_pos + T > self.cache.max_ctx:
            raise ValueError(f"positions up to {start_pos + T} exceed the cache "
                             f"({self.cache.max_ctx}); raise --max-ctx")
        # token embedding: dequantize only the T rows we need
        x = w.embed.rows(np.asarray(tokens, dtype=np.int64))   # [T, C]
        cos = self.cos[start_pos:start_pos + T]                # [T, D/2] the new positions' angles
        sin = self.sin[start_pos:start_pos + T]

        for layer, lw in enumerate(w.layers):
            # ---- attention block ----
            h = kern.rmsnorm(x, lw.attn_norm, eps)             # [T, C]
            # [T, (H + 2 Hkv) D]: q, k, v in one matmul
            qkv = lw.wqkv.matmul(h)
            if lw.bqkv is not None:
                qkv = qkv + lw.bqkv                            # Qwen2: q, k and v have biases
            q = qkv[:, :H * D].reshape(T, H, D)                # [T, H, D]
            k = qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D)   # [T, Hkv, D]
            v = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D)      # [T, Hkv, D]
            if cfg.qk_norm:
                # Qwen3: RMSNorm over each head's D values, before RoPE, keeps q.k well scaled
                q = kern.rmsnorm(q, lw.q_norm, eps)
                k = kern.rmsnorm(k, lw.k_norm, eps)
            q = kern.rope(q, cos, sin)                         # rotate by each position's angle
            k = kern.rope(k, cos, sin)
            self.cache.store(layer, start_pos, k, v)           # the new positions join the cache
            att = kern.attention(q, self.cache.keys(layer), self.cache.values(layer), start_pos)
            x = x + lw.wo.matmul(att.reshape(T, H * D))        # [T, C] residual

            # ---- MLP block ----
            h = kern.rmsnorm(x, lw.mlp_norm, eps)              # [T, C]
            if lw.router is not None:                          # a MoE layer
                x = x + self.moe(h, lw)
            else:
                # SwiGLU: down(silu(gate(h)) * up(h)), gate and up in one matmul [T, 2F]
                x = x + lw.w_down.matmul(kern.silu_mul(lw.w_gate_up.matmul(h)))

        # only the last position's logits are needed to pick the next token
        if not all_logits:
            x = x[-1:]                                         # [1, C]
        x = kern.rmsnorm(x, w.final_norm, eps)
        logits = w.lm_head.matmul(x)                           # [T or 1, V]
        return logits if all_logits else logits[0]

    def moe(self, h: np.ndarray, lw: LayerWeights) -> np.ndarray:
        """Qwen3-MoE: each token goes to its top-k experts, weighted by the router.
        Qwen2-MoE adds a shared expert that every token goes through, scaled by a
        sigmoid gate of its own. h [T, C] -> [T, C]."""
        cfg, kern = self.config, self.kernels
        # router in fp32: softmax over all E experts, top k [T, k] (renormalised: norm_topk_prob)
        top, weight = kern.route(lw.router.matmul(h), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        # [T k, 2Fe]: slot j of token t in row t k + j
        gu = self.experts(lw.experts_gate_up, h, top)
        y = self.experts(lw.experts_down, kern.silu_mul(gu), top)  # [T k, C]
        out = kern.mix(y, weight)                              # [T, C] = sum_j weight_j y_j
        if lw.shared_gate_up is not None:
            # the shared expert: every token, weighted by sigmoid(h . shared_gate) in (0, 1)
            y = lw.shared_down.matmul(kern.silu_mul(lw.shared_gate_up.matmul(h)))   # [T, C]
            out = kern.gated_add(out, y, lw.shared_gate.matmul(h))  # gate [T, 1] in fp32
        return out

    def experts(self, w: Weight, x: np.ndarray, top: np.ndarray) -> np.ndarray:
        """Each token's k chosen experts, one projection: w stacks all E experts' matrices
        by rows (n = out / E each); x [T, in] (every slot of a token reads its row) or
        [T k, in] (slot j of token t reads row t k + j); top [T, k] -> [T k, n].
        Tokens are grouped by expert, so each chosen expert's rows are read once per step."""
        # exercise 1.7 begin
        T, k = top.shape
        n = w.out_features // self.config.num_experts
        per_slot = x.shape[0] == T * k
        out = np.empty((T * k, n), dtype=np.float32)
        flat = top.reshape(-1)                                 # [T k] slot -> expert
        for e in np.unique(flat):
            slots = np.nonzero(flat == e)[0]                   # the slots routed to e
            out[slots] = w.part(e * n, (e + 1) * n).matmul(x[slots if per_slot else slots // k])
        return out
        # exercise 1.7 end
