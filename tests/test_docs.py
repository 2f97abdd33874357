"""The docs a newcomer reads: README.md, docs/*.md and the lesson series' README.

  * the results tables are what `python -m bench report` writes from the saved JSON, and a
    number edited by hand in one fails `report --check`;
  * no lab notes: no issue numbers, clock times or narration of who measured what and when;
    dates only inside the tables `report` writes;
  * every `python -m …` command of this repository they write answers `--help`, and every
    relative link and image resolves (a `#section` to a heading of the file it names), the
    exercises' sections included;
  * the stage 2 -> 3 rungs are named and counted as course/series.py has them;
  * the sizes the course promised: README.md, docs/benchmarks.md and docs/stage1.md.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench import report
from course import chapter_tests
from course.chapter_tests import slug
from course.exercises import EXERCISES

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "docs" / "lessons" / "README.md",
]
PACKAGES = ("common", "stage1_cpu", "stage2_batched", "stage3_optimized", "bench", "course")
WITH_SUBCOMMANDS = ("bench", "course.exercises")


def prose(path: Path) -> str:
    """The file's text without the blocks `report` writes (their dates are the results')."""
    return report.BLOCK.sub("", path.read_text())


# ---- the tables come from the saved results ----

def test_report_check_passes_on_the_docs_as_committed():
    r = subprocess.run([sys.executable, "-m", "bench", "report", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout


def test_a_number_edited_by_hand_in_a_table_fails_report_check(tmp_path):
    """A copy of the repository, one number changed in a results table (the counted ladder of
    docs/stage3.md) and one line count in the course's map: --check names both and exits 1,
    and `report` writes them back."""
    copy = tmp_path / "repo"
    shutil.copytree(
        ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".numba-cache")
    )
    stage3, course_map = copy / "docs" / "stage3.md", copy / "docs" / "README.md"
    text = stage3.read_text()
    row = re.search(r"^\| 0 +\| 00-stage2 +\| (\d+) +\|", text, re.M)
    bumped = row.group(0).replace(row.group(1), str(int(row.group(1)) + 1))
    stage3.write_text(text.replace(row.group(0), bumped, 1))
    text = course_map.read_text()
    count = re.search(r"`common/engine.py` \((\d+)\)", text)
    course_map.write_text(text.replace(count.group(0), "`common/engine.py` (1)", 1))

    check = [sys.executable, "-m", "bench", "report", "--check", "--root", str(copy)]
    r = subprocess.run(check, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (
        r.returncode == 1
        and "docs/stage3.md (lessons)" in r.stderr
        and "docs/README.md (lines)" in r.stderr
    )
    # write them
    subprocess.run(check[:4] + check[5:], cwd=ROOT, check=True, capture_output=True, timeout=300)
    assert stage3.read_text() == (ROOT / "docs" / "stage3.md").read_text()
    assert subprocess.run(check, cwd=ROOT, capture_output=True, timeout=300).returncode == 0


def _run(engine: str, fmt: str, metric: str, value: float, policy: str) -> dict:
    return dict(engine=engine, format=fmt, threads=2, metric=metric, value=value, policy=policy)


def test_report_cpu_table_divides_stage1_by_llamacpp_each_at_its_best_policy(tmp_path):
    """From a saved run's best-policy medians: int8 decode 30 / 20 tok/s is 1.50×, prefill 512
    90 / 120 is 0.75×; the 1-thread figures and transformers' are not the table's; the class
    comes from --cpu-profile and the flags; a busy run says so in its caption."""
    best = [_run("stage1", "int8", "decode", 30.0, "PASSIVE"),
            _run("llama.cpp", "Q8_0", "decode", 20.0, "default"),
            _run("stage1", "int8", "512", 90.0, "default"),
            _run("llama.cpp", "Q8_0", "512", 120.0, "PASSIVE"),
            _run("transformers", "bf16", "decode", 99.0, "PASSIVE"),
            dict(_run("stage1", "int8", "128", 5.0, "PASSIVE"), threads=1)]
    run = dict(command="python -m bench cpu --cpu-profile avx2 --save x", date="D", machine="M",
               cpu_flags=["avx2", "avx512f"], cpu_profile="avx2", shape="qwen3-0.6b-shape",
               quick=False, threads=[1, 2], others_cores=0.4,
               versions={"llama-cpp-python": "0.3.36"}, best=best)
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "cpu-avx2.json").write_text(json.dumps(run))
    table = report.cpu_table(tmp_path)
    row = next(line for line in table.splitlines() if line.startswith("| AVX2"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "AVX2 (AVX-512 host as stand-in)" and cells[1] == "int8 ÷ Q8_0"
    assert (
        cells[2] == "**1.50×** (30.0 / 20.0 tok/s)"
        and cells[3] == "–"
        and cells[4].startswith("**0.75×**")
    )
    assert "**busy**" in table and "python -m bench cpu --cpu-profile avx2" in table
    full = report.cpu_full(tmp_path)
    assert "30.0 (PASSIVE)" in full and "20.0 (default)" in full and "99.0" not in full


# ---- no lab notes ----

LAB = [(re.compile(r"\bissues? #?\d+", re.I), "an issue number"),
       (re.compile(r"\b(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d)?\s*(?:UTC|h\b)|\b(?:[01]\d|2[0-3]):[0-5]\d\b(?![\d.:])"),
        "a clock time"),
       (re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"), "a date outside a table `report` writes"),
       (re.compile(r"\bUTC\b|lab log|benchmarks-log|this session|next session|earlier session|"
                   r"an hour earlier|later that day|this morning|yesterday|the same day|"
                   r"we measured|I measured", re.I),
        "narration of who measured what and when")]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_lab_notes(path):
    text = prose(path)
    found = [f"{what}: {m.group(0)!r} in …{text[max(0, m.start() - 40):m.end() + 20]!r}…"
             for rx, what in LAB for m in rx.finditer(text)]
    assert not found, "\n".join(found)


def test_the_lab_note_patterns_catch_what_they_are_for():
    """The patterns are not vacuous: each catches its kind, and the prose of a chapter passes."""
    for text in ("(issue 28)", "10:11-12:11 UTC", "at 16:36", "on 2026-12-03", "the lab log",
                 "an hour earlier"):
        assert any(rx.search(text) for rx, _ in LAB), text
    for text in ("--addr 127.0.0.1:8000", "GQA 16:8", "8 `vpmaddwd` per step",
                 "a session of the chat"):
        assert not any(rx.search(text) for rx, _ in LAB), text


# ---- commands and links ----

def commands() -> list[list[str]]:
    """Every `python -m MODULE [SUBCOMMAND]` of this repository the docs write, and
    `python course/series.py`."""
    found = set()
    for path in DOCS:
        for m in re.finditer(r"python3? -m ([A-Za-z_][\w.]*)((?: [a-z][\w-]*)?)", path.read_text()):
            module, sub = m.group(1), m.group(2).strip()
            if module.split(".")[0] not in PACKAGES:
                # pytest, another project's server, a rungNN package course/series.py writes
                continue
            found.add((module, sub if module in WITH_SUBCOMMANDS else ""))
        if "python course/series.py" in path.read_text():
            found.add(("course/series.py", ""))
    return [([sys.executable, mod] if mod.endswith(".py") else [sys.executable, "-m", mod])
            + ([sub] if sub else [])
            for mod, sub in sorted(found)]


def test_every_python_m_command_in_the_docs_answers_help():
    cmds = commands()
    # the scan found them
    assert len(cmds) >= 15 and [sys.executable, "-m", "bench", "report"] in cmds
    assert [sys.executable, "-m", "common.tiny_model"] in cmds

    def help_of(cmd):
        r = subprocess.run(cmd + ["--help"], cwd=ROOT, capture_output=True, text=True, timeout=240)
        return cmd, r
    with ThreadPoolExecutor(4) as pool:
        failed = [f"{' '.join(c[1:])} --help: exit {r.returncode}: {(r.stderr or r.stdout)[-300:]}"
                  for c, r in pool.map(help_of, cmds)
                  if r.returncode != 0 or "usage" not in r.stdout.lower()]
    assert not failed, "\n".join(failed)


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and (m := re.match(r"#{1,6} (.+)", line)):
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def links() -> list[tuple[Path, str]]:
    out = []
    for path in DOCS:
        # code blocks hold no links
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        out += [(path, t) for t in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)]
    # each exercise's chapter section
    out += [(ROOT / "README.md", e.section) for e in EXERCISES]
    return out


def test_every_relative_link_and_image_resolves():
    found, broken = links(), []
    assert len(found) > 50
    for path, target in found:
        if re.match(r"[a-z]+:", target):
            continue                                                      # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(
                f"{path.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})"
            )
    assert not broken, "\n".join(broken)


def test_a_broken_link_or_anchor_would_be_caught(tmp_path):
    assert "14-fastgemmpy-prefill-on-integers" in anchors(ROOT / "docs" / "stage1.md")
    assert "5-kv_cachepy" in anchors(ROOT / "docs" / "stage1.md")
    assert ("the-fast-path" in anchors(ROOT / "docs" / "stage1.md")
            and "no-such-section" not in anchors(ROOT / "docs" / "stage1.md"))


def test_every_test_the_docs_cite_exists():
    """A chapter that cites `test_x` as its proof cites a test function or file of tests/."""
    code = "\n".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))
    defined = (set(re.findall(r"def (test_\w+)", code))
               | {p.stem for p in (ROOT / "tests").glob("test_*.py")})
    cited = {
        (path.name, t)
        for path in DOCS
        for t in re.findall(r"`(?:tests/)?(test_\w+?)(?:\.py)?`", path.read_text())
    }
    assert len(cited) > 20 and {c for c in cited if c[1] not in defined} == set()


# ---- the map's tests column ----

def test_a_chapters_tests_are_those_its_part_of_the_chapter_names(tmp_path):
    """course/chapter_tests.py on a chapter of its own: a row gathers the test files its part
    names, by path or by a test's name (one name may stand in two files); a link to the whole
    document leaves out the parts other rows link to; a `#` line in a code block is no heading;
    a test or a heading that does not exist is an error, not an empty cell."""
    tests, docs = tmp_path / "tests", tmp_path / "docs"
    tests.mkdir(), docs.mkdir()
    (tests / "test_a.py").write_text("def test_alpha():\n    pass\n")
    (tests / "test_b.py").write_text("def test_beta():\n    pass\n\n\ndef test_alpha():\n"
                                     "    pass\n")
    (tests / "test_c.py").write_text("")
    (docs / "ch.md").write_text(
        "# Chapter\n\n`test_beta` checks the start.\n\n## 1. One\n\n```bash\n"
        "# not a heading, and `tests/test_c.py` belongs to section 1\n```\n\n"
        "## 2. Two\n\n`test_alpha`\n\n# Later\n\nThe whole chapter: `tests/test_c.py`.\n")
    table = ("| # | chapter | tests |\n|---|---|---|\n| 1 | [ch](ch.md) | — |\n"
             "| 2 | [one](ch.md#1-one) | x |\n| 3 | [two](ch.md#2-two) | — |")
    cells = [line.split(" | ")[2].rstrip(" |")
             for line in chapter_tests.tests_column(table, docs, tests).splitlines()[2:]]
    assert cells == ["`test_b.py`, `test_c.py`", "`test_c.py`", "`test_a.py`, `test_b.py`"]
    for text, error in (("`test_gone` proves it.", "test_gone"),
                        ("`tests/test_gone.py`", "test_gone.py")):
        (docs / "ch.md").write_text(f"# Chapter\n\n{text}\n\n## 1. One\n\n## 2. Two\n")
        with pytest.raises(ValueError, match=error):
            chapter_tests.tests_column(table, docs, tests)
    with pytest.raises(ValueError, match="no heading #3-three"):
        chapter_tests.tests_column(table.replace("#2-two", "#3-three"), docs, tests)


def test_the_maps_tests_column_is_what_each_chapter_names():
    """docs/README.md's tests column is what chapter_tests writes (bench report writes it, and
    `report --check` fails on a cell edited by hand); every chapter names a test file of tests/."""
    text = (ROOT / "docs" / "README.md").read_text()
    table = text.split("<!-- report: lines -->\n", 1)[1].split("<!-- /report -->", 1)[0]
    assert chapter_tests.tests_column(table) == table
    edited = table.replace("`test_stage1_prefill_gemm.py`, ", "", 1)
    assert edited != table and chapter_tests.tests_column(edited) == table
    column = table.splitlines()[0].split(" | ").index("tests")
    cells = [line.split(" | ")[column] for line in table.splitlines()[2:]]
    one = r"`test_\w+\.py`"
    assert len(cells) > 15 and all(re.fullmatch(rf"{one}(, {one})*", c) for c in cells)
    assert all((ROOT / "tests" / f).is_file() for c in cells for f in re.findall(r"`(.+?)`", c))
    prefix_cache = next(line for line in table.splitlines() if "prefix caching" in line)
    assert "`test_stage3_block_manager.py`" in prefix_cache


# ---- the rungs, one list ----

def test_rung_names_and_numbers_come_from_the_series():
    """docs/stage3.md's patch table, the course's map, the saved counted ladder and every
    "rung00 … rungNN" the docs and course/series.py write name the patches that exist."""
    sys.path.insert(0, str(ROOT / "course"))
    import series
    names = [p.stem for p in series.patches()]
    last = f"rung{len(names):02d}"
    stage3 = (ROOT / "docs" / "stage3.md").read_text()
    assert re.findall(r"^\| `(\d\d-[\w-]+)\.patch` \|", stage3, re.M) == names
    course_map = (ROOT / "docs" / "README.md").read_text()
    assert re.findall(r"`docs/lessons/stage3/(\d\d-[\w-]+)\.patch`", course_map) == names
    saved = json.loads((ROOT / "docs" / "figures" / "lessons.json").read_text())
    assert [r["name"] for r in saved["rows"]] == ["00-stage2", *names]
    spans = [(path, m) for path in [ROOT / "course" / "series.py", *DOCS]
             for m in re.finditer(r"rung00 *(?:\.\.\.?|…) *(?:\S*/)?(rung\d\d)", path.read_text())]
    assert len(spans) >= 3
    for path, m in spans:
        assert m.group(1) == last, (
            f"{path.relative_to(ROOT)} says {m.group(0)!r}; the series ends at {last}"
        )


# ---- sizes ----

def test_the_front_door_sizes():
    lines = lambda p: len((ROOT / p).read_text().splitlines())  # noqa: E731
    assert (
        lines("README.md") <= 120
        and lines("docs/benchmarks.md") <= 300
        and lines("docs/stage1.md") <= 840      # the fast path's sections and the verify step's
    )
    assert (
        not (ROOT / "docs" / "benchmarks-log.md").exists()
        and (ROOT / "docs" / "README.md").is_file()
    )
    assert "docs/README.md" in (ROOT / "README.md").read_text()
    assert (ROOT / "README.md").read_text().count("<!-- report: cpu -->") == 1
