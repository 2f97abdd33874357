"""Stage 1's fast path: the same engine, at the CPU's full speed.

The core (stage1_cpu/*.py) is plain numba that LLVM vectorises for whatever CPU
runs it. This package sits beside it and changes three things, each its own
lesson (docs/stage1.md, "The fast path"):

    simd.py, tiles.py,    int8 (or int16) activations, multiplied by the CPU's integer
    kernels.py            dot-product instructions in register tiles, on int8 / int4 weights
                          stored in 8-row tiles: one token, a few (a verify step), or a
                          prompt; a bf16 GEMM at prefill for bf16 weights
    gemm.py               prefill: the tiles over a whole prompt, blocks of rows claimed by
                          the threads
    blocks.py             decode matvecs of bf16 weights by whole blocks of rows, four rows per pass
    attention.py          prefill attention as two GEMMs per KV head, through BLAS
    weight.py             FastWeight: a quant.Weight that routes those cases to them
    plan.py, sync.py,     a whole step of up to 8 tokens (plan.py writes it down as data, dense
    decode_step.py,       or MoE) in one parallel region, on the same bodies as the per-op
    matvec.py             kernels (the same bits); matvec.py: its matrix phases

cpu.py decides, in Python and before anything is compiled, which instructions
exist on the target (cpu.INT8: "vnni" | "avx2" | "sdot" | None; cpu.BF16). A kernel that
names an instruction is compiled only where it exists; where none does (an
ARM64 core without dotprod, NUMBA_CPU_NAME=generic), the fast path is the one-region step on
fp32 activations, bit for bit the core's result.

The core imports this package in one place, stage1_cpu/weights.py's choose_kernels (which
calls choose() here), and only when --kernels is fast (or auto): with plain nothing of it is
loaded, let alone compiled. It keeps the FastPath in Weights.fast; nothing here imports the
core's weights.py or model.py at run time (plan.py names Weights as a type only).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..jit import numba_stamps
from ..jit.numba_cache import KERNEL_FILES
from ..quant import Weight

# The one-region step inlines the core's row bodies and this package's kernels: every
# function cached from here is stamped with all of those files (stage1_cpu/jit/numba_stamps.py).
HERE = Path(__file__).parent
FILES = sorted(HERE.glob("*.py"))
numba_stamps.depend(FILES, on=KERNEL_FILES)
# Finer stamps where they save a restart: the step's matrix phases (matvec.py) and its worker
# (decode_step.py) call each other through a function pointer, so each is stamped with the
# files it inlines only, and fast/kernels.py with the matmul files: an edit to RMSNorm or
# attention recompiles the worker, one to a matmul kernel recompiles matvec.py and kernels.py.
_CORE = HERE.parent
_MATMUL = [_CORE / "matmul.py", HERE / "blocks.py", HERE / "tiles.py",
           HERE / "simd.py", HERE / "cpu.py"]
numba_stamps.depend([HERE / "matvec.py"], on=_MATMUL + [HERE / "kernels.py", HERE / "sync.py"])
numba_stamps.depend([HERE / "kernels.py"], on=_MATMUL)
numba_stamps.depend([HERE / "decode_step.py"],
                    on=[_CORE / "norms.py", _CORE / "kernels.py", HERE / "sync.py"])

from . import cpu  # noqa: E402  (after depend: numba stamps each kernel when it is defined)
from .attention import KERNELS  # noqa: E402
from .decode_step import KINDS, DecodeStep, kinds  # noqa: E402
from .weight import FastWeight, as_fast, check_act, fast_quantize  # noqa: E402, F401

ACTIVATIONS = ("auto", "int8", "fp32")
# weights whose prefill --activations auto runs on gemm.py's integer GEMM, with int16 activations
# (almost exact) through the vpmaddwd / vpdpwssd tile: int8 and int4. Where AVX-512 BF16 exists too
# it ranks ahead of the bf16 GEMM for them (the same multiply-adds per cycle, no bf16 copy of the
# weights to make per call; docs/benchmarks.md). int8 rounding over a whole prompt (--activations
# int8: the vpmaddubsw / vpdpbusd tiles, faster) flips the default model's first answer
# (tests/test_default_model.py)
AUTO_GEMM_PREFILL: tuple[str, ...] = ("int8", "int4")


def available() -> str | None:
    """None if the fast path runs here, else why not. The one-region step naps with the
    C library's usleep (sync.py): POSIX systems only."""
    if os.name == "posix":
        return None
    return "the one-region decode step needs a POSIX C library (usleep)"


def choose(kernels: str, activations: str, fmt: str) -> FastPath | None:
    """stage1_cpu/weights.py's choose_kernels for --kernels auto or fast: the fast path where it
    runs (available()), else the core alone for auto and an error for fast."""
    if kernels not in ("auto", "fast"):
        raise ValueError(f"unknown --kernels {kernels!r}; choose one of auto, plain, fast")
    why_not = available()
    if why_not and kernels == "fast":
        raise ValueError(f"--kernels fast is not available here: {why_not}; use --kernels plain")
    return None if why_not else FastPath(fmt, activations)


class FastPath:
    """What --kernels fast changes in the core, in the one object the core holds
    (Weights.fast): how each matrix is stored (quantize), the model's kernels (kernels) and
    one-region decode step (one_region), and the banner's words (describe)."""

    def __init__(self, fmt: str, activations: str):
        # a wrong --activations fails before any reading
        choose_act(fmt, activations, 0)
        self.activations = activations

    def quantize(self, w, fmt: str, group_size: int, lm_head: bool = False) -> FastWeight:
        """fp32 [O, K] (or a quant.Weight) -> FastWeight, its activations chosen for this CPU."""
        K = w.in_features if isinstance(w, Weight) else w.shape[1]
        return fast_quantize(w, fmt, group_size,
                             **choose_act(fmt, self.activations, K, lm_head=lm_head))

    def kernels(self):
        """The per-op kernels Model.forward calls: the core's, with prefill attention
        through BLAS (attention.py)."""
        return KERNELS

    def one_region(self, model) -> OneRegionModel:
        """The model with its one-region decode step in front (decode_step.py)."""
        return OneRegionModel(model)

    def files(self) -> list[Path]:
        """Every file whose numba code this path compiles (the warm-up mark follows them)."""
        return KERNEL_FILES + FILES

    def kinds(self, weights) -> str:
        """The row bodies the one-region step compiles for this model, whether its attention
        has q/k norms (decode_step.ops; MoE is in the mark already) and the prefill roundings,
        for the warm-up mark (a model with other kinds compiles other code)."""
        mats = list(_matrices(weights)) + [w for lw in weights.layers
                                           for w in (lw.router, lw.shared_gate) if w]
        # all of them under QS_FAST_ALL_KINDS=1
        body = [k for k, on in zip(KINDS, kinds(mats)) if on]
        body += ["qk"] if any(getattr(lw, "q_norm", None) is not None
                              for lw in weights.layers) else []
        return "_".join(body + sorted({f"pre.{getattr(w, 'prefill_act', 'fp32')}" for w in mats}))

    def describe(self, weights) -> str:
        """For the banner: which kernels and instructions this model uses."""
        return describe(weights)


class OneRegionModel:
    """The model on the fast path, built once by the core's build_model: a forward that
    decode_step.DecodeStep takes (a decode step, or a verify step of a few tokens) runs in one
    parallel region, any other (a prompt) op by op on the model (per_op). Both read and write
    the model's KV cache, to the same bits (tests/test_stage1_decode_step.py)."""

    def __init__(self, model):
        self.per_op, self.decode_step = model, DecodeStep(model)
        self.w, self.config, self.cache = model.w, model.config, model.cache   # as a Model's
        self.kernels = model.kernels

    def forward(self, tokens, start_pos: int, all_logits: bool = False):
        """Model.forward's: tokens [T] at positions start_pos.. -> logits [V] (the last token's),
        or [T, V] with all_logits."""
        one = self.decode_step.takes(len(tokens), all_logits)
        return (self.decode_step if one else self.per_op).forward(tokens, start_pos, all_logits)


def choose_act(fmt: str, activations: str, in_features: int, lm_head: bool = False) -> dict:
    """How a FastWeight rounds its activations: --activations auto rounds them where the
    CPU has an instruction that pays for it: to int8 at int8 / int4 decode (cpu.INT8; the
    int8 lm_head's to int16), to int16 at int8 / int4 prefill (the integer GEMM, cpu.INT16_GEMM),
    to bf16 at bf16 prefill (cpu.BF16); int8 rounds the lm_head's and the int8 / int4
    prefill's to int8; fp32 never rounds.
    -> fast_quantize()'s keyword arguments {"decode_act": ..., "prefill_act": ...}."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown --activations {activations!r}; choose one of "
                         f"{', '.join(ACTIVATIONS)}")
    act = {"decode_act": "fp32", "prefill_act": "fp32"}
    if activations == "fp32" or fmt == "none":
        return act
    if fmt in ("int8", "int4") and (activations == "int8" or cpu.INT8):
        # int8 without an instruction: check_act explains
        act["decode_act"] = "int8"
        if lm_head and fmt == "int8" and activations == "auto":
            act["decode_act"] = "int16"
    if fmt in ("int8", "int4") and activations == "int8":
        # gemm.py's integer GEMM (check_act refuses it without cpu.INT8)
        act["prefill_act"] = "int8"
    elif cpu.INT16_GEMM and fmt in AUTO_GEMM_PREFILL:
        # the same GEMM on int16 activations (ahead of bf16's, too; x86)
        act["prefill_act"] = "int16"
    elif cpu.BF16 and fmt == "bf16" and in_features % 2 == 0:
        act["prefill_act"] = "bf16"
    return act


def describe(weights) -> str:
    """For the banner: which kernels and instructions this model uses."""
    acts = sorted({w.decode_act for w in _matrices(weights)} - {"fp32"})
    pre = sorted({w.prefill_act for w in _matrices(weights)} - {"fp32"})
    what = [f"{'/'.join(acts)} decode activations" if acts else "fp32 activations"]
    if pre:
        what.append(f"{'/'.join(pre)} prefill")
    isa = {"vnni": "VNNI", "avx2": "AVX2", "sdot": "ARM sdot",
           None: "no int8 dot instruction"}[cpu.INT8]
    return f"fast kernels ({', '.join(what)}; {isa}{', AVX-512 BF16' if cpu.BF16 else ''})"


def _matrices(weights):
    yield weights.lm_head
    for lw in weights.layers:
        for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down, lw.experts_gate_up, lw.experts_down,
                  lw.shared_gate_up, lw.shared_down):
            if w is not None:
                yield w
