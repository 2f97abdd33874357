"""bench/cpu.py's plans, workers and headline, and bench/ladder.py's naive rung, without running
any engine.

The benchmark's numbers come from subprocess workers; what decides which runs are made
and which figure the headline quotes is plain Python, checked here on made-up results.
bench cpu --busy's busy processes (bench/common.py busy_cores) are checked here too.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench import cpu as bench_cpu
from bench import figures
from bench import report
from bench.common import busy_cores

ROOT = Path(__file__).resolve().parent.parent
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


def _cell(decode: float, p128: float, p512: float, ttft37: float = 0.5) -> dict:
    return {"prefill": {"32": [p128 / 2], "128": [p128], "512": [p512]}, "decode": [decode],
            "decode_bw": [30.0], "ttft": {"37": [ttft37], "300": [2 * ttft37]}, "runs": 1}


def test_full_run_measures_both_policies_and_the_second_one_smaller():
    args = bench_cpu.parse_args([])
    plans = bench_cpu.table_plans(args)
    assert [p["policy"] for p in plans] == ["PASSIVE", "default"]
    assert plans[0]["threads"] == [1, 2] and plans[0]["check"]
    assert plans[1]["threads"] == [2] and not plans[1]["check"]


def test_quick_run_is_passive_only_unless_asked():
    quick = bench_cpu.table_plans(bench_cpu.parse_args(["--quick"]))
    assert [p["policy"] for p in quick] == ["PASSIVE"]
    both = bench_cpu.table_plans(bench_cpu.parse_args(["--quick", "--omp-wait-policy", "both"]))
    assert [p["policy"] for p in both] == ["PASSIVE", "default"]


def _tables(args, stage1_passive, llama_passive, stage1_default, llama_default, label="stage1"):
    plans = bench_cpu.table_plans(args)
    return [{"plan": plans[0],
             "rows": [bench_cpu.Row(label, "int8", 1, {"cells": {"2": stage1_passive}}),
                      bench_cpu.Row("llama.cpp", "Q8_0", 1, {"cells": {"2": llama_passive}})]},
            {"plan": plans[1],
             "rows": [bench_cpu.Row(label, "int8", 1, {"cells": {"2": stage1_default}}),
                      bench_cpu.Row("llama.cpp", "Q8_0", 1, {"cells": {"2": llama_default}})]}]


def _headline_rows(args, tables) -> dict[str, str]:
    best = bench_cpu.best_by_policy(args, tables)
    text = "\n".join(bench_cpu.headline(args, best))
    header = next(line for line in text.splitlines() if line.startswith("| stage 1"))
    # no target column
    assert [c.strip() for c in header.strip("|").split("|")] == ["stage 1", "formats", "what",
                                                                "stage 1", "llama.cpp", "ratio"]
    return {line.split("|")[3].strip(): line for line in text.splitlines()
            if line.startswith("| stage1")}


def test_headline_takes_each_engine_at_its_own_best_policy():
    args = bench_cpu.parse_args(["--threads", "2", "--formats", "int8"])
    tables = _tables(args, _cell(40.0, 100.0, 200.0), _cell(20.0, 90.0, 150.0),
                     _cell(38.0, 110.0, 190.0), _cell(32.0, 80.0, 250.0))
    best = bench_cpu.best_by_policy(args, tables)
    assert best[("stage1", "int8", 2, "decode")][:2] == (40.0, "PASSIVE")
    assert best[("llama.cpp", "Q8_0", 2, "decode")][:2] == (32.0, "default")
    assert best[("llama.cpp", "Q8_0", 2, 512)][:2] == (250.0, "default")
    rows = _headline_rows(args, tables)
    assert "40.0 (PASSIVE)" in rows["decode tok/s"] and "32.0 (default)" in rows["decode tok/s"]
    # 40 PASSIVE / 32 default
    assert "1.25×" in rows["decode tok/s"]
    assert "0.80×" in rows["prefill 512 tok/s"]                                      # 200 / 250


def test_headline_ranks_time_to_first_token_by_the_smaller_time():
    """TTFT: the smaller time wins, the ratio is llama.cpp's time / stage 1's; the prefill and
    decode ratios are read off the best-policy figures."""
    args = bench_cpu.parse_args(["--threads", "2", "--formats", "int8"])
    rows = _headline_rows(args, _tables(args, _cell(40.0, 170.0, 200.0, ttft37=0.25),
                                        _cell(20.0, 100.0, 150.0, ttft37=0.6),
                                        _cell(38.0, 110.0, 190.0, ttft37=0.4),
                                        _cell(32.0, 80.0, 100.0, ttft37=0.5)))
    first = rows["first token, 37-token prompt"]
    # 0.5 s / 0.25 s
    assert "250 ms (PASSIVE)" in first and "500 ms (default)" in first and "2.00×" in first
    # 170 PASSIVE / 100 PASSIVE
    assert "1.70×" in rows["prefill 128 tok/s"]
    assert "1.33×" in rows["prefill 512 tok/s"]                                      # 200 / 150
    assert "1.25×" in rows["decode tok/s"]


def test_moe_headline_has_a_row_per_kernel_set_and_the_engine_table_its_roofline():
    """On a MoE shape: one row per kernel set, and decode's fraction of its roofline in the engine
    table: 30 tok/s x 1 GB a token at 40 GB/s is 75 %."""
    args = bench_cpu.parse_args(
        ["--shape", "moe", "--threads", "2", "--formats", "int8", "--kernels", "plain"]
    )
    stage1 = dict(_cell(30.0, 100.0, 90.0), decode_bw=[40.0])
    tables = _tables(args, stage1, _cell(20.0, 90.0, 100.0), stage1, _cell(20.0, 90.0, 100.0),
                     label="stage1 plain")
    for t in tables:
        t["rows"][0].weight_bytes = 10**9
    rows = _headline_rows(args, tables)
    assert (
        set(rows) >= {"decode tok/s", "prefill 512 tok/s"}
        and rows["decode tok/s"].startswith("| stage1 plain")
    )
    assert "1.50×" in rows["decode tok/s"] and "0.90×" in rows["prefill 512 tok/s"]
    # and its % roofline
    table = bench_cpu.engine_table(args, bench_cpu.best_by_policy(args, tables), {}, 2)
    assert [c.strip() for c in table.splitlines()[2].split("|")][1:7] == ["stage1 plain", "int8",
                                                                          "1,000", "30.0", "30.0",
                                                                          "75"]


def test_each_worker_gets_the_activations_and_its_kernel_set(tmp_path, monkeypatch):
    """--activations int8 --kernels auto,plain: stage 1's workers (one per kernel set) get int8;
    without llama-cpp-python llama.cpp's cell says so and no worker starts for it."""
    seen = []

    def fake_worker(module, spec, timeout, log, omp_wait_policy):
        seen.append((spec["engine"], spec["kernels"], spec["activations"]))
        return {"error": "not run here"}
    monkeypatch.setattr(bench_cpu, "run_worker", fake_worker)
    monkeypatch.setattr(bench_cpu, "llama_cpp_installed", lambda: True)
    plan = {"policy": "PASSIVE", "threads": [2], "check": False}
    paths = {"hf": tmp_path, "Q8_0": tmp_path / "q8.gguf"}
    args = bench_cpu.parse_args(["--shape", "moe-quick", "--quick", "--engines", "stage1,llama.cpp",
                                 "--formats", "int8", "--kernels", "auto,plain",
                                 "--activations", "int8"])
    rows, _ = bench_cpu.run_table(args, args.shape, paths, lambda s: None, plan)
    assert seen == [
        ("stage1", "auto", "int8"),
        ("stage1", "plain", "int8"),
        ("llama.cpp", "auto", "int8"),
    ]
    assert [r.engine for r in rows] == ["stage1", "stage1 plain", "llama.cpp"]
    seen.clear()
    monkeypatch.setattr(bench_cpu, "llama_cpp_installed", lambda: False)
    rows, _ = bench_cpu.run_table(args, args.shape, paths, lambda s: None, plan)
    assert [engine for engine, _, _ in seen] == ["stage1", "stage1"]
    assert next(r.result["error"] for r in rows if r.engine == "llama.cpp") == "not installed"


def test_decode_bytes_count_the_k_chosen_experts_of_a_moe_token():
    """A MoE token reads the attention, the router, k of E experts per layer and the lm_head."""
    s = bench_cpu.SHAPES["moe-tiny"]
    C, L = s.hidden_size, s.num_hidden_layers
    attention = C * 4 * 32 + 2 * C * 2 * 32 + 4 * 32 * C
    assert s.linear_params() == L * (attention + 8 * C + 2 * 3 * C * 64) + 512 * C
    dense = bench_cpu.SHAPES["tiny"]
    assert dense.linear_params() == 2 * (attention + 3 * C * 256) + 512 * C


def test_ladder_naive_rung_equals_the_weights_own_definition():
    from bench import ladder
    rng = np.random.default_rng(3)
    # 100 is not a multiple of the group: padded
    w = ladder.random_weight(70, 100, "int8", rng)
    x = rng.standard_normal((1, 100), dtype=np.float32)
    buf = np.empty(w.out_features * w.padded_in, dtype=np.float32)
    got = ladder.dequant_then_matmul(w, x, buf)
    np.testing.assert_allclose(got, w.matmul_ref(x), rtol=1e-5, atol=1e-5)
    assert np.abs(got).max() > 0


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_ladder_matrices_have_the_model_shapes(fmt):
    from bench import ladder
    s = bench_cpu.SHAPES["quick"]
    mats = ladder.model_matrices(s, fmt, np.random.default_rng(0))
    assert len(mats) == 4 * s.num_hidden_layers + 1
    assert (mats[0].out_features, mats[0].in_features) == (
        (s.num_attention_heads + 2 * s.num_key_value_heads) * s.head_dim, s.hidden_size)
    assert mats[-1].fmt == "int8" and mats[-1].out_features == s.vocab_size
    assert {m.fmt for m in mats[:-1]} == {fmt}


def speculative_cells(root: Path, rows: list[dict]) -> dict:
    """bench report's speculative table from a run saved under root with these rows ->
    {(engine, drafts): the cells after the task}."""
    (root / "docs" / "figures").mkdir(parents=True)
    saved = dict(model="m.gguf", threads=2, peer="llama-cpp-python 0", machine="cpu", date="d",
                 rows=rows)
    (root / "docs" / "figures" / "stage1_speculative.json").write_text(json.dumps(saved))
    lines = [[c.strip() for c in line.strip("|").split("|")]
             for line in report.speculative(root).splitlines() if line.startswith("| ")]
    return {tuple(cells[:2]): cells[3:] for cells in lines}


def test_speculative_table_measures_each_engine_against_its_own_plain_decoding(tmp_path):
    """bench report's speculative table: decode tok/s, the speed-up over the same engine's plain
    run of the same prompt, tokens per forward pass and drafts accepted, from a saved run."""
    row = lambda engine, mode, seconds, steps, drafted, accepted: dict(  # noqa: E731
        engine=engine, mode=mode, task="code rewrite", prompt=0, tokens=65, seconds=seconds + 1,
        decode_seconds=seconds, steps=steps, drafted=drafted, accepted=accepted)
    cells = speculative_cells(tmp_path, [row("stage1", "plain", 2.0, 64, 0, 0),
                                         row("stage1", "ngram", 0.8, 20, 60, 45),
                                         row("llama.cpp", "plain", 1.0, 64, 0, 0),
                                         row("llama.cpp", "lookup", 1.5, 30, 50, 20)])
    # 80 tok/s over stage 1's own 32
    assert cells[("stage1", "ngram")] == ["80.0", "2.50x", "3.25", "75%", "–"]
    # over llama.cpp's own 64
    assert cells[("llama.cpp", "lookup")] == ["42.7", "0.67x", "2.17", "40%", "–"]
    assert cells[("stage1", "plain")] == ["32.0", "1.00x", "1.02", "–", "–"]


def test_older_saved_runs_with_read_only_rows_read_as_without_them(tmp_path):
    """Saved runs from before the read-only ceiling went carry "read only" rows in `rows` and
    `best`: bench report's CPU tables and the roofline figure read past them, as if they were not
    there."""
    saved = json.loads((report.ROOT / "docs" / "results" / "cpu-avx2.json").read_text())
    old = dict(saved,
               rows=saved["rows"] + [dict(saved["rows"][0], engine="read only", mb_per_token=9e3)],
               best=saved["best"] + [dict(b, engine="read only", value=99.0)
                                     for b in saved["best"]])
    for name, run in (("new", saved), ("old", old)):
        (tmp_path / name / "docs" / "results").mkdir(parents=True)
        (tmp_path / name / "docs" / "results" / "cpu-avx2.json").write_text(json.dumps(run))
    for table in (report.cpu_table, report.cpu_full):
        new = table(tmp_path / "new")
        assert table(tmp_path / "old") == new and "int8" in new and "Q8_0" in new
    drawn = [figures.stage1_roofline(run, tmp_path / name / "roofline.svg").read_text()
             for name, run in (("new", saved), ("old", old))]
    assert drawn[0] == drawn[1] and "stage1" in drawn[0]


def _state(pid: int) -> str:
    """A process's state letter (R running, S sleeping, Z a zombie), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "gone"


def test_busy_flags_need_the_default_policy_and_put_it_first():
    """--busy compares each engine as users run it: its default policy is measured first (every
    thread count), and a policy list without it is refused before anything runs."""
    plans = bench_cpu.table_plans(bench_cpu.parse_args(["--busy", "2"]))
    assert [p["policy"] for p in plans] == ["default", "PASSIVE"] and plans[0]["threads"] == [1, 2]
    quick = bench_cpu.table_plans(bench_cpu.parse_args(["--quick", "--busy", "1"]))
    assert [p["policy"] for p in quick] == ["default", "PASSIVE"]
    with pytest.raises(SystemExit):
        bench_cpu.parse_args(["--busy", "1", "--omp-wait-policy", "PASSIVE"])


@needs_proc
def test_busy_processes_keep_cores_busy_and_are_gone_when_the_block_ends():
    """Each busy process gets about the share of a core that this test, spinning beside them, gets
    (whatever else runs on the machine; one that slept would get its start-up alone, ~0.02), and
    none is left once the block ends."""
    with busy_cores(2) as busy:
        t0, cpu0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < 1.5:
            pass
        ours = (time.process_time() - cpu0) / (time.perf_counter() - t0)
        assert [_state(p) for p in busy["pids"]] == ["R", "R"]        # running, not waiting
    assert [_state(p) for p in busy["pids"]] == ["gone", "gone"]       # killed and reaped
    assert busy["cores"] / 2 > ours / 2, (busy, ours)


@needs_proc
def test_busy_processes_are_gone_after_ctrl_c_or_an_error():
    for error in (KeyboardInterrupt, RuntimeError):
        with pytest.raises(error):
            with busy_cores(1) as busy:
                time.sleep(0.2)
                raise error
        assert _state(busy["pids"][0]) == "gone"


@needs_proc
def test_busy_processes_end_by_themselves_when_the_benchmark_dies_outright():
    """A benchmark killed without cleaning up (os._exit stands in for SIGKILL) leaves no loop."""
    code = ("import os, time\nfrom bench.common import busy_cores\nblock = busy_cores(1)\n"
            "print(block.__enter__()['pids'][0], flush=True)\ntime.sleep(0.3)\nos._exit(0)")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    pid, deadline = int(run.stdout), time.time() + 10
    try:
        while _state(pid) not in ("gone", "Z") and time.time() < deadline:
            time.sleep(0.05)
        assert _state(pid) in ("gone", "Z")      # (Z: ended, waiting for its new parent to reap it)
    finally:
        if _state(pid) not in ("gone", "Z"):     # a loop left behind: this test's, so it stops it
            os.kill(pid, 9)


def test_speculative_speeds_are_the_decodes_after_the_first_token(tmp_path):
    """Rows that carry decode_seconds (the time after the first token): the table's speeds are
    the tokens after the first over that time, so a prefill that is the same work either way
    does not dilute the speed-up (over all the time, the same rows read 21.7 and 1.67x); and
    plain's rows carry the steps prompt lookup would take on their text: a task's reach is its
    prompts' tokens over their steps."""
    row = lambda mode, seconds, decode, steps, drafted, accepted, **kw: dict(  # noqa: E731
        engine="stage1", mode=mode, task="code rewrite", prompt=0, tokens=65, seconds=seconds,
        decode_seconds=decode, steps=steps, drafted=drafted, accepted=accepted, **kw)
    # two prompts' plain text: prompt lookup would make 4 and 2 tokens a step (16 and 32 steps)
    cells = speculative_cells(tmp_path, [row("plain", 3.0, 2.0, 65, 0, 0, lookup_steps=16),
                                         dict(row("plain", 3.0, 2.0, 65, 0, 0, lookup_steps=32),
                                              prompt=1),
                                         row("ngram", 1.8, 0.8, 26, 60, 39),
                                         dict(row("ngram", 1.8, 0.8, 26, 60, 39), prompt=1)])
    # 128 tokens in 48 steps of prompt lookup's: 2.67 (a mean of the ratios would say 3.00)
    assert cells[("stage1", "plain")] == ["32.0", "1.00x", "1.00", "–", "2.67"]
    assert cells[("stage1", "ngram")] == ["80.0", "2.50x", "2.50", "65%", "–"]
