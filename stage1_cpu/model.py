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

Weight names follow Hugging Face's (wq is q_proj, ...); the rename table is in
common/loader.py. Each matmul is a quant.Weight, so the same code runs fp32,
bf16, int8 and int4 weights.

With the fast kernels (--kernels fast, chosen in weights.py), one token of a
dense model (decode) is handed to the fast path's decode step, which runs this
same computation, bit for bit, in one parallel region instead of one per
matmul; one_region=False keeps it here (the tests compare the two).
"""
from __future__ import annotations

import numpy as np

from stage1_cpu import kernels, ops
from stage1_cpu.kv_cache import KVCache
from stage1_cpu.weights import LayerWeights, Weights


class Model:
    def __init__(self, weights: Weights, max_ctx: int, use_numba: bool = True, one_region: bool = True):
        self.w = weights
        self.config = cfg = weights.config
        self.max_ctx = max_ctx
        self.cache = KVCache(cfg, max_ctx)
        # the numba kernels by default; ops (the numpy definitions) for checking them
        self.k = kernels if use_numba else ops
        self.cos, self.sin = ops.rope_tables(max_ctx, cfg.head_dim, cfg.rope_theta,   # [T_max, D/2]
                                             cfg.rope_scaling)
        # the fast path (weights.fast, stage1_cpu/fast/) may run a dense model's decode step,
        # the same computation as forward() below, in one parallel region instead of one per matmul
        fast = weights.fast if use_numba and one_region else None
        self.decode_step = fast.make_decode_step(weights, self.cache, self.cos, self.sin) if fast else None

    def forward(self, tokens: np.ndarray, start_pos: int, all_logits: bool = False) -> np.ndarray:
        """tokens [T] at positions start_pos..start_pos+T-1 (the cache already holds
        0..start_pos-1) -> logits [V] of the last position, or [T, V] with all_logits."""
        cfg, w, K = self.config, self.w, self.k
        T = len(tokens)
        H, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        if start_pos + T > self.max_ctx:
            raise ValueError(f"positions up to {start_pos + T} exceed the cache ({self.max_ctx}); "
                             "raise --max-ctx")
        cos = self.cos[start_pos:start_pos + T]                # [T, D/2]
        sin = self.sin[start_pos:start_pos + T]

        # token embedding: dequantize only the T rows we need
        x = w.embed.rows(np.asarray(tokens, dtype=np.int64))  # [T, C]
        if T == 1 and self.decode_step and not all_logits:
            return self.decode_step.step(x[0], start_pos)      # [V]

        for layer, lw in enumerate(w.layers):
            # ---- attention block ----
            h = K.rmsnorm(x, lw.attn_norm, eps)                # [T, C]
            qkv = lw.wqkv.matmul(h)                            # [T, (H + 2 Hkv) D]: one matmul for q, k, v
            if lw.bqkv is not None:
                qkv = qkv + lw.bqkv                            # Qwen2: q, k and v have biases [(H + 2 Hkv) D]
            q = qkv[:, :H * D].reshape(T, H, D)                # [T, H, D]
            k = qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D)  # [T, Hkv, D]
            v = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D)      # [T, Hkv, D]
            if cfg.qk_norm:
                # Qwen3: RMSNorm over each head's D values, before RoPE, keeps q.k well scaled
                q = K.rmsnorm(q, lw.q_norm, eps)
                k = K.rmsnorm(k, lw.k_norm, eps)
            q = K.rope(q, cos, sin)                            # rotate each pair by its position's angle
            k = K.rope(k, cos, sin)
            self.cache.store(layer, start_pos, k, v)           # the new positions join the cache ...
            att = K.attention(q, self.cache.keys(layer),       # ... and every query attends over it
                              self.cache.values(layer), start_pos)   # [T, H, D]
            x = x + lw.wo.matmul(att.reshape(T, H * D))        # [T, C] residual

            # ---- MLP block ----
            h = K.rmsnorm(x, lw.mlp_norm, eps)                 # [T, C]
            if lw.experts:
                x = x + self.moe(h, lw)
            else:
                # SwiGLU: down(silu(gate(h)) * up(h)), gate and up from one matmul
                gate_up = lw.w_gate_up.matmul(h)               # [T, 2F] = [gate | up]
                x = x + lw.w_down.matmul(K.silu_mul(gate_up))  # [T, F] -> [T, C]

        # only the last position's logits are needed to pick the next token
        if not all_logits:
            x = x[-1:]                                         # [1, C]
        x = K.rmsnorm(x, w.final_norm, eps)
        logits = w.lm_head.matmul(x)                           # [T or 1, V]
        return logits if all_logits else logits[0]

    def moe(self, h: np.ndarray, lw: LayerWeights) -> np.ndarray:
        """Qwen3-MoE: each token goes to its top-k experts, weighted by the router.
        Qwen2-MoE adds a shared expert that every token goes through, scaled by a
        sigmoid gate of its own. h [T, C] -> [T, C]"""
        cfg = self.config
        T = h.shape[0]
        k = cfg.num_experts_per_tok
        # router in fp32: softmax over all experts, then keep the top k
        probs = ops.softmax(h @ lw.router.T)                   # [T, E]
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [T, k] expert ids
        weight = np.take_along_axis(probs, top, axis=-1)       # [T, k]
        if cfg.norm_topk_prob:
            weight = weight / weight.sum(axis=-1, keepdims=True)
        out = np.zeros_like(h)                                 # [T, C]
        if T == 1:
            # decode: the k chosen experts' rows of the stacked matrices, all k in one parallel
            # region per projection (2 instead of 2k), the same sums in the same order as below
            ids = np.unique(top[0])                            # [k] expert ids, sorted
            Fe2, C = lw.experts[0].e_gate_up.out_features, h.shape[1]
            gu = lw.experts_gate_up.matmul_segments(np.repeat(h, len(ids), axis=0), ids * Fe2, Fe2)  # [k, 2Fe]
            y = lw.experts_down.matmul_segments(self.k.silu_mul(gu), ids * C, C)                     # [k, C]
            for j, e in enumerate(ids):
                out[0] += weight[0, top[0] == e][0] * y[j]
        else:
            # group tokens by expert: each chosen expert's weights are read once per step
            for e in np.unique(top):
                rows, slot = np.nonzero(top == e)              # tokens routed to e, and which of their k
                ex = lw.experts[e]
                he = h[rows]                                   # [Te, C]
                y = ex.e_down.matmul(self.k.silu_mul(ex.e_gate_up.matmul(he)))  # [Te, 2Fe] -> [Te, C]
                out[rows] += weight[rows, slot][:, None] * y
        if lw.shared_expert is not None:
            # the shared expert: every token, weighted by sigmoid(h . shared_gate) in (0, 1)
            ex = lw.shared_expert
            y = ex.e_down.matmul(self.k.silu_mul(ex.e_gate_up.matmul(h)))   # [T, 2Fs] -> [T, C]
            gate = h @ lw.shared_gate.T                        # [T, 1], fp32 like the router
            out += y / (np.float32(1) + np.exp(-gate))
        return out
