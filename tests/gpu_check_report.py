"""Helpers of bench/gpu_check.sh, standard library only (they run under whichever
interpreter the script found, or under python3 when none has CuPy).

  python tests/gpu_check_report.py junit OUT.xml IN.xml...   merge pytest's junit files
                                                               into one; prints totals
  python tests/gpu_check_report.py failures IN.xml [LINES]     the failing tests, each with
                                                               the last LINES lines of its traceback
  python tests/gpu_check_report.py counts IN.xml               "passed failed errors skipped"
  python tests/gpu_check_report.py stages IN.xml STAGE...      the stages (test_STAGE_gpu.py, e.g.
                                                               stage2, stage3) none of whose tests
                                                               passed; empty when each had one
  python tests/gpu_check_report.py check-out DIR MAX           DIR holds at most MAX plain files,
                                                               no folders, names the device tool
                                                               brings back; exit 1 otherwise
"""
from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def suites(path: str) -> list[ET.Element]:
    """The <testsuite> elements of a junit file (pytest writes <testsuites><testsuite>)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    return [root] if root.tag == "testsuite" else list(root.iter("testsuite"))


def counts(paths: list[str]) -> dict[str, int]:
    c = dict(passed=0, failed=0, errors=0, skipped=0)
    for path in paths:
        for suite in suites(path):
            for case in suite.iter("testcase"):
                kinds = {child.tag for child in case}
                if "failure" in kinds:
                    c["failed"] += 1
                elif "error" in kinds:
                    c["errors"] += 1
                elif "skipped" in kinds:
                    c["skipped"] += 1
                else:
                    c["passed"] += 1
    return c


def passed_per_file(path: str) -> dict[str, int]:
    """test file stem (pytest's classname starts with it, e.g. tests.test_stage3_gpu)
    -> tests passed."""
    out: dict[str, int] = {}
    for suite in suites(path):
        for case in suite.iter("testcase"):
            parts = case.get("classname", "").split(".")
            stem = next((x for x in parts if x.startswith("test_")), parts[-1])
            ok = not {child.tag for child in case} & {"failure", "error", "skipped"}
            out[stem] = out.get(stem, 0) + int(ok)
    return out


def stages_without_a_pass(path: str, stages: list[str]) -> list[str]:
    """The stages of `stages` (stage2, stage3, ...) whose GPU test file passed no test."""
    passed = passed_per_file(path)
    return [st for st in stages if passed.get(f"test_{st}_gpu", 0) == 0]


def merge(out: str, paths: list[str]) -> None:
    root = ET.Element("testsuites")
    for path in paths:
        for suite in suites(path):
            suite.set("name", Path(path).stem)        # which step it came from
            root.append(suite)
    ET.ElementTree(root).write(out, encoding="utf-8", xml_declaration=True)


def failures(path: str, lines: int = 25) -> str:
    """Each failing or erroring test: its id, then the last `lines` lines of its text."""
    parts = []
    for suite in suites(path):
        for case in suite.iter("testcase"):
            for child in case:
                if child.tag not in ("failure", "error"):
                    continue
                text = (child.text or child.get("message") or "").rstrip().splitlines()
                cut = text[-lines:]
                more = (
                    f"    ... ({len(text) - lines} lines above, in logs.tar.gz)\n"
                    if len(text) > lines
                    else ""
                )
                parts.append(f"--- {child.tag.upper()}: "
                             f"{case.get('classname', '')}::{case.get('name', '')}\n"
                             + more + "\n".join("    " + x for x in cut))
    return "\n".join(parts)


SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def check_out(folder: str, most: int) -> list[str]:
    """What would keep a file of DIR from coming back from the device machine."""
    problems, files = [], []
    for p in sorted(Path(folder).iterdir()):
        if p.is_symlink() or not p.is_file():
            problems.append(f"{p.name}: not a plain file")
        elif not SAFE_NAME.match(p.name):
            problems.append(f"{p.name}: a name the device tool does not bring back")
        elif p.stat().st_size > 16 * 2**20:
            problems.append(f"{p.name}: {p.stat().st_size / 2**20:.1f} MiB, over 16 MiB")
        else:
            files.append(p.name)
    if len(files) > most:
        problems.append(f"{len(files)} files, more than {most}: {', '.join(files)}")
    return problems


def main(argv: list[str]) -> int:
    cmd, *rest = argv
    if cmd == "junit":
        merge(rest[0], rest[1:])
        c = counts([rest[0]])
        print(" ".join(f"{v} {k}" for k, v in c.items()))
    elif cmd == "counts":
        c = counts(rest)
        print(c["passed"], c["failed"], c["errors"], c["skipped"])
    elif cmd == "stages":
        print(" ".join(stages_without_a_pass(rest[0], rest[1:])))
    elif cmd == "failures":
        text = failures(rest[0], int(rest[1]) if len(rest) > 1 else 25)
        if text:
            print(text)
    elif cmd == "check-out":
        problems = check_out(rest[0], int(rest[1]))
        for p in problems:
            print(p)
        return 1 if problems else 0
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
