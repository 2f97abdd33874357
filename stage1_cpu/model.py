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

The pass is written down once, as data: plan() turns the weights into a list of
phases (norm, matmul, attention, add, ...), each reading and writing buffers by
name. Model.forward() runs that list op by op, one numba kernel per phase (each
matmul is a parallel region of its own); the fast path's decode step
(stage1_cpu/fast/decode_step.py) runs the same list for one token inside a
single parallel region. Two drivers, one description: what the model computes
can only change here, for both.

Weight names follow Hugging Face's (wq is q_proj, ...); the rename table is in
common/loader.py. Each matmul is a quant.Weight, so the same code runs fp32,
bf16, int8 and int4 weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import kernels, ops
from .kv_cache import KVCache
from .quant import Weight
from .weights import Weights


@dataclass(frozen=True, eq=False)
class Phase:
    """One step of the forward pass: dst = op(src, ...), buffers by name ([T, ...] each)."""
    op: str                         # see Model.run() for what each op does
    src: str                        # the buffer it reads
    dst: str                        # the buffer it writes (add / gated_add: adds to)
    weight: Weight | None = None    # matmul, experts: the matrix
    vec: np.ndarray | None = None   # norm: its weight [C]; matmul: a bias [O] or None
    aux: str | None = None          # a second input: route (experts, mix), the gate (gated_add)
    layer: int = -1                 # attention: whose cache and q/k norms


def plan(w: Weights) -> list[Phase]:
    """The forward pass as the list of phases both drivers run, in order."""
    P = []
    for i, lw in enumerate(w.layers):
        # ---- attention block ----
        P += [Phase("norm", "x", "h", vec=lw.attn_norm),
              Phase("matmul", "h", "qkv", lw.wqkv, vec=lw.bqkv),    # q, k, v in one matmul (+ qwen2's biases)
              Phase("attention", "qkv", "att", layer=i),            # q/k norm (qwen3), RoPE, cache, attend
              Phase("matmul", "att", "o", lw.wo),
              Phase("add", "o", "x"),                                # the residual
              # ---- MLP block ----
              Phase("norm", "x", "h", vec=lw.mlp_norm)]
        if not lw.experts:                                           # SwiGLU: down(silu(gate(h)) * up(h))
            P += [Phase("matmul", "h", "gu", lw.w_gate_up),          # [gate | up] in one matmul
                  Phase("silu_mul", "gu", "act"),
                  Phase("matmul", "act", "down", lw.w_down),
                  Phase("add", "down", "x")]
            continue
        # MoE: the router picks k experts per token; each is a SwiGLU MLP of its own
        P += [Phase("matmul", "h", "router", lw.router),             # [E] logits, fp32
              Phase("route", "router", "route"),                     # the k experts and their weights
              Phase("experts", "h", "egu", lw.experts_gate_up, aux="route"),   # [k, 2Fe] each its own rows
              Phase("silu_mul", "egu", "eact"),
              Phase("experts", "eact", "ey", lw.experts_down, aux="route"),    # [k, C]
              Phase("mix", "ey", "moe", aux="route")]                # moe = sum_j weight_j ey_j
        if lw.shared_expert is not None:                             # qwen2_moe: every token, gated
            P += [Phase("matmul", "h", "sgu", lw.shared_expert.e_gate_up),
                  Phase("silu_mul", "sgu", "sact"),
                  Phase("matmul", "sact", "sy", lw.shared_expert.e_down),
                  Phase("matmul", "h", "sgate", lw.shared_gate),     # [1], fp32 like the router
                  Phase("gated_add", "sy", "moe", aux="sgate")]      # moe += sigmoid(sgate) * sy
        P += [Phase("add", "moe", "x")]
    return P + [Phase("last", "x", "x"),                             # only the last position's logits
                Phase("norm", "x", "h", vec=w.final_norm),
                Phase("matmul", "h", "logits", w.lm_head)]


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
        self.phases = plan(weights)
        # the fast path (weights.fast, stage1_cpu/fast/) runs one token's phases in one parallel
        # region instead of one per matmul; one_region=False keeps them here (the tests compare)
        fast = weights.fast if use_numba and one_region else None
        self.decode_step = fast.make_decode_step(self, self.phases) if fast else None

    def forward(self, tokens: np.ndarray, start_pos: int, all_logits: bool = False) -> np.ndarray:
        """tokens [T] at positions start_pos..start_pos+T-1 (the cache already holds
        0..start_pos-1) -> logits [V] of the last position, or [T, V] with all_logits."""
        T = len(tokens)
        if start_pos + T > self.max_ctx:
            raise ValueError(f"positions up to {start_pos + T} exceed the cache ({self.max_ctx}); "
                             "raise --max-ctx")
        # token embedding: dequantize only the T rows we need
        x = self.w.embed.rows(np.asarray(tokens, dtype=np.int64))   # [T, C]
        if T == 1 and self.decode_step and not all_logits:
            return self.decode_step.step(x[0], start_pos)           # [V]
        buf = {"x": x}                                              # the buffers, by name
        for ph in self.phases:
            if ph.op != "last" or not all_logits:
                self.run(ph, buf, start_pos)
        logits = buf["logits"]                                      # [T or 1, V]
        return logits if all_logits else logits[0]

    def run(self, ph: Phase, buf: dict, start_pos: int) -> None:
        """One phase for all T tokens, by the per-op kernels (self.k)."""
        K, eps, src = self.k, self.config.rms_norm_eps, buf[ph.src]
        if ph.op == "norm":                         # [T, C] -> [T, C]
            buf[ph.dst] = K.rmsnorm(src, ph.vec, eps)
        elif ph.op == "matmul":                     # [T, in] -> [T, out]
            y = ph.weight.matmul(src)
            buf[ph.dst] = y if ph.vec is None else y + ph.vec
        elif ph.op == "attention":                  # [T, (H + 2 Hkv) D] -> [T, H D]
            buf[ph.dst] = self.attention(src, ph.layer, start_pos)
        elif ph.op == "add":                        # dst += src, [T, C]
            buf[ph.dst] = buf[ph.dst] + src
        elif ph.op == "silu_mul":                   # [T, 2F] -> [T, F]
            buf[ph.dst] = K.silu_mul(src)
        elif ph.op == "route":                      # [T, E] -> top [T, k], weight [T, k]
            buf[ph.dst] = K.route(src, self.config.num_experts_per_tok, self.config.norm_topk_prob)
        elif ph.op == "experts":                    # [T, in] or [T k, in] -> [T k, out]
            buf[ph.dst] = self.experts(ph.weight, src, buf[ph.aux][0])
        elif ph.op == "mix":                        # [T k, C] -> [T, C]
            buf[ph.dst] = K.mix(src, buf[ph.aux][1])
        elif ph.op == "gated_add":                  # dst += sigmoid(gate) src, [T, C]
            buf[ph.dst] = K.gated_add(buf[ph.dst], src, buf[ph.aux])
        elif ph.op == "last":                       # [T, C] -> [1, C]
            buf[ph.dst] = src[-1:]
        else:
            raise ValueError(f"unknown phase {ph.op!r}")

    def attention(self, qkv: np.ndarray, layer: int, start_pos: int) -> np.ndarray:
        """qkv [T, (H + 2 Hkv) D] -> [T, H D]: the new positions' k, v join the cache,
        and every query attends over it."""
        cfg, K, lw = self.config, self.k, self.w.layers[layer]
        T = qkv.shape[0]
        H, Hkv, D, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        q = qkv[:, :H * D].reshape(T, H, D)                    # [T, H, D]
        k = qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D)     # [T, Hkv, D]
        v = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D)          # [T, Hkv, D]
        if cfg.qk_norm:
            # Qwen3: RMSNorm over each head's D values, before RoPE, keeps q.k well scaled
            q = K.rmsnorm(q, lw.q_norm, eps)
            k = K.rmsnorm(k, lw.k_norm, eps)
        cos = self.cos[start_pos:start_pos + T]                # [T, D/2]
        sin = self.sin[start_pos:start_pos + T]
        q = K.rope(q, cos, sin)                                # rotate each pair by its position's angle
        k = K.rope(k, cos, sin)
        self.cache.store(layer, start_pos, k, v)
        att = K.attention(q, self.cache.keys(layer), self.cache.values(layer), start_pos)   # [T, H, D]
        return att.reshape(T, H * D)

    def experts(self, w: Weight, x: np.ndarray, top: np.ndarray) -> np.ndarray:
        """Each token's k chosen experts, one projection: w stacks all E experts' matrices
        by rows (n = out / E each); x [T, in] (every slot of a token reads its row) or
        [T k, in] (slot j of token t reads row t k + j); top [T, k] -> [T k, n]."""
        T, k = top.shape
        n = w.out_features // self.config.num_experts
        per_slot = x.shape[0] == T * k
        if T == 1:
            # decode: the k chosen experts' rows, all in one parallel region (Weight.matmul_segments)
            return w.matmul_segments(x if per_slot else np.repeat(x, k, axis=0), top[0] * n, n)
        # prefill: group the tokens by expert, so each chosen expert's rows are read once per step
        out = np.empty((T * k, n), dtype=np.float32)
        flat = top.reshape(-1)                                 # [T k] slot -> expert
        for e in np.unique(flat):
            slots = np.nonzero(flat == e)[0]                   # the slots routed to e
            out[slots] = w.part(e * n, (e + 1) * n).matmul(x[slots if per_slot else slots // k])
        return out
