"""Stage-1 exercises (and common/sampling.py's), in course order: docs/exercises.md.

Each check imports the student's copy (ws.module) and compares it with the project's own
oracle: the numpy definitions of stage1_cpu/ops.py and quant.Weight.matmul_ref (taken
from the installed package, never from the workspace), or a definition written here.
"""
from __future__ import annotations

import numpy as np

from .base import Exercise, Workspace, assert_close, assert_equal, require  # noqa: F401

S1 = "docs/stage1.md"


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------
# 1.1 RMSNorm
# ---------------------------------------------------------------------------

def check_rmsnorm(ws: Workspace) -> None:
    from stage1_cpu import ops
    K = ws.module("stage1_cpu/norms.py")
    r = _rng(1)
    cases = [
        ("the residual stream [T, C]", (r.normal(0.5, 3.0, (5, 96))), r.normal(1.0, 0.3, 96), 1e-6,
         ("token", "channel")),
        ("q heads [T, H, D] with w [D]", r.normal(0, 2.0, (3, 4, 32)), r.normal(1.0, 0.3, 32), 1e-6,
         ("token", "head", "dim")),
        ("tiny values, where eps matters", r.normal(0, 1e-3, (2, 40)), r.normal(1.0, 0.3, 40), 1e-4,
         ("token", "channel")),
    ]
    for name, x, w, eps, axes in cases:
        x, w = x.astype(np.float32), w.astype(np.float32)
        got = K.rmsnorm(x, w, eps)
        assert_close(f"rmsnorm, {name}", got, ops.rmsnorm(x, w, eps), atol=1e-5, rtol=1e-4, axes_names=axes,
                     hint="x / sqrt(mean(x^2) + eps) * w over the last axis")


EXERCISES: list[Exercise] = [
    Exercise("1.1", "RMSNorm of one row", f"{S1}#3-modelpy-the-forward-pass", "easy",
             "stage1_cpu/norms.py", check=check_rmsnorm),
]
