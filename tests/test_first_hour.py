"""A student's first hour: the commands of README.md and the course's map, as written.

  * every option of every entry point (each module of the packages that runs as `python -m`,
    each `bench` command, `course/series.py`) that has a default says it in `--help`;
  * the README's and the map's tiny-model commands run end to end on CPU with a scripted
    two-turn conversation in a terminal: the tiny model is written, each chat answers twice,
    and the second turn shows the prompt tokens it found cached, as the docs promise;
  * one-shot generation names its model and says when the token limit cut the answer.
"""
from __future__ import annotations

import argparse
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "stage1_cpu", "stage2_batched", "stage3_optimized", "bench", "course")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


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


# ------------------------------------------------------------- the docs' tiny-model commands

QUESTIONS = ("What is the capital of France?", "Repeat the city you just named.")
STATS = r"(\d+) prompt tokens(?: \((\d+) cached\))? · (\d+) generated"


def doc_commands() -> dict[str, str]:
    """The tiny-model commands as README.md, the course's map (docs/README.md) and the lesson
    series' README write them: the model, stage 3's chat, the rungs as packages, rung 02's chat
    (the prefix cache's lesson)."""
    readme = (ROOT / "README.md").read_text()
    course_map = (ROOT / "docs" / "README.md").read_text()
    lessons = (ROOT / "docs" / "lessons" / "README.md").read_text()
    find = lambda pattern, text: re.findall(pattern, text, re.M)  # noqa: E731
    found = {"tiny": find(r"^python -m common\.tiny_model \S+$", readme),
             "stage 3 chat": find(r"^python -m stage3_optimized\.chat --model .*$", readme),
             "rungs": find(r"`(python course/series\.py packages \S+)`", course_map)
             + find(r"^(python course/series\.py packages \S+)", lessons),
             "rung 02 chat": find(r"`(PYTHONPATH=\S+ python -m rung02\.chat [^`]*)`", course_map)
             + find(r"^PYTHONPATH=\S+ python -m rung02\.chat .*$", lessons)}
    for what, cmds in found.items():
        assert cmds and len(set(cmds)) == 1, f"the docs write {what} as {cmds}: one way, please"
    return {what: cmds[0] for what, cmds in found.items()}


def chat_twice(command: str, env: dict) -> tuple[str, list[tuple[int, int | None, int]]]:
    """Two questions in a terminal 80 columns wide -> (the screen, each turn's (prompt tokens,
    cached tokens or None, generated tokens)); a turn that does not fit the context fails."""
    import pexpect
    words = shlex.split(command)
    child = pexpect.spawn(sys.executable, words[words.index("python") + 1:], cwd=str(ROOT), env=env,
                          encoding="utf-8", timeout=120, dimensions=(50, 80))
    child.logfile_read, turns = io.StringIO(), []
    try:
        child.expect("Ctrl-D to leave")
        child.expect_exact("> ")
        for question in QUESTIONS:
            child.sendline(question)
            if child.expect([STATS, "the context holds"]) == 1:
                break                                           # the turn did not fit
            turns.append(tuple(int(g) if g else None for g in child.match.groups()))
            child.expect_exact("> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    screen = ANSI.sub("", child.logfile_read.getvalue())
    assert len(turns) == 2 and child.exitstatus == 0, f"{command}: turn 2 did not fit:\n{screen}"
    return screen, turns


def check_turns(command: str, screen: str, turns: list) -> None:
    """The first answer stops at the cap the banner states (so both turns fit the context);
    the second turn shows the prompt tokens found in the cache."""
    cap = re.search(r"answers of at most (\d+) tokens", screen)
    assert cap, f"{command}: the banner states no answer cap, and a random model runs to the " \
                f"context's end:\n{screen[:2000]}"
    (_, c1, g1), (p2, c2, g2) = turns
    assert c1 is None and g1 <= int(cap.group(1)) and g2 <= int(cap.group(1)), (command, turns)
    assert c2 is not None and 0 < c2 < p2, f"{command}: turn 2 found no cached tokens: " \
                                           f"{turns}"


def test_the_readmes_tiny_model_commands_chat_twice_and_the_second_turn_finds_its_cache(tmp_path):
    """README.md's tiny model and stage-3 chat, the map's rungs and rung 02's chat, run as the
    docs write them (their /tmp folders moved into tmp_path), each chat asked two questions in
    an 80-column terminal: the second turn's stats show the prompt tokens the prefix cache
    held. A random model seldom ends an answer by itself: without an answer cap its first
    answer fills the 4096-token context and the second turn does not fit."""
    pytest.importorskip("pexpect")
    cmds = doc_commands()
    moved = {"/tmp/tiny": str(tmp_path / "tiny"), "/tmp/rungs": str(tmp_path / "rungs"),
             "$PWD": str(ROOT)}
    for what in cmds:
        for old, new in moved.items():
            cmds[what] = cmds[what].replace(old, new)
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT), TERM="xterm-256color")
    for what in ("tiny", "rungs"):
        words = shlex.split(cmds[what])
        r = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, f"{cmds[what]}: {r.stderr}"
    screen, turns = chat_twice(cmds["stage 3 chat"], env)
    assert "tiny · stage 3 optimized · cpu · bf16 · prefix cache · context 4096 tokens" in screen
    check_turns(cmds["stage 3 chat"], screen, turns)
    rung_path = shlex.split(cmds["rung 02 chat"])[0].split("=", 1)[1]
    rung_env = dict(env, PYTHONPATH=rung_path)
    check_turns(cmds["rung 02 chat"], *chat_twice(cmds["rung 02 chat"], rung_env))


def test_generate_names_the_model_and_says_when_the_token_limit_cut_the_answer(tmp_path):
    """The banner starts with the model's name; an answer cut by --max-tokens, or by the model's
    own max_new_tokens when --max-tokens is not given, says so on its stats line."""
    from common.tiny_model import MAX_NEW_TOKENS, write_tiny_model
    folder = write_tiny_model(tmp_path / "tiny")
    base = [sys.executable, "-m", "stage3_optimized.generate", "--model", str(folder),
            "--device", "cpu", "--prompt", "Hello", "--temperature", "0"]
    for extra, n in (([], MAX_NEW_TOKENS), (["--max-tokens", "3"], 3)):
        r = subprocess.run(base + extra, cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert r.returncode == 0, r.stderr
        lines = r.stderr.strip().splitlines()
        assert lines[0].startswith("[tiny"), r.stderr
        assert f", {n} generated in {n} steps" in lines[-1], r.stderr
        assert lines[-1].endswith(f"cut at the token limit ({n})]"), r.stderr


def test_the_readme_shows_the_chat_as_it_prints_in_80_columns():
    """The banner breaks between its parts into lines of at most 80 columns, and README.md's
    session shows those very lines: the banner, the sampling line, each stats line."""
    from common.chat import BANNER_WIDTH, fit_lines
    readme = (ROOT / "README.md").read_text()
    block = readme.split("$ python -m stage1_cpu.chat\n", 1)[1].split("```")[0]
    lines = block.splitlines()
    sampling = next(i for i, line in enumerate(lines) if line.startswith("Sampling:"))
    banner = lines[:sampling]
    assert BANNER_WIDTH == 80 and all(len(line) <= 80 for line in lines), lines
    assert fit_lines(" · ".join(banner).split(" · ")) == banner and len(banner) > 1
    assert banner[0].startswith("smollm2-135m · stage 1 CPU") and "context 4096 tokens" in banner[0]
    stats = [i for i, line in enumerate(lines) if " prompt tokens" in line]
    for i in stats:                                  # a stats line and its continuation, re-packed
        parts = " · ".join(lines[i:i + 2]).split(" · ")
        assert fit_lines(parts) == lines[i:i + 2], lines[i:i + 2]
