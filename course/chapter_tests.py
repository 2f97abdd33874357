"""The course map's tests column (docs/README.md): the test files each chapter names.

    python -m course.chapter_tests < TABLE     # the map's table, its tests column written

A row's chapter link names a document, or a part of one by its heading (`stage3.md#2-...`).
Its tests are the files of tests/ that this part of the chapter names, by path
(`tests/test_x.py`) or by the name of a test they hold (`test_greedy_tokens_match_...`): the
chapter says what checks it, and the map gathers it. The part under a heading runs to the next
heading of its level or above; a link to a whole document takes the document less the parts
that other rows link to. A named test that no file of tests/ holds is an error: a renamed test
cannot leave a chapter pointing at nothing. `python -m bench report` runs this (bench/ and
course/ import nothing of each other).
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BY_PATH = re.compile(r"\btests/(test_\w+\.py)\b")
BY_NAME = re.compile(r"`(test_\w+)`")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def sections(text: str) -> dict[str, tuple[int, int]]:
    """A heading's anchor -> (start, end) of its part of the text: to the next heading of its
    level or above. A line in a code block is no heading (`# a comment`)."""
    heads, at, in_code = [], 0, False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"(#{1,6}) (.+)", line)):
            heads.append((at, len(m.group(1)), slug(m.group(2))))
        at += len(line)
    return {name: (start, next((s for s, lvl, _ in heads[i + 1:] if lvl <= level), len(text)))
            for i, (start, level, name) in enumerate(heads)}


def defined_tests(tests: Path) -> dict[str, set[str]]:
    """A test's name -> the files of tests/ that define it (a name may stand in two)."""
    found: dict[str, set[str]] = {}
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            test = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if test and node.name.startswith("test_"):
                found.setdefault(node.name, set()).add(path.name)
    return found


def named_tests(text: str, defined: dict[str, set[str]], tests: Path) -> list[str]:
    """The test files `text` names, by path or by a test's name, sorted."""
    files = set(BY_PATH.findall(text))
    for name in BY_NAME.findall(text):
        if name not in defined:
            raise ValueError(f"a chapter names the test {name}, and no file of tests/ defines it")
        files |= defined[name]
    if missing := sorted(f for f in files if not (tests / f).is_file()):
        raise ValueError(f"a chapter names tests/{missing[0]}, which does not exist")
    return sorted(files)


def chapter_part(text: str, anchor: str, others: list[str]) -> str:
    """The part of a chapter a row links to: the part under `anchor`, or with none the whole
    text less the parts under `others` (the headings other rows link to in the same document)."""
    spans = sections(text)
    if missing := [a for a in [anchor, *others] if a and a not in spans]:
        raise ValueError(f"no heading #{missing[0]}")
    if anchor:
        return text[spans[anchor][0]:spans[anchor][1]]
    kept, at = [], 0
    for start, end in sorted(spans[a] for a in others):
        kept.append(text[at:start])
        at = max(at, end)
    return "".join(kept) + text[at:]


def tests_column(table: str, docs: Path = ROOT / "docs", tests: Path = ROOT / "tests") -> str:
    """The course map's table with its tests column written from the chapters it links to."""
    lines = table.split("\n")
    split = lambda line: [c.strip() for c in line.strip().strip("|").split("|")]  # noqa: E731
    head = split(lines[0])
    column, chapter = head.index("tests"), head.index("chapter")
    rows = [i for i, line in enumerate(lines[2:], 2) if line.startswith("|")]
    links = [re.search(r"\]\(([^)]+)\)", split(lines[i])[chapter]).group(1).partition("#")
             for i in rows]                                   # (document, "#", heading)
    defined = defined_tests(tests)
    for i, (doc, _, anchor) in zip(rows, links):
        others = [a for d, _, a in links if d == doc and a]
        try:
            part = chapter_part((docs / doc).read_text(), anchor, others)
        except ValueError as err:
            raise ValueError(f"{doc}: {err}") from None
        cells, names = split(lines[i]), named_tests(part, defined, tests)
        cells[column] = ", ".join(f"`{name}`" for name in names) or "—"
        lines[i] = "| " + " | ".join(cells) + " |"
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course.chapter_tests",
                                 description=__doc__.split("\n\n")[0] + " (The table on stdin.)")
    ap.parse_args(argv)
    try:
        sys.stdout.write(tests_column(sys.stdin.read()))
    except (ValueError, OSError, AttributeError) as err:
        print(f"error: the course map's tests column: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
