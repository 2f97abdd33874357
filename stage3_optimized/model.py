"""The forward pass, top to bottom: a packed batch of token ids in, logits out.

Changed from stage 2: bf16 and fused kernels. Activations between kernels are
bf16 (the residual stream stays fp32); q/k/v come out of one GEMM and gate/up out
of another; the kernels that stage 2 ran back to back on the same rows are fused,
so a decode layer launches 10 kernels and GEMMs where stage 2 launched 18:

    x = embed(tokens)                                   [N, C] bf16
    residual = None
    for each layer:
        h, residual = add_rmsnorm(x, residual)          fused residual add + RMSNorm (fp32 residual)
        qkv = h @ wqkv.T (+ bqkv)                       [N, (H + 2 Hkv) D], one GEMM (qwen2: + biases)
        q = qk_norm_rope_store(qkv)                     q/k RMSNorm (qwen3), RoPE, k/v into their pages
        x = attention(q) @ wo.T                         each query over its pages (GQA)
        h, residual = add_rmsnorm(x, residual)          MLP block
        x = down(swiglu(h @ w_gate_up.T))               (or the routed experts of a MoE layer,
                                                         plus a gated shared expert: qwen2_moe)
    h = add_rmsnorm(x, residual) (final norm)
    logits = h @ lm_head.T                              [S', V] float32, last position of each sequence

Weight names follow Hugging Face's (wqkv is q_proj, k_proj, v_proj stacked, ...);
the rename table is in common/loader.py and the fusing in weights.py.
"""
from __future__ import annotations

import numpy as np

from . import kernels, ops
from .batch import BatchInfo
from .kv_cache import KVCache
from .weights import LayerWeights, Weights


class Model:
    def __init__(self, weights: Weights, max_ctx: int, num_pages: int, page_size: int):
        self.w = weights
        self.config = cfg = weights.config
        self.max_ctx = max_ctx
        self.xp = xp = weights.xp
        self.cache = KVCache(cfg, num_pages, page_size, xp)
        # CUDA kernels on cupy arrays, their numpy twins on numpy arrays
        self.k = kernels
        cos, sin = ops.rope_tables(max_ctx, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)   # [T_max, D/2]
        self.cos, self.sin = xp.asarray(cos), xp.asarray(sin)

    def forward(self, tokens, batch: BatchInfo, all_logits: bool = False):
        """tokens [N] of S sequences, packed as batch describes (its arrays on this model's
        device) -> logits [S', V] of the rows batch.logits_rows, or [N, V] with all_logits."""
        cfg, w, K = self.config, self.w, self.k
        N = len(tokens)
        H, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        if batch.max_context > self.max_ctx:
            raise ValueError(f"positions up to {batch.max_context} exceed the context "
                             f"({self.max_ctx}); raise --max-ctx")
        # each token rotates by its own position: gather one table row per token
        cos = self.cos[batch.positions]                        # [N, D/2]
        sin = self.sin[batch.positions]

        # token embedding: one row per token (the bf16 embedding gather kernel)
        x = w.embed.rows(tokens)                               # [N, C] bf16
        residual = None                                        # the fp32 stream, from the first add_rmsnorm

        for layer, lw in enumerate(w.layers):
            # ---- attention block ----
            h, residual = K.add_rmsnorm(x, residual, lw.attn_norm, eps)   # [N, C] bf16, [N, C] fp32
            if lw.bqkv is None:
                qkv = lw.wqkv.matmul(h)                        # [N, (H + 2 Hkv) * D] one GEMM for q, k, v
            else:
                # Qwen2: q, k and v have biases, added to the GEMM's fp32 output before its
                # one bf16 rounding (a broadcast add, then the rounding kernel)
                qkv = K.to_bf16(lw.wqkv.matmul(h, out_f32=True) + lw.bqkv)   # [N, (H + 2 Hkv) * D]
            # Qwen3's per-head q/k RMSNorm, RoPE at each token's own position, and the new
            # positions' k, v into their pages: one kernel, q comes back for attention
            q = K.qk_norm_rope_store(qkv, lw.q_norm, lw.k_norm, cos, sin,
                                     self.cache.keys(layer), self.cache.values(layer),
                                     batch.slot_mapping, H, Hkv, eps)        # [N, H, D] bf16
            att = self.attention(q, layer, batch)              # every query attends over its pages
            x = lw.wo.matmul(att.reshape(N, H * D))            # [N, C] bf16, added by the next add_rmsnorm

            # ---- MLP block ----
            h, residual = K.add_rmsnorm(x, residual, lw.mlp_norm, eps)    # [N, C]
            if lw.experts:
                x = self.moe(h, lw)
            else:
                # SwiGLU: down(silu(gate(h)) * up(h)), gate and up from one GEMM
                x = lw.w_down.matmul(K.swiglu(lw.w_gate_up.matmul(h)))   # [N, C] bf16

        # only the last position of each sequence that samples needs logits
        if not all_logits:
            x, residual = x[batch.logits_rows], residual[batch.logits_rows]   # [S', C]
        h, _ = K.add_rmsnorm(x, residual, w.final_norm, eps)
        logits = w.lm_head.matmul(h, out_f32=True)             # [N or S', V] float32
        return logits

    def attention(self, q, layer: int, batch: BatchInfo):
        """Each query over its own sequence's pages. q [N, H, D] -> [N, H, D].
        The batch starts with num_decode sequences of one query each (decode kernel:
        the whole context is visible), then the prefill chunks (causal within the chunk,
        earlier chunks read from the pages like any other position)."""
        K, d = self.k, batch.num_decode
        keys, values = self.cache.keys(layer), self.cache.values(layer)
        att = self.xp.empty_like(q)                            # [N, H, D] bf16
        if d:
            att[:d] = K.paged_decode_attention(q[:d], keys, values,
                                               batch.block_tables[:d], batch.context_lens[:d],
                                               max_len=batch.max_context)
        if d < q.shape[0]:
            att[d:] = K.prefill_attention(q[d:], keys, values, batch.block_tables,
                                          batch.token_seq[d:], batch.positions[d:],
                                          batch.tile_start, batch.tile_count)
        return att

    def moe(self, h, lw: LayerWeights):
        """Qwen3-MoE: each token goes to its top-k experts, weighted by the router.
        Qwen2-MoE adds a shared expert that every token goes through, scaled by a
        sigmoid gate of its own (its width may differ from the routed experts').
        h [N, C] bf16 -> [N, C] bf16. The routing decision is made on the host (a small [N, E]
        copy); the experts' matmuls run on the device, one GEMM per chosen expert."""
        cfg, xp = self.config, self.xp
        T = h.shape[0]
        k = cfg.num_experts_per_tok
        # router in fp32: softmax over all experts, then keep the top k
        probs = ops.softmax(kernels.to_host(lw.router.matmul(h, out_f32=True)))   # [T, E]
        top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # [T, k] expert ids
        weight = np.take_along_axis(probs, top, axis=-1)       # [T, k]
        if cfg.norm_topk_prob:
            weight = weight / weight.sum(axis=-1, keepdims=True)
        out = xp.zeros(h.shape, dtype=np.float32)              # [T, C] fp32 sum of the experts
        # group tokens by expert: each chosen expert's weights are read once per step
        for e in np.unique(top):
            rows, slot = np.nonzero(top == e)                  # tokens routed to e, and which of their k
            ex = lw.experts[e]
            he = h[xp.asarray(rows)]                           # [Te, C] bf16
            y = ex.e_down.matmul(self.k.swiglu(ex.e_gate_up.matmul(he)), out_f32=True)   # [Te, C]
            out[xp.asarray(rows)] += xp.asarray(weight[rows, slot][:, None].astype(np.float32)) * y
        if lw.shared_expert is not None:
            # the shared expert: every token, weighted by sigmoid(h . shared_gate) in (0, 1)
            ex = lw.shared_expert
            y = ex.e_down.matmul(self.k.swiglu(ex.e_gate_up.matmul(h)), out_f32=True)   # [T, C] fp32
            gate = lw.shared_gate.matmul(h, out_f32=True)      # [T, 1] fp32
            out += y / (1 + xp.exp(-gate))
        return kernels.to_bf16(out)                            # [T, C] bf16, like a dense MLP's output
