"""A student's first hour: the commands of README.md and the course's map, as written.

  * every option of every entry point (each module of the packages that runs as `python -m`,
    each `bench` command, `course/series.py`) that has a default says it in `--help`;
  * the README's and the map's tiny-model commands run end to end on CPU with a scripted
    two-turn conversation in a terminal: the tiny model is written, each chat answers twice,
    and the second turn shows the prompt tokens it found cached, as the docs promise.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "stage1_cpu", "stage2_batched", "stage3_optimized", "bench", "course")


# ------------------------------------------------------------------------ --help shows defaults

def entry_points() -> list[list[str]]:
    """Every command a user runs: each module whose `__main__` block calls its main()
    (`python -m MODULE`; not a worker or a probe a benchmark starts), each `python -m bench
    COMMAND`, and `course/series.py`."""
    from bench.__main__ import COMMANDS
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if module == "bench.__main__" or module in (m for m, _ in COMMANDS.values()):
                continue                    # bench's commands: `python -m bench COMMAND`, below
            block = path.read_text().partition('\nif __name__ == "__main__"')[2]
            if "main()" in block:
                found.append([module.removesuffix(".__main__")])
    return found + [["bench", name] for name in COMMANDS] + [["course/series.py"]]


class Parsed(Exception):
    """Raised instead of parsing: carries the parser a command built."""

    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def parser_of(cmd: list[str], monkeypatch) -> argparse.ArgumentParser:
    """The argument parser `cmd` builds, caught as it starts to parse its arguments."""
    def catch(self, args=None, namespace=None):
        raise Parsed(self)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    monkeypatch.setattr(sys, "argv", [cmd[0], *cmd[1:]])
    try:
        if cmd[0].endswith(".py"):
            monkeypatch.syspath_prepend(str(ROOT / Path(cmd[0]).parent))
            runpy.run_path(str(ROOT / cmd[0]), run_name="__main__")
        else:
            runpy.run_module(cmd[0], run_name="__main__", alter_sys=True)
    except Parsed as caught:
        return caught.parser
    raise AssertionError(f"{' '.join(cmd)} parsed no arguments")


def options_without_their_default(parser: argparse.ArgumentParser) -> list[str]:
    """Each option (and subcommand's option) whose default --help does not show: its help must
    hold the word "default" and the default's value."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                missing += options_without_their_default(sub)
            continue
        default = action.default
        if (action.help == argparse.SUPPRESS or default in (None, argparse.SUPPRESS)
                or isinstance(default, bool) or isinstance(action, argparse._HelpAction)):
            continue                        # no default to show; a flag's is "off"
        shown = parser._get_formatter()._expand_help(action) if action.help else ""
        value = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        values = {value, f"{default:g}"} if isinstance(default, float) else {value}
        if "default" not in shown.lower() or not any(v in shown for v in values):
            name = "/".join(action.option_strings) or action.dest
            missing.append(f"{parser.prog} {name} (default {value!r}): {shown!r}")
    return missing


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")    # runpy: bench
def test_every_option_with_a_default_shows_it_in_help(monkeypatch):
    commands = entry_points()
    names = {" ".join(c) for c in commands}
    assert {"stage1_cpu.generate", "stage3_optimized.serve", "bench cpu", "course.exercises",
            "course/series.py", "common.tiny_model"} <= names, names       # the scan found them
    missing = []
    for cmd in commands:
        with monkeypatch.context() as m:
            missing += options_without_their_default(parser_of(cmd, m))
    assert not missing, "\n".join(missing)


def test_the_help_check_catches_an_option_that_hides_its_default():
    ap = argparse.ArgumentParser(prog="demo")
    ap.add_argument("--shown", type=int, default=4096, help="tokens (default 4096)")
    ap.add_argument("--expanded", default="auto", help="how (default: %(default)s)")
    ap.add_argument("--flag", action="store_true", help="a switch")
    assert options_without_their_default(ap) == []
    ap.add_argument("--hidden", type=int, default=50, help="tokens to generate")
    sub = ap.add_subparsers().add_parser("run", prog="demo run")
    sub.add_argument("--quiet-default", type=float, default=0.5)
    assert [m.split(" (")[0] for m in options_without_their_default(ap)] == [
        "demo --hidden", "demo run --quiet-default"]
