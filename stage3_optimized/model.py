"""The forward pass, top to bottom: a packed batch of token ids in, logits out.

As in stage 2, `tokens` packs the new tokens of S sequences into one array of N, a
BatchInfo says where each one belongs, every matmul sees all N tokens at once and only
attention knows about sequences.

Changed from stage 2, lesson by lesson (docs/lessons/stage3):
  * q, k and v from one GEMM, then one kernel: the q/k norm, RoPE and the K/V store.
  * gate and up from one GEMM, which swiglu reads in place.
  * The norm writes bf16, the GEMM's input.
  * So do attention and swiglu; the residual stream stays fp32.
  * Every activation between kernels is bf16.
  * Decode attention is sized by BatchInfo.max_context, a host int: no copy back.
  * Prefill attention gets the batch's 16-token tiles (tensor cores).
  * Every output, the logits too, goes into a buffer allocated once (buffers.py).
  * qk_norm_rope_store reads each token's cos/sin row itself: no gather.
  * Each block's last GEMM adds into the stream (`add_into=`): no residual_add.
  * A decode batch of at most 4 rows: one gemv.cu launch per projection, the norm or SwiGLU
    in front, the add behind (7 launches a layer where stage 2 launched 18).

    x = embed(tokens)                                   [N, C]
    for each layer:
        qkv = rmsnorm(x) @ wqkv.T                       [N, (H + 2 Hkv) D], one GEMM (+ bqkv: qwen2)
        q = qk_norm_rope_store(qkv)                     q/k RMSNorm (qwen3), RoPE, k/v into pages
        attend causally over each sequence's pages (GQA)
        x = x + attn @ wo.T
        gate_up = rmsnorm(x) @ w_gate_up.T              MLP block
        x = x + swiglu(gate_up) @ w_down.T              (or the routed experts of a MoE layer,
                                                         plus a gated shared expert: qwen2_moe)
    logits = rmsnorm(x) @ lm_head.T                     [S', V] for each sequence's last position

Weight names follow Hugging Face's (wqkv is q_proj, k_proj, v_proj stacked, ...); the
rename table is in common/loader.py and the fusing in weights.py.
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
        self.kernels = kernels
        # [T_max, D/2]
        cos, sin = ops.rope_tables(max_ctx, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.cos, self.sin = xp.asarray(cos), xp.asarray(sin)
        # what each layer's q/k norm, RoPE and KV store need, besides the step's rows
        self.heads = [ops.LayerHeads(lw.q_norm, lw.k_norm, self.cos, self.sin, self.cache.keys(i),
                                     self.cache.values(i), cfg.num_heads, cfg.num_kv_heads,
                                     cfg.rms_norm_eps)
                      for i, lw in enumerate(weights.layers)]

    def forward(self, tokens, batch: BatchInfo, all_logits: bool = False):
        """tokens [N] of S sequences, packed as batch describes (its arrays on this model's
        device) -> logits [S', V] of the rows batch.logits_rows, or [N, V] with all_logits.
        The logits are a view of this model's buffer: the next step overwrites them."""
        cfg, w, kern = self.config, self.w, self.kernels
        N = len(tokens)
        H, D, eps = cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
        if batch.max_context > self.max_ctx:
            raise ValueError(f"positions up to {batch.max_context} exceed the context "
                             f"({self.max_ctx}); raise --max-ctx")
        b = self.buffers.take(N, len(batch.logits_rows))       # this step's views, no allocation

        # token embedding: one row per token (the embedding gather kernel)
        x = w.embed.rows(tokens, out=b.x)                      # [N, C]

        for layer, lw in enumerate(w.layers):
            # ---- attention block ----
            # q, k and v from one GEMM on rmsnorm(x) (Qwen2: + their biases); for a decode
            # batch one gemv.cu launch that normalises the rows itself
            qkv = lw.wqkv.norm_matmul(x, lw.attn_norm, eps, h=b.h, bias=lw.bqkv, out=b.qkv)
            # Qwen3's per-head q/k RMSNorm, RoPE at each token's own position, and the new
            # positions' k, v into their pages: one kernel, q comes back for attention
            q = kern.qk_norm_rope_store(qkv, self.heads[layer], batch.positions, batch.slot_mapping,
                                        out=b.q)                  # [N, H, D] bf16
            # ... and every query attends over its pages
            att = self.attention(q, layer, batch, out=b.att)
            x = lw.wo.matmul(att.reshape(N, H * D), add_into=x)   # x + att @ wo.T, in the GEMM

            # ---- MLP block ----
            if lw.experts:
                x = self.moe(kern.rmsnorm(x, lw.mlp_norm, eps, out=b.h), lw, add_into=x)
            else:
                # SwiGLU: x + down(silu(gate(h)) * up(h)), gate and up from one GEMM on rmsnorm(x)
                gate_up = lw.w_gate_up.norm_matmul(x, lw.mlp_norm, eps, h=b.h, out=b.gate_up)
                x = lw.w_down.swiglu_matmul(gate_up, add_into=x, act=b.act)   # [N, C] fp32

        # only the last position of each sequence that samples needs logits (a decode step
        # samples every row: nothing to gather)
        if not all_logits and len(batch.logits_rows) < N:
            x = x[batch.logits_rows]                           # [S', C]
        logits = w.lm_head.norm_matmul(x, w.final_norm, eps, h=b.h[:len(x)], out_f32=True,
                                       out=None if all_logits else b.logits)
        return logits                                          # [N or S', V] float32

    def attention(self, q, layer: int, batch: BatchInfo, out):
        """Each query over its own sequence's pages. q [N, H, D] -> out [N, H, D] bf16.
        The batch starts with num_decode sequences of one query each (decode kernel:
        the whole context is visible), then the prefill chunks (causal within the chunk,
        earlier chunks read from the pages like any other position). Each kernel writes
        its rows of out."""
        kern, d = self.kernels, batch.num_decode
        keys, values = self.cache.keys(layer), self.cache.values(layer)
        if d:
            kern.paged_decode_attention(q[:d], keys, values, batch.block_tables[:d],
                                        batch.context_lens[:d], max_len=batch.max_context,
                                        out=out[:d], scratch=self.buffers.attn_scratch)
        if d < q.shape[0]:
            kern.prefill_attention(q[d:], keys, values, batch.block_tables, batch.token_seq[d:],
                                   batch.positions[d:], batch.tile_start, batch.tile_count,
                                   out=out[d:])
        return out

    def moe(self, h, lw: LayerWeights, add_into):
        """Qwen3-MoE: each token goes to its top-k experts, weighted by the router.
        Qwen2-MoE adds a shared expert that every token goes through, scaled by a
        sigmoid gate of its own.
        h [N, C] bf16 -> the experts' weighted sum [N, C] float32, added into add_into (the
        residual stream), which is returned. The routing decision is made on the host (a
        small [N, E] copy); the experts' matmuls run on the device, one GEMM per chosen expert
        (this path allocates: a MoE step is never a graph)."""
        cfg, xp, kern = self.config, self.xp, self.kernels
        # router in fp32: softmax over all experts, then keep the top k (on the host)
        top, weight = kern.route(lw.router.matmul(h, out_f32=True), cfg.num_experts_per_tok,
                                 cfg.norm_topk_prob)           # [T, k] each
        out = add_into                                         # [T, C] fp32: the stream itself
        # group tokens by expert: each chosen expert's weights are read once per step
        for e in np.unique(top):
            # tokens routed to e, and which of their k
            rows, slot = np.nonzero(top == e)
            ex = lw.experts[e]
            he = h[xp.asarray(rows)]                           # [Te, C]
            y = ex.e_down.matmul(kern.swiglu(ex.e_gate_up.matmul(he)), out_f32=True)     # [Te, C]
            out[xp.asarray(rows)] += xp.asarray(weight[rows, slot][:, None]) * y
        if lw.shared_expert is not None:
            # the shared expert: every token, weighted by sigmoid(h . shared_gate) in (0, 1)
            ex = lw.shared_expert
            # [T, C] fp32
            y = ex.e_down.matmul(kern.swiglu(ex.e_gate_up.matmul(h)), out_f32=True)
            gate = lw.shared_gate.matmul(h, out_f32=True)      # [T, 1] fp32
            out += y / (1 + xp.exp(-gate))
        return out
