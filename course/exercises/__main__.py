"""python -m course.exercises list | start ID DIR | check ID DIR  (docs/exercises.md)."""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from . import EXERCISES, get, map_column
from .base import Workspace, run_check, start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course.exercises",
                                 description="Exercises: rewrite a marked region of the reference "
                                             "code, then check it (docs/exercises.md).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every exercise: id, title, chapter section, difficulty")
    for name, what in (("start", "create DIR with the exercise's files, the region stubbed"),
                       ("check", "run the exercise's check against DIR's code")):
        p = sub.add_parser(name, help=what)
        p.add_argument("id", help="an exercise id, e.g. 1.3 (see `list`)")
        p.add_argument("dir", type=Path, help="the workspace folder")
    sub.add_parser("map-column", help="the course map's table (docs/README.md) on stdin, written "
                                      "to stdout with its exercises column from the list")
    args = ap.parse_args(argv)

    if args.cmd == "map-column":
        try:
            sys.stdout.write(map_column(sys.stdin.read()))
        except (ValueError, AttributeError) as err:
            print(f"error: the course map's table: {err}", file=sys.stderr)
            return 2
        return 0
    if args.cmd == "list":
        width = max(len(e.title) for e in EXERCISES)
        sec = max(len(e.section) for e in EXERCISES)
        for e in EXERCISES:
            print(f"{e.id:<6} {e.title:<{width}}  {e.section:<{sec}}  {e.difficulty}")
        return 0

    try:
        ex = get(args.id)
    except KeyError as err:
        print(f"error: {err.args[0]}", file=sys.stderr)
        return 2

    if args.cmd == "start":
        try:
            ws = start(ex, args.dir)
        except FileExistsError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"exercise {ex.id}: {ex.title} ({ex.difficulty})")
        print(f"read first: {ex.section}")
        print(f"write the region between the '{ex.id} begin' and '{ex.id} end' markers of")
        print(f"    {ws.path(ex.file)}")
        others = [str(ws.path(n)) for n in ex.needs]
        if others:
            print("(also copied, to read or change: " + ", ".join(others) + ")")
        print("then check it with")
        print(f"    python -m course.exercises check {ex.id} {_shown(args.dir)}")
        return 0

    # check
    if not args.dir.is_dir():
        print(f"error: {args.dir} is not a folder; make it with "
              f"`python -m course.exercises start {ex.id} {_shown(args.dir)}`", file=sys.stderr)
        return 2
    if not (args.dir / ex.file).is_file():
        print(f"error: {args.dir / ex.file} is missing; was {args.dir} made by "
              f"`python -m course.exercises start {ex.id} ...`?", file=sys.stderr)
        return 2
    print(f"checking exercise {ex.id} ({ex.title}) in {args.dir} ...", flush=True)
    # numba's performance notes (a stub's prange loop that cannot run in parallel) are not
    # about correctness, which is all a check decides
    warnings.filterwarnings("ignore", module=r"numba\.")
    out = run_check(ex, Workspace(args.dir))
    if out.passed:
        print(f"pass ({out.seconds:.1f} s)")
        return 0
    print(f"fail: {out.message}")
    return 1


def _shown(p: Path) -> str:
    s = str(p)
    return s if " " not in s else repr(s)


if __name__ == "__main__":
    sys.exit(main())      # (how idle threads wait: stage1_cpu chose it, imported by the checks)
