"""The decode step written down as data: the list of phases decode_step.py runs.

Why data, when stage1_cpu/model.py is plain code? model.py calls one numba kernel
per op, each a parallel region of its own: for one token of Qwen3-0.6B that is 113
thread starts, each tens of microseconds when idle threads sleep. decode_step.py
runs the whole token inside one parallel region instead, and numba compiles that
region once, ahead of the call: it cannot follow Python code that picks, layer by
layer, what comes next. So the step is written down first, as a list of phases
that one compiled loop walks (decode_step.DecodeStep turns it into a table of
integers). It is the idea of stage 3's CUDA graphs: a graph records the kernels
of a step once and replays them with one launch; here the record is this list,
and the replay is one parallel region.

plan() says the same as Model.forward and Model.moe, phase for phase, in the same
order on the same values: the one-region step's logits and KV cache are bit for
bit the core's (tests/test_stage1_decode_step.py). An edit to the forward pass
in model.py needs its twin here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..quant import Weight

# a type only: stage1_cpu/weights.py imports this package (choose_kernels)
if TYPE_CHECKING:
    from ..weights import Weights


@dataclass(frozen=True, eq=False)
class Phase:
    """One step of the forward pass: dst = op(src, ...), buffers by name ([1, ...] each)."""
    op: str                         # see decode_step._worker for what each op does
    src: str                        # the buffer it reads
    dst: str                        # the buffer it writes (add / gated_add: adds to)
    weight: Weight | None = None    # matmul, experts: the matrix
    vec: np.ndarray | None = None   # norm: its weight [C]; matmul: a bias [O] or None
    aux: str | None = None          # a second input: route (experts, mix), the gate (gated_add)
    layer: int = -1                 # attention: whose cache and q/k norms


def plan(w: Weights) -> list[Phase]:
    """Model.forward for one token, as the list of phases the one-region step runs, in order."""
    P = []
    for i, lw in enumerate(w.layers):
        # ---- attention block ----
        P += [Phase("norm", "x", "h", vec=lw.attn_norm),
              # q, k, v in one matmul (+ qwen2's biases)
              Phase("matmul", "h", "qkv", lw.wqkv, vec=lw.bqkv),
              # q/k norm (qwen3), RoPE, cache, attend
              Phase("attention", "qkv", "att", layer=i),
              Phase("matmul", "att", "o", lw.wo),
              Phase("add", "o", "x"),                                # the residual
              # ---- MLP block ----
              Phase("norm", "x", "h", vec=lw.mlp_norm)]
        # SwiGLU: down(silu(gate(h)) * up(h))
        if lw.router is None:
            P += [Phase("matmul", "h", "gu", lw.w_gate_up),          # [gate | up] in one matmul
                  Phase("silu_mul", "gu", "act"),
                  Phase("matmul", "act", "down", lw.w_down),
                  Phase("add", "down", "x")]
            continue
        # Model.moe: the router picks k experts; each is a SwiGLU MLP of its own
        P += [Phase("matmul", "h", "router", lw.router),             # [E] logits, fp32
              # the k experts and their weights
              Phase("route", "router", "route"),
              # [k, 2Fe] each its own rows
              Phase("experts", "h", "egu", lw.experts_gate_up, aux="route"),
              Phase("silu_mul", "egu", "eact"),
              Phase("experts", "eact", "ey", lw.experts_down, aux="route"),    # [k, C]
              Phase("mix", "ey", "moe", aux="route")]                # moe = sum_j weight_j ey_j
        if lw.shared_gate_up is not None:                            # qwen2_moe: every token, gated
            P += [Phase("matmul", "h", "sgu", lw.shared_gate_up),
                  Phase("silu_mul", "sgu", "sact"),
                  Phase("matmul", "sact", "sy", lw.shared_down),
                  Phase("matmul", "h", "sgate", lw.shared_gate),     # [1], fp32 like the router
                  Phase("gated_add", "sy", "moe", aux="sgate")]      # moe += sigmoid(sgate) * sy
        P += [Phase("add", "moe", "x")]
    return P + [Phase("norm", "x", "h", vec=w.final_norm),           # one token: it is the last
                Phase("matmul", "h", "logits", w.lm_head)]
