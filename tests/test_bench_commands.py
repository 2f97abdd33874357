"""Every `python -m bench` command runs end to end on a tiny model and prints the rows it
promises, and every file of bench/ serves a command that `python -m bench --help` lists.

(bench gpu and bench lessons have theirs beside the GPU work: tests/test_gpu_check.py,
tests/test_stage3_lessons.py; bench profile's, op by op, is tests/test_bench_profile.py.)
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import stage1_cpu
from bench import report

ROOT = Path(__file__).resolve().parent.parent
# cold numba compiles in the workers (the fast path: --kernels auto)
pytestmark = pytest.mark.timeout(1200)


def bench(*args: str, timeout: float = 800) -> str:
    out = subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def table(text: str, first_header: str) -> list[list[str]]:
    """The rows of the markdown table whose header starts with `first_header`, as cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} "))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_help_lists_every_command_and_every_bench_file_serves_one():
    from bench.__main__ import COMMANDS
    text = bench("--help")
    for name, (_, what) in COMMANDS.items():
        assert re.search(rf"^  {name}\s+{re.escape(what)}$", text, re.M), name
    # reachable: the commands' modules, what they import from bench/, and the files they name
    files = {
        p.name for p in (ROOT / "bench").iterdir() if p.is_file() and p.suffix in (".py", ".sh")
    }
    seen, todo = (
        {"__init__.py", "__main__.py"},
        [module.split(".")[1] + ".py" for module, _ in COMMANDS.values()],
    )
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        text = (ROOT / "bench" / name).read_text()
        named = {f for f in files if f in text}
        if name.endswith(".py"):
            for node in ast.walk(ast.parse(text)):
                if (
                    isinstance(node, ast.ImportFrom)
                    and node.module
                    and node.module.startswith("bench")
                ):
                    parts = node.module.split(".")[1:] + [a.name for a in node.names]
                    named |= {f"{p}.py" for p in parts if f"{p}.py" in files}
        todo += sorted(named - seen)
    assert files - seen == set(), "bench files no listed command reaches"


def test_bench_stays_within_its_line_budget():
    """bench/ is a tool of a few commands: `wc -l bench/*` within 4,300 lines at 100 columns
    (docs/benchmarks.md): 3,500 with the serving and speculative benchmarks, 300 more for the
    busy-machine runs, the verify-cost curve and the decode step's profile by part, 450 more
    for its lines wrapped at 100 columns, and 50 for the speculative table's decode speeds and
    prompt lookup's reach."""
    total = sum(len(p.read_bytes().splitlines()) for p in (ROOT / "bench").iterdir() if p.is_file())
    assert total <= 4300, f"bench/ is {total} lines"


@pytest.mark.parametrize("shape,engines,kernels", [("tiny", "stage1", "plain,auto"),
                                                    ("moe-tiny", "stage1,transformers", "plain")])
def test_cpu_measures_every_engine_and_prints_its_tables(tmp_path, shape, engines, kernels):
    out = bench("cpu", "--shape", shape, "--quick", "--threads", "1", "--formats", "int8",
                "--engines", engines,
                "--kernels", kernels, "--runs", "1", "--prompt-lens", "8,24", "--ttft-lens", "12",
                "--decode-prompt", "8", "--decode-tokens", "4", "--cache-dir", str(tmp_path),
                "--out", str(tmp_path / "report.md"),
                "--save", str(tmp_path / "docs" / "results" / "cpu-x.json"))
    assert (tmp_path / "report.md").read_text().strip() in out
    labels = ["stage1" if k == "auto" else f"stage1 {k}" for k in kernels.split(",")]
    # stage 1 ÷ llama.cpp (none here: its cells "–")
    headline = table(out, "stage 1")
    whats = ["decode tok/s", "prefill 8 tok/s", "prefill 24 tok/s", "first token, 12-token prompt"]
    assert [(r[0], r[2]) for r in headline] == [
        (label, w) for label in sorted(labels) for w in whats
    ]
    assert all(re.fullmatch(r"[\d.]+( ms)? \(PASSIVE\)", r[3]) and r[4] == "–"
               for r in headline), out
    engines_table = table(out, "engine")
    # the oracle untimed
    assert [(r[0], r[1]) for r in engines_table] == [(label, "int8") for label in labels]
    for row in engines_table:      # decode tok/s, and its GB/s: tok/s x MB/token (to 0 decimals)
        mb, tok, gbs = (float(row[i].replace(",", "")) for i in (2, 3, 4))
        assert tok > 0 and abs(gbs - tok * mb / 1e3) <= 0.05 + tok * 0.5 / 1e3, row
    if "transformers" in engines:                                  # the oracle: checked, not timed
        check = {(r[0], r[1]): r[-1] for r in engines_table}
        # cosine of the logits
        assert float(check[("stage1 plain", "int8")].split(" / ")[1]) > 0.99
    else:
        assert "logits not checked (transformers fp32 did not run)" in out
    # --save: what `bench report` writes the docs' tables from, the same figures as the headline's
    saved = json.loads((tmp_path / "docs" / "results" / "cpu-x.json").read_text())
    assert saved["command"].startswith("python -m bench cpu --shape") and saved["threads"] == [1]
    assert (
        {"machine", "date", "cpu_flags", "versions", "isa", "rows"} <= set(saved)
        and saved["isa"]
    )
    assert table(report.cpu_full(tmp_path), "stage 1") == headline


def test_cpu_busy_runs_quiet_then_beside_a_busy_process_and_report_writes_its_table(tmp_path):
    """bench cpu --busy 1: the comparison quiet, then beside one process keeping a core busy (its
    CPU time says it did), stage 1 at its default, its own choice (the variable unset, as users run
    it); bench report writes the docs' busy table from the saved run: each figure, and under load
    its share of the quiet one, as the saved JSON has them, and as the run printed them."""
    save = tmp_path / "docs" / "results" / "busy.json"
    out = bench("cpu", "--shape", "tiny", "--quick", "--busy", "1", "--threads", "1", "--formats",
                "int8", "--engines", "stage1", "--kernels", "plain", "--runs", "1", "--prompt-lens",
                "8", "--ttft-lens", "", "--decode-prompt", "8", "--decode-tokens", "4",
                "--omp-wait-policy", "default", "--cache-dir", str(tmp_path), "--save", str(save))
    assert re.search(r"=== beside 1 busy process \(pids \[\d+\]\)", out), out
    saved = json.loads(save.read_text())
    quiet, busy = saved["loads"]
    assert (quiet["busy"], quiet["busy_cores"], busy["busy"]) == (0, 0, 1)
    assert busy["busy_cores"] > 0.03                   # a sleeping one: its start-up alone, < 0.01
    assert busy["ran_as"] == quiet["ran_as"] == {"stage1 plain": stage1_cpu.WAIT_POLICY}
    rows = table(report.rewrite("<!-- report: busy -->\n<!-- /report -->\n", tmp_path), "engine")
    assert rows == table(out.split("### Beside busy processes")[1], "engine")
    default = f"default ({stage1_cpu.WAIT_POLICY})"
    wanted = [("decode", "decode tok/s", default), ("decode", "decode tok/s", "best"),
              ("8", "prefill 8 tok/s", default), ("8", "prefill 8 tok/s", "best")]
    assert [r[3:5] for r in rows] == [[what, policy] for _, what, policy in wanted]
    for row, (metric, _, policy) in zip(rows, wanted):
        kind = policy.split()[0]
        q, b = (next(x["value"] for x in load[kind] if x["metric"] == metric)
                for load in saved["loads"])
        best = "default, " if kind == "best" else ""     # the best's policy: the only one run
        assert row[5] == f"{q:.1f}" + " (default)" * bool(best)
        assert row[6] == f"{b:.1f} ({best}{100 * b / q:.0f} %)"


def test_ladder_prints_each_rung_decode_and_prefill(tmp_path):
    out = bench("ladder", "--quick", "--layers", "1", "--tokens", "2", "--prefill-tokens", "16",
                "--save", str(tmp_path / "ladder.json"))
    rungs = table(out, "rung")
    assert (
        [r[0] for r in rungs[:4]] == ["1", "2", "3", "4"]
        and rungs[0][2] == "int8"
        and rungs[3][2] == "int4"
    )
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in rungs)          # ms per token, GB/s
    prefill = table(out.split("Prefill ladder")[1], "rung")
    assert prefill[0][0] == "P1" and float(prefill[0][4]) > 0
    saved = json.loads((tmp_path / "ladder.json").read_text())
    assert (
        len(saved["rows"]) == len(rungs)
        and saved["command"].startswith("python -m bench ladder")
    )


def test_figures_draws_every_figure_from_saved_results(tmp_path):
    from bench.figures import DRAW, FIGURES
    results = tmp_path / "results"
    shutil.copytree(FIGURES, results, ignore=shutil.ignore_patterns("*.svg", "*.png"))
    out = bench("figures", "--results", str(results), "--out", str(tmp_path / "out"))
    # (the speculative figure: once its JSON is saved, as it is)
    names = [*DRAW, "stage1_speculative"]
    assert out.split() == [str(tmp_path / "out" / f"{name}.svg") for name in names]
    assert all(
        (tmp_path / "out" / f"{name}.svg").read_text().lstrip().startswith("<?xml")
        for name in names
    )


def test_ik_llama_bench_is_read_at_its_best_policy_and_repack(tmp_path):
    """--ik-bench: llama-bench's JSON read per test (n_prompt 0 is decode), the best of the wait
    policies and -rtr kept with its label, and bench report's full table gains the ik_llama.cpp
    column. A stand-in llama-bench prints what the real one prints (the fields read: n_prompt,
    n_gen, avg_ts)."""
    from types import SimpleNamespace

    from bench import cpu
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\na = sys.argv\n"
                    "rtr = int(a[a.index('-rtr') + 1])\n"
                    "passive = os.environ.get('OMP_WAIT_POLICY') == 'PASSIVE'\n"
                    "print(json.dumps([dict(n_prompt=int(p), n_gen=0, avg_ts=100.0 + 50 * rtr) "
                    "for p in a[a.index('-p') + 1].split(',')]"
                    " + [dict(n_prompt=0, n_gen=16, avg_ts=30.0 + 5 * passive)]))\n")
    fake.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    args = SimpleNamespace(ik_bench=fake, formats=["int8"], omp_wait_policy="both",
                           prompt_lens=[8, 24], decode_tokens=16, threads=[1, 2], runs=1,
                           worker_timeout=60)
    got = {
        b["metric"]: (b["value"], b["policy"])
        for b in cpu.ik_llama_bench(args, {"Q8_0": gguf}, lambda s: None)
    }
    assert got == {
        "8": (150.0, "PASSIVE, -rtr 1"),
        "24": (150.0, "PASSIVE, -rtr 1"),
        "decode": (35.0, "PASSIVE, -rtr 0"),
    }
    run = dict(command="c", date="d", machine="m", cpu_flags=["avx2"], cpu_profile="native",
               shape="qwen3-0.6b-shape", threads=[2], others_cores=0, versions={}, best=[
                   dict(engine="stage1", format="int8", threads=2, metric="8", policy="PASSIVE",
                        value=300.0),
                   *(dict(b, format="Q8_0", threads=2, engine="ik_llama.cpp") for b in
                     cpu.ik_llama_bench(args, {"Q8_0": gguf}, lambda s: None))])
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "cpu-x.json").write_text(json.dumps(run))
    rows = table(report.cpu_full(tmp_path), "stage 1")
    assert rows == [["stage1", "int8 / Q8_0", "prefill 8 tok/s", "300.0 (PASSIVE)", "–", "–",
                     "150.0 (PASSIVE, -rtr 1)", "2.00×"]], rows
