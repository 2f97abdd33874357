"""The forward pass, top to bottom: a packed batch of token ids in, logits out.

Changed from stage 2: bf16 and fused kernels, and no allocation. Activations between
kernels are bf16; the residual stream stays fp32. q/k/v come out of one GEMM and
gate/up out of another; stage 2's residual_add is gone (each block's last GEMM adds
into the stream) and its rmsnorm is fused into the GEMM after it when the batch is
a decode batch of at most 4 rows (gemv.cu), so such a layer launches 7 kernels where
stage 2 launched 18. Every output goes into a buffer allocated once (buffers.py).

    residual = embed(tokens)                            [N, C] fp32
    for each layer:
        qkv = rmsnorm(residual) @ wqkv.T (+ bqkv)       [N, (H + 2 Hkv) D], one GEMM (qwen2: + biases)
        q = qk_norm_rope_store(qkv)                     q/k RMSNorm (qwen3), RoPE, k/v into their pages
        residual += attention(q) @ wo.T                 each query over its pages (GQA)
        gate_up = rmsnorm(residual) @ w_gate_up.T       MLP block
        residual += swiglu(gate_up) @ w_down.T          (or the routed experts of a MoE layer,
                                                         plus a gated shared expert: qwen2_moe)
    logits = rmsnorm(residual) @ lm_head.T              [S', V] float32, last position of each sequence

Weight names follow Hugging Face's (wqkv is q_proj, k_proj, v_proj stacked, ...);
the rename table is in common/loader.py and the fusing in weights.py.
"""
from __future__ import annotations

import numpy as np

from . import kernels, ops
from .batch import BatchInfo
from .buffers import Activations
from .kv_cache import KVCache
from .weights import LayerWeights, Weights


class Model:
    def __init__(self, weights: Weights, max_ctx: int, num_pages: int, page_size: int,
                 max_tokens: int, max_seqs: int):
        self.w = weights
        self.config = cfg = weights.config
        self.max_ctx = max_ctx
        self.xp = xp = weights.xp
        self.cache = KVCache(cfg, num_pages, page_size, xp)
        # every intermediate of a step of up to max_tokens tokens and max_seqs sequences
        self.buffers = Activations.allocate(xp, cfg, max_tokens, max_seqs, max_ctx)
        # CUDA kernels on cupy arrays, their numpy twins on numpy arrays
        self.k = kernels
        cos, sin = ops.rope_tables(max_ctx, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)   # [T_max, D/2]
        self.cos, self.sin = xp.asarray(cos), xp.asarray(sin)

    def forward(self, tokens, batch: BatchInfo, all_logits: bool = False):
        """tokens [N] of S sequences, packed as batch describes (its arrays on this model's
        device) -> logits [S', V] of the rows batch.logits_rows, or [N, V] with all_logits.
        The logits are a view of this model's buffer: the next step overwrites them."""
        cfg, w, K = self.config, self.w, self.k
        N = len(tokens)
        H, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        if batch.max_context > self.max_ctx:
            raise ValueError(f"positions up to {batch.max_context} exceed the context "
                             f"({self.max_ctx}); raise --max-ctx")
        b = self.buffers.take(N, len(batch.logits_rows))       # this step's views, no allocation

        # token embedding: one row per token starts the residual stream (fp32)
        residual = w.embed.rows(tokens, out=b.residual)        # [N, C] fp32

        for layer, lw in enumerate(w.layers):
            # ---- attention block ----
            # RMSNorm, then q, k and v from one GEMM (Qwen2: + their biases): for a decode batch
            # one gemv.cu launch that normalises the residual rows itself
            qkv = lw.wqkv.norm_matmul(residual, lw.attn_norm, eps, out=b.qkv, h=b.h, bias=lw.bqkv)
            # Qwen3's per-head q/k RMSNorm, RoPE at each token's own position, and the new
            # positions' k, v into their pages: one kernel, q comes back for attention
            q = K.qk_norm_rope_store(qkv, lw.q_norm, lw.k_norm, self.cos, self.sin, batch.positions,
                                     self.cache.keys(layer), self.cache.values(layer),
                                     batch.slot_mapping, H, Hkv, eps, out=b.q)   # [N, H, D] bf16
            att = self.attention(q, layer, batch, b)           # every query attends over its pages
            lw.wo.matmul_add(att.reshape(N, H * D), residual)  # residual += att @ wo.T (fp32)

            # ---- MLP block ----
            if lw.experts:
                residual += self.moe(K.rmsnorm(residual, lw.mlp_norm, eps, out=b.h), lw)
            else:
                # SwiGLU: residual += down(silu(gate(h)) * up(h)), gate and up from one GEMM
                gate_up = lw.w_gate_up.norm_matmul(residual, lw.mlp_norm, eps, out=b.gate_up, h=b.h)
                lw.w_down.swiglu_matmul_add(gate_up, residual, act=b.act)   # [N, C] fp32

        # only the last position of each sequence that samples needs logits
        logits_out = b.logits
        if all_logits:
            logits_out = None                                  # [N, V]: allocated (a prefill check)
        elif len(batch.logits_rows) < N:
            residual = residual[batch.logits_rows]             # [S', C] a gather (prefill steps)
        return w.lm_head.norm_matmul(residual, w.final_norm, eps, out=logits_out, h=b.h[:len(residual)],
                                     out_f32=True)             # [N or S', V] float32

    def attention(self, q, layer: int, batch: BatchInfo, b: Activations):
        """Each query over its own sequence's pages. q [N, H, D] -> [N, H, D] (b.att).
        The batch starts with num_decode sequences of one query each (decode kernel:
        the whole context is visible), then the prefill chunks (causal within the chunk,
        earlier chunks read from the pages like any other position)."""
        K, d = self.k, batch.num_decode
        keys, values = self.cache.keys(layer), self.cache.values(layer)
        att = b.att                                            # [N, H, D] bf16
        if d:
            K.paged_decode_attention(q[:d], keys, values, batch.block_tables[:d], batch.context_lens[:d],
                                     max_len=batch.max_context, out=att[:d], scratch=b.attn_scratch)
        if d < q.shape[0]:
            K.prefill_attention(q[d:], keys, values, batch.block_tables, batch.token_seq[d:],
                                batch.positions[d:], batch.tile_start, batch.tile_count, out=att[d:])
        return att

    def moe(self, h, lw: LayerWeights):
        """Qwen3-MoE: each token goes to its top-k experts, weighted by the router.
        Qwen2-MoE adds a shared expert that every token goes through, scaled by a
        sigmoid gate of its own (its width may differ from the routed experts').
        h [N, C] bf16 -> [N, C] float32, added into the residual by the caller. The routing
        decision is made on the host (a small [N, E] copy); the experts' matmuls run on the
        device, one GEMM per chosen expert (this path allocates: a MoE step is never a graph)."""
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
        return out                                             # [T, C] fp32, like a dense MLP's sums
