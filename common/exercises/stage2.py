"""Stage-2 exercises (docs/exercises.md), in course order."""
from __future__ import annotations

from .base import Exercise

EXERCISES: list[Exercise] = []
