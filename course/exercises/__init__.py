"""Exercises: marked regions of the reference code that a student rewrites and checks.

    python -m course.exercises list
    python -m course.exercises start 1.1 ~/ex1.1
    python -m course.exercises check 1.1 ~/ex1.1
    python -m course.exercises map-column < TABLE   # the map's exercises column (bench report)

EXERCISES holds every exercise in course order (stage 1, then 2, then 3); docs/exercises.md
lists them with what to read first, the shapes, a hint and what each check compares.
The framework (markers, workspaces, check helpers) is in base.py.
"""
from __future__ import annotations

import re

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


def map_column(table: str) -> str:
    """The course map's table (docs/README.md) with its exercises column written from EXERCISES.
    An exercise goes to the row whose chapter link is its section (a lesson of stage 3), else to
    the first row whose chapter is its stage's whole chapter (stage1.md, stage2.md); a cell lists
    its ids in runs ("1.1–1.14, 1.16"), or "—". An exercise with no row is an error."""
    lines = table.split("\n")
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    head = split(lines[0])
    column, chapter = head.index("exercises"), head.index("chapter")
    rows = [i for i, line in enumerate(lines[2:], 2) if line.startswith("|")]
    links = {i: re.search(r"\]\(([^)]+)\)", split(lines[i])[chapter]).group(1) for i in rows}
    cells: dict[int, list[Exercise]] = {i: [] for i in rows}
    for e in EXERCISES:
        section = e.section.removeprefix("docs/")
        whole = f"stage{e.id[0]}.md"                                     # the stage's chapter
        at = [i for i in rows if links[i] == section] or [i for i in rows if links[i] == whole]
        if not at:
            raise ValueError(f"exercise {e.id} ({e.section}) has no row in the course map")
        cells[at[0]].append(e)
    for i in rows:
        cell = split(lines[i])
        cell[column] = ", ".join(_runs(cells[i])) or "—"
        lines[i] = "| " + " | ".join(cell) + " |"
    return "\n".join(lines)


def _runs(exercises: list[Exercise]) -> list[str]:
    """Consecutive ids of one stage as a range: 1.1, 1.2, 1.3, 1.5 -> ["1.1–1.3", "1.5"]."""
    runs: list[list[Exercise]] = []
    for e in exercises:
        stage, n = e.id.split(".")
        if runs and runs[-1][-1].id == f"{stage}.{int(n) - 1}":
            runs[-1].append(e)
        else:
            runs.append([e])
    return [r[0].id if len(r) == 1 else f"{r[0].id}–{r[-1].id}" for r in runs]
