"""Exercises: marked regions of the reference code that a student rewrites and checks.

    python -m course.exercises list
    python -m course.exercises start 1.1 ~/ex1.1
    python -m course.exercises check 1.1 ~/ex1.1

EXERCISES holds every exercise in course order (stage 1, then 2, then 3); docs/exercises.md
lists them with what to read first, the shapes, a hint and what each check compares.
The framework (markers, workspaces, check helpers) is in base.py.
"""
from __future__ import annotations

from .base import CheckFailed, Exercise, Outcome, Workspace, run_check  # noqa: F401 (the package's API)
from .stage1 import EXERCISES as _STAGE1
from .stage2 import EXERCISES as _STAGE2
from .stage3 import EXERCISES as _STAGE3

EXERCISES: list[Exercise] = [*_STAGE1, *_STAGE2, *_STAGE3]

_ids = [e.id for e in EXERCISES]
if len(set(_ids)) != len(_ids):
    raise RuntimeError(f"two exercises share an id: {sorted(i for i in _ids if _ids.count(i) > 1)}")


def get(ex_id: str) -> Exercise:
    """The exercise with this id; KeyError with the known ids otherwise."""
    for e in EXERCISES:
        if e.id == ex_id:
            return e
    raise KeyError(f"no exercise {ex_id!r}; the exercises are {', '.join(_ids)} "
                   "(python -m course.exercises list)")
