"""The forward pass, top to bottom: a packed batch of token ids in, logits out.

Changed from stage 1: many sequences at once and a paged cache. `tokens` packs
the new tokens of S sequences (decode tokens and prefill chunks) into one array
of N, and a BatchInfo says where each one belongs: its position (RoPE, causality),
its slot in the page pool (where its K/V go), and per sequence the block table
and context length (where its K/V are read from). Every matmul sees all N tokens
at once (one GEMM per weight per step, whoever they belong to); only attention
needs to know about sequences. Each kern.op runs a CUDA kernel on cupy arrays and
its numpy twin on numpy arrays.

    x = embed(tokens)                                   [N, C]
    for each layer:
        h = rmsnorm(x)                                  attention block
        q, k, v = h @ wq.T, h @ wk.T, h @ wv.T          (+ bq, bk, bv: qwen2, qwen2_moe)
        q, k = rmsnorm per head (qwen3), then RoPE at each token's own position
        store k, v in their pages; attend causally over each sequence's pages (GQA)
        x = x + attn @ wo.T
        h = rmsnorm(x)                                  MLP block
        x = x + down(silu(gate(h)) * up(h))             (or the routed experts of a MoE layer,
                                                         plus a gated shared expert: qwen2_moe)
    logits = rmsnorm(x) @ lm_head.T                     [S', V] for each sequence's last position

Every kernel and GEMM of the layer loop writes into a buffer of the step's Scratch
(`out=b.h`, ...), kept from step to step, instead of a new array per op.

Weight names follow Hugging Face's (wq is q_proj, ...); the rename table is in
common/loader.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from . import kernels, ops
from .batch import BatchInfo
from .kv_cache import KVCache
from .weights import LayerWeights, Weights


class Scratch:
    """The buffers the layer loop writes its intermediates into, kept from step to step.

    A kernel or GEMM that allocates its own output costs the host a `cupy.empty` on every
    call (2.3 us on an H200, bench/host_costs.json), 18 times per layer. Here each output
    has a named buffer [rows, *width] (the residual stream, h, q, ...), rows the most
    tokens any step has had so far: a bigger step replaces it once, a smaller one uses
    its first rows. take(N) makes those views once per batch size, so a run of decode
    steps of the same batch reuses the same arrays and allocates nothing.

    A buffer holds one value at a time, overwritten by the next layer's: two values alive
    at once get two names, and so does a kernel's output and its input (the .cu files
    declare their pointers __restrict__). The logits are not in here: they outlive the
    step (the caller samples from them), so lm_head's GEMM makes a new array."""

    def __init__(self, xp, widths: dict[str, tuple[int, ...]]):
        self.xp, self.widths = xp, widths          # name -> one token's row shape
        self.memory = {}                           # name -> [rows, *width] float32
        self.n, self.views = None, None

    def take(self, n: int) -> SimpleNamespace:
        """The buffers of a step of n tokens: b.h [n, C], b.q [n, H*D], ..."""
        if n != self.n:
            for name, width in self.widths.items():
                if name not in self.memory or len(self.memory[name]) < n:
                    self.memory[name] = self.xp.empty((n, *width), np.float32)
            self.n = n
            self.views = SimpleNamespace(**{name: m[:n] for name, m in self.memory.items()})
        return self.views


def scratch_widths(cfg) -> dict[str, tuple[int, ...]]:
    """One token's row of each buffer the layer loop writes, by the name model.py uses."""
    H, Hkv, D, C = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    # the residual stream entering a layer; after its attention add
    widths = dict(x=(C,), x_mid=(C,),
                  # a block's normed input; what it adds to the stream
                  h=(C,), y=(C,),
                  q=(H * D,), k=(Hkv * D,), v=(Hkv * D,),            # the projections
                  q_normed=(H, D), k_normed=(Hkv, D), q_rot=(H, D), k_rot=(Hkv, D), att=(H, D))
    if not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        F = cfg.intermediate_size                  # a dense MLP's gate, up and silu(gate) * up
        widths.update(gate=(F,), up=(F,), act=(F,))
    return widths


class Model:
    def __init__(self, weights: Weights, max_ctx: int, num_pages: int, page_size: int):
        self.w = weights
        self.config = cfg = weights.config
        self.max_ctx = max_ctx
        self.xp = xp = weights.xp
        self.cache = KVCache(cfg, num_pages, page_size, xp)
        self.scratch = Scratch(xp, scratch_widths(cfg))
        # CUDA kernels on cupy arrays, their numpy twins on numpy arrays
        self.kernels = kernels
        # [T_max, D/2]
        cos, sin = ops.rope_tables(max_ctx, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.cos, self.sin = xp.asarray(cos), xp.asarray(sin)

    def forward(self, tokens, batch: BatchInfo, all_logits: bool = False):
        """tokens [N] of S sequences, packed as batch describes (its arrays on this model's
        device) -> logits [S', V] of the rows batch.logits_rows, or [N, V] with all_logits."""
        cfg, w, kern = self.config, self.w, self.kernels
        N = len(tokens)
        H, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        if int(batch.context_lens.max()) > self.max_ctx:
            raise ValueError(f"positions up to {int(batch.context_lens.max())} exceed the context "
                             f"({self.max_ctx}); raise --max-ctx")
        # each token rotates by its own position: gather one table row per token
        cos = self.cos[batch.positions]                        # [N, D/2]
        sin = self.sin[batch.positions]
        b = self.scratch.take(N)                               # this step's buffers, [N, ...] each

        # token embedding: one row per token (the embedding gather kernel)
        x = w.embed.rows(tokens, out=b.x)                      # [N, C]

        for layer, lw in enumerate(w.layers):
            # ---- attention block ----
            h = kern.rmsnorm(x, lw.attn_norm, eps, out=b.h)    # [N, C]
            q, k, v = lw.wq.matmul(h, out=b.q), lw.wk.matmul(h, out=b.k), lw.wv.matmul(h, out=b.v)
            if lw.bq is not None:
                # Qwen2: q, k and v have biases (one broadcast add each, cupy's own elementwise
                # kernel, in place: the buffer already holds q)
                q += lw.bq
                k += lw.bk
                v += lw.bv
            q = q.reshape(N, H, D)                             # [N, H, D]
            k = k.reshape(N, Hkv, D)                           # [N, Hkv, D]
            v = v.reshape(N, Hkv, D)                           # [N, Hkv, D]
            if cfg.qk_norm:
                # Qwen3: RMSNorm over each head's D values, before RoPE, keeps q.k well scaled
                q = kern.rmsnorm(q, lw.q_norm, eps, out=b.q_normed)
                k = kern.rmsnorm(k, lw.k_norm, eps, out=b.k_normed)
            # rotate each pair by its position's angle
            q = kern.rope(q, cos, sin, out=b.q_rot)
            k = kern.rope(k, cos, sin, out=b.k_rot)
            # the new positions join their pages ...
            self.cache.store(layer, k, v, batch.slot_mapping)
            # ... and every query attends over its pages
            att = self.attention(q, layer, batch, out=b.att)
            # [N, C] residual
            x = kern.residual_add(x, lw.wo.matmul(att.reshape(N, H * D), out=b.y), out=b.x_mid)

            # ---- MLP block ----
            h = kern.rmsnorm(x, lw.mlp_norm, eps, out=b.h)     # [N, C]
            if lw.experts:
                x = kern.residual_add(x, self.moe(h, lw), out=b.x)
            else:
                # SwiGLU: down(silu(gate(h)) * up(h))
                act = kern.silu_mul(lw.w_gate.matmul(h, out=b.gate),
                                    lw.w_up.matmul(h, out=b.up), out=b.act)
                x = kern.residual_add(x, lw.w_down.matmul(act, out=b.y), out=b.x)

        # only the last position of each sequence that samples needs logits (a decode step
        # samples every row: nothing to gather)
        if not all_logits and len(batch.logits_rows) < N:
            x = x[batch.logits_rows]                           # [S', C]
        x = kern.rmsnorm(x, w.final_norm, eps, out=b.h[:len(x)])
        # [N or S', V] a new array: it outlives the step
        logits = w.lm_head.matmul(x)
        return logits

    def attention(self, q, layer: int, batch: BatchInfo, out):
        """Each query over its own sequence's pages. q [N, H, D] -> out [N, H, D].
        The batch starts with num_decode sequences of one query each (decode kernel:
        the whole context is visible), then the prefill chunks (causal within the chunk,
        earlier chunks read from the pages like any other position). Each kernel writes
        its rows of out."""
        kern, d = self.kernels, batch.num_decode
        keys, values = self.cache.keys(layer), self.cache.values(layer)
        if d:
            kern.paged_decode_attention(q[:d], keys, values, batch.block_tables[:d],
                                        batch.context_lens[:d], out=out[:d])
        if d < q.shape[0]:
            kern.prefill_attention(q[d:], keys, values, batch.block_tables, batch.token_seq[d:],
                                   batch.positions[d:], out=out[d:])
        return out

    def moe(self, h, lw: LayerWeights):
        """Qwen3-MoE: each token goes to its top-k experts, weighted by the router.
        Qwen2-MoE adds a shared expert that every token goes through, scaled by a
        sigmoid gate of its own.
        h [N, C] -> [N, C]. The routing decision is made on the host (a small [N, E]
        copy); the experts' matmuls run on the device, one GEMM per chosen expert."""
        cfg, xp, kern = self.config, self.xp, self.kernels
        # router in fp32: softmax over all experts, then keep the top k (on the host)
        top, weight = kern.route(lw.router.matmul(h), cfg.num_experts_per_tok,
                                 cfg.norm_topk_prob)           # [T, k] each
        out = xp.zeros_like(h)                                 # [T, C]
        # group tokens by expert: each chosen expert's weights are read once per step
        for e in np.unique(top):
            # tokens routed to e, and which of their k
            rows, slot = np.nonzero(top == e)
            ex = lw.experts[e]
            he = h[xp.asarray(rows)]                           # [Te, C]
            # [Te, C]
            y = ex.e_down.matmul(kern.silu_mul(ex.e_gate.matmul(he), ex.e_up.matmul(he)))
            out[xp.asarray(rows)] += xp.asarray(weight[rows, slot][:, None]) * y
        if lw.shared_expert is not None:
            # the shared expert: every token, weighted by sigmoid(h . shared_gate) in (0, 1)
            ex = lw.shared_expert
            y = ex.e_down.matmul(kern.silu_mul(ex.e_gate.matmul(h), ex.e_up.matmul(h)))     # [T, C]
            gate = lw.shared_gate.matmul(h)                    # [T, 1]
            out += y / (1 + xp.exp(-gate))
        return out
