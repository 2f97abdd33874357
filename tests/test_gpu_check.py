"""bench/gpu_check.sh's plumbing, on a CPU (--dry-run): the GPU machine is lent rarely
and briefly, so the one script must work the first time. Checked here: the step caps add
up, OUT receives at most 6 small files with names the device tool brings back, heavy
files stay in the work folder, failures and GPU-test skips (QS_REQUIRE_GPU=1) fail the
run and reach stdout with their tracebacks, a step that outlives its cap is cut and
reported, and a machine without CuPy fails in seconds with a message."""
from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

import gpu_check_report as report      # tests/: the junit helpers of bench/gpu_check.sh

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
OUT_NAMES = {"summary.md", "logs.tar.gz", "gpu_bench.md", "gpu_bench.json", "gpu_tests.xml",
             "host_costs.json"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """One work folder for the module: the dry run's tiny model is written once."""
    return tmp_path_factory.mktemp("gpu-check-work")


def fake_sanitizer(folder: Path, refuses: bool = False, hangs: str = "") -> str:
    """A compute-sanitizer stand-in: drops its own options and runs the program, or refuses
    the device as compute-sanitizer does on gVisor, or (hangs=TOOL) outlives any cap with
    that tool."""
    path = folder / ("refusing-sanitizer" if refuses else f"sanitizer{hangs}")
    if refuses:
        path.write_text('#!/bin/sh\necho "========= Error: Device not supported"\nexit 1\n')
    else:
        path.write_text(f'#!/bin/bash\n[ "$2" = "{hangs or "-"}" ] && exec sleep 600\n'
                        'while [[ "$1" == --* ]]; do shift 2; done\nexec "$@"\n')
    path.chmod(0o755)
    return str(path)


def run(
    out: Path, work: Path, *args: str, timeout: int = 600, **env
) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, OUT=str(out), QS_WORK=str(work), **env)
    for k in ("QS_DRY_FAIL", "QS_DRY_HANG", "QS_DRY_STANDINS", "QS_REQUIRE_GPU", "QS_GPU_DRY_RUN",
              "COMPUTE_SANITIZER"):
        if k not in env:
            full_env.pop(k, None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT)


def test_dry_run_passes_and_brings_back_at_most_six_small_files(tmp_path, work):
    out = tmp_path / "out"
    r = run(out, work, "--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    files = {p.name for p in out.iterdir()}
    # (costs: a GPU)
    assert files == OUT_NAMES - {"host_costs.json"} and all(p.is_file() for p in out.iterdir())
    assert all(p.stat().st_size < 2**20 for p in out.iterdir())
    summary = (out / "summary.md").read_text()
    # a dry run passes its CPU part and names what it could not run
    assert ("Result: PASS on the CPU (a dry run); not run, they need a GPU: the engine's GPU "
            "tests, compute-sanitizer\n") in summary
    assert "| sanitizer | 42 |" in summary and "**not run**: it needs a GPU" in summary
    assert "Caps add up to 300 s of 300" in summary
    for step, cap in (("probe", 10), ("kernel_tests", 25), ("engine_tests", 40), ("benchmark", 115),
                      ("lessons", 65), ("sanitizer", 42), ("pack", 3)):
        assert f"| {step} | {cap} |" in summary, step
    # the lesson ladder: every rung's host calls, and its tok/s on the twins
    lessons_row = next(l for l in summary.splitlines() if l.startswith("| lessons |"))
    assert lessons_row.endswith("| ok |"), lessons_row
    ladder = (out / "gpu_bench.md").read_text().split("### Lesson ladder")[1]
    assert "| output tok/s (cpu) |" in ladder and "| host µs (eager) |" in ladder
    rows = [l for l in ladder.splitlines() if l.startswith("| ")][1:]          # (the header first)
    assert len(rows) == len(list((ROOT / "docs" / "lessons" / "stage3").glob("*.patch"))) + 1 == 18
    for line in rows:
        tok_s = line.rstrip(" |").rsplit("| ", 1)[1]
        assert float(tok_s.split()[0]) > 0, line
    # the kernel step ran stage 3's GPU kernel tests on the emulated kernels, besides the stand-in
    kernel_row = next(l for l in summary.splitlines() if l.startswith("| kernel_tests |"))
    passed = int(kernel_row.split("|")[4].split()[0])
    assert passed >= 20 and " 0 failed, 0 errors" in kernel_row, kernel_row
    engine_row = next(l for l in summary.splitlines() if l.startswith("| engine_tests |"))
    assert "1 passed, 0 failed" in engine_row
    # stdout: the summary and the benchmark table, every row of it run on the twins
    assert "Result: PASS on the CPU" in r.stdout and "# Stage 3 on CPU (--dry-run)" in r.stdout
    bench = (out / "gpu_bench.md").read_text()
    for row in ("batch-1 decode, CUDA graphs", "the same, eager", "transformers, static cache",
                "8B shape, 4 layers", "nano-vllm workload, 4 seqs",
                "prefill attention, tensor cores"):
        line = next(l for l in bench.splitlines() if row in l)
        assert line.split("|")[2].strip() != "—" and "not run" not in line, line
    # the host-time profile: cProfile's table of the functions with the most own time
    profile = bench.split("Host time of 10 eager decode steps")[1].split("```")[1].splitlines()
    assert "tottime" in profile[1] and sum(".py:" in line for line in profile) >= 5, profile
    # the heavy things are in the work folder, the logs in the archive
    assert (work / "bench" / "tiny-qwen3-0.6b-random" / "config.json").is_file()
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"logs/kernel_tests.log", "logs/engine_tests.log", "logs/bench.log", "logs/lessons.log",
            "logs/summary.md", "bench/b1.json", "bench/lessons.json"} <= names
    assert not any("tiny-qwen3" in n for n in names)
    junit = (out / "gpu_tests.xml").read_text()
    assert "test_kernel_stand_in_passes" in junit and "test_engine_stand_in_passes" in junit
    for name in ("test_prefill_tensor_cores_equal_the_plain_kernel_and_the_twin",
                 "test_decode_attention_with_splits_of_8",
                 "test_sample_equals_twin_with_temperature_top_k_and_top_p",
                 "test_bf16_linear_equals_twin", "test_gemv_projections_equal_twins",
                 "for_the_sanitizer"):
        assert name in junit, name


def test_dry_run_reports_failures_gpu_skips_and_timeouts(tmp_path, work):
    out = tmp_path / "out"
    r = run(out, work, "--dry-run", QS_DRY_FAIL="1", QS_DRY_HANG="1", QS_DRY_STANDINS="1",
            QS_CAP_ENGINE="5", QS_CAP_BENCH="5", QS_CAP_LESSONS="5",
            COMPUTE_SANITIZER=fake_sanitizer(tmp_path, refuses=True))
    assert r.returncode == 1, r.stdout + r.stderr
    summary = (out / "summary.md").read_text()
    assert "Result: FAIL" in summary
    assert "**1 passed, 1 failed, 1 errors" in summary          # the skipped GPU test is an error
    assert "| engine_tests | 5 |" in summary and "**timed out** after 25 s" in summary
    assert (
        "compute-sanitizer refuses this machine (========= Error: Device not supported)" in summary
    )
    # the failing test's traceback and the skip's reason reach stdout
    assert (
        "gpu_check_dry::test_kernel_stand_in_fails" in r.stdout and "a planted failure" in r.stdout
    )
    assert "QS_REQUIRE_GPU=1 and this GPU test skipped" in r.stdout
    assert len(list(out.iterdir())) <= 6


def test_a_step_that_ran_out_of_time_is_never_a_pass(tmp_path, work):
    """Nothing fails, but racecheck outlives the sanitizer's cap (memcheck is clean): its row
    says so, and so does the last line, NOT COMPLETE with exit 3, where PASS would hide that
    the sanitizer's signal is missing (v1 wrote "timed out" in the row and PASS below it)."""
    out = tmp_path / "out"
    r = run(out, work, "--dry-run", QS_DRY_STANDINS="1", QS_CAP_SANITIZE="7",
            COMPUTE_SANITIZER=fake_sanitizer(tmp_path, hangs="racecheck"))
    assert r.returncode == 3, r.stdout + r.stderr
    summary = (out / "summary.md").read_text()
    sanitizer = next(line for line in summary.splitlines() if line.startswith("| sanitizer |"))
    assert "memcheck: clean (1 tests); **racecheck: timed out** after" in sanitizer
    verdict = summary.split("Result:")[1]
    assert verdict.startswith(" NOT COMPLETE: nothing failed, but not run: sanitizer "
                              "(racecheck timed out after")
    assert "PASS" not in verdict


def test_caps_that_do_not_add_up_are_refused(tmp_path, work):
    r = run(tmp_path / "out", work, "--dry-run", QS_CAP_BENCH="200", timeout=30)
    assert r.returncode == 2 and "add up to 385 s, more than 300 s" in r.stderr


def test_a_work_folder_inside_out_is_refused(tmp_path):
    out = tmp_path / "out"
    r = run(out, out / "work", "--dry-run", timeout=30)
    assert r.returncode == 2 and "inside OUT" in r.stderr


def test_without_cupy_it_fails_in_seconds_with_a_message(tmp_path, work):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here: the no-CuPy path cannot be shown")
    except ImportError:
        pass
    out = tmp_path / "out"
    r = run(out, work, timeout=120)        # a hang fails here; a slow machine is not a failure
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no interpreter with cupy found" in r.stdout
    assert "no interpreter with cupy found" in (out / "summary.md").read_text()


def test_bench_caps_add_up_within_the_deadline_and_serve_gets_the_rest():
    from bench.gpu import CAPS, plan
    steps = plan(150)
    assert list(steps) == list(CAPS) and list(steps)[0] == "setup"
    assert sum(steps.values()) <= 150 and steps["serve"] >= CAPS["serve"]
    assert plan(400)["serve"] == 400 - 5 - sum(v for k, v in CAPS.items() if k != "serve")


def test_bench_gpu_step_skipped_for_lack_of_time_is_not_a_failure():
    """bench.gpu exits 3 (gpu_check.sh: "ok, but a step ran out of time"), not 1 (FAIL), when a
    step was skipped for want of time; a step skipped because setup made no model is a failure."""
    from bench.gpu import OUT_OF_TIME, exit_status
    assert exit_status(["ok", "ok"]) == 0
    assert exit_status(["ok", OUT_OF_TIME]) == 3
    assert exit_status(["ok", "timed out after 30 s"]) == 3
    assert exit_status(["failed: setup", "skipped: the setup step made no model"]) == 1
    assert exit_status(["ok", "skipped: the setup step made no model"]) == 1
    assert exit_status(["ok", "failed: boom", OUT_OF_TIME]) == 1


def test_report_names_a_stage_none_of_whose_gpu_tests_passed(tmp_path):
    """The kernel step fails when a stage's GPU test file passed nothing (all skipped, or
    absent)."""
    xml = tmp_path / "k.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="tests.test_stage2_gpu" name="a"/>'
                   '<testcase classname="tests.test_stage3_gpu" name="b"><skipped/></testcase>'
                   '</testsuite></testsuites>')
    assert report.stages_without_a_pass(str(xml), ["stage2", "stage3"]) == ["stage3"]
    assert report.stages_without_a_pass(str(xml), ["stage2"]) == []
