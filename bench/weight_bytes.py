"""Bytes of a stage-1 model's weights: the roofline's numerator (bench/cpu.py, moe.py, profile.py).

Stages 2 and 3 count their own (Weights.nbytes, Weights.decode_nbytes); stage 1's
core keeps its weights.py to loading, so its counts live here.
"""
from __future__ import annotations


def stage1_bytes(weights, decode: bool = False) -> int:
    """Bytes of every matrix of a stage-1 Weights: attention, MLPs, routers, shared
    experts and their gates, the lm_head (the embedding counted once, as the lm_head when
    tied; norms and biases left out), and every routed expert; with decode=True, what one
    decode token reads: each MoE layer's routed experts counted for the k of E a token
    goes to."""
    cfg = weights.config
    share = cfg.num_experts_per_tok / cfg.num_experts if decode and cfg.num_experts else 1.0
    names = ("wqkv", "wo", "w_gate_up", "w_down", "router", "shared_gate")
    mats = [weights.lm_head] + [getattr(l, n) for l in weights.layers for n in names]
    mats += [m for l in weights.layers if l.shared_expert for m in (l.shared_expert.e_gate_up, l.shared_expert.e_down)]
    routed = sum(l.experts_gate_up.nbytes + l.experts_down.nbytes for l in weights.layers if l.experts)
    return sum(w.nbytes for w in mats if w is not None) + round(routed * share)
