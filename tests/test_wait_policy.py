"""Stage 1 chooses how numba's idle OpenMP threads wait, so that a user sets nothing
(stage1_cpu/__init__.py calls stage1_cpu/jit/numba_cache.py's wait_policy as the package loads).

libgomp, numba's omp layer, reads OMP_WAIT_POLICY once, in its constructor, when numba loads it
to start its threads (the first parallel kernel or thread-count call): the choice must be in the
environment by then. With OMP_DISPLAY_ENV=verbose libgomp prints what it read as it loads, and
its GOMP_SPINCOUNT tells the three apart: 0 (PASSIVE: sleep at once), 300000 (unset: its own
spin-then-sleep) and 30000000000 (ACTIVE). These tests read it from a real
`python -m stage1_cpu.generate`, and its banner.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stage1_cpu
from common.tiny_model import write_tiny_model
from stage1_cpu.jit import numba_cache

ROOT = Path(__file__).resolve().parent.parent
SPINCOUNT = {"PASSIVE": "0", "ACTIVE": "30000000000"}        # what libgomp reads for each
needs_omp = pytest.mark.skipif(importlib.util.find_spec("numba.np.ufunc.omppool") is None,
                               reason="numba has no omp layer here (macOS wheels)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny")


def generate(folder: Path, **env: str) -> subprocess.CompletedProcess:
    """generate on the plain kernels with OMP_WAIT_POLICY unset unless `env` sets it, libgomp
    showing what it reads."""
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = subprocess.run([sys.executable, "-m", "stage1_cpu.generate", "--model", str(folder),
                          "--kernels", "plain", "--prompt", "Hi", "--max-tokens", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env=dict(clean, PYTHONPATH=str(ROOT), OMP_DISPLAY_ENV="verbose", **env))
    assert run.returncode == 0, run.stderr
    return run


@needs_omp
def test_libgomp_reads_the_engines_choice_before_numba_starts_its_threads(tiny):
    """No OMP_WAIT_POLICY set: libgomp, loaded when numba starts its threads, has already read
    the engine's choice (without it: 300000, OpenMP's own spinning), and the banner says why."""
    run = generate(tiny, NUMBA_THREADING_LAYER="omp")
    assert f"GOMP_SPINCOUNT = '{SPINCOUNT[stage1_cpu.WAIT_POLICY]}'" in run.stderr, run.stderr
    policy = stage1_cpu.WAIT_POLICY
    how = {"PASSIVE": "sleep", "ACTIVE": "spin"}[policy]
    assert f"omp threads {how} when idle ({policy}, chosen: {stage1_cpu.WAIT_WHY})]" in run.stderr


@needs_omp
@pytest.mark.parametrize("user", ["ACTIVE", "PASSIVE"])
def test_a_users_setting_wins_and_the_banner_says_so(tiny, user):
    run = generate(tiny, NUMBA_THREADING_LAYER="omp", OMP_WAIT_POLICY=user)
    assert f"GOMP_SPINCOUNT = '{SPINCOUNT[user]}'" in run.stderr, run.stderr
    how = {"PASSIVE": "sleep", "ACTIVE": "spin"}[user]
    assert f"omp threads {how} when idle ({user}, as you set)]" in run.stderr, run.stderr


def test_on_workqueue_no_openmp_loads_and_the_banner_says_the_variable_is_not_its(tiny):
    """numba's own workqueue layer: libgomp never loads (no display), whatever the variable says."""
    run = generate(tiny, NUMBA_THREADING_LAYER="workqueue", OMP_WAIT_POLICY="ACTIVE")
    assert "OPENMP DISPLAY ENVIRONMENT" not in run.stderr, run.stderr
    assert "workqueue threads (OMP_WAIT_POLICY: omp only)]" in run.stderr, run.stderr


@pytest.mark.parametrize("user,policy,words", [
    (None, "PASSIVE", "sleep when idle (PASSIVE, chosen: why)"),
    ("", "PASSIVE", "sleep when idle (PASSIVE, chosen: why)"),          # empty: not a setting
    ("active", "active", "spin when idle (active, as you set)"),        # libgomp ignores the case
    ("sometimes", "sometimes", "spin a while, then sleep when idle (sometimes, as you set)"),
])
def test_wait_policy_keeps_a_users_value_and_names_what_libgomp_does_with_it(monkeypatch, user,
                                                                            policy, words):
    """A value libgomp does not know ("sometimes") is kept (libgomp warns and spins a while)."""
    if user is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", user)
    monkeypatch.setattr(numba_cache, "OMP_IDLE", numba_cache.OMP_IDLE)   # put back afterwards
    numba_cache.wait_policy("PASSIVE", "why")
    assert os.environ["OMP_WAIT_POLICY"] == policy and numba_cache.OMP_IDLE == words


@pytest.mark.parametrize("started_with", [None, "ACTIVE"])
def test_a_benchmarks_peer_runs_with_the_policy_it_was_given_not_stage_1s(started_with):
    """A bench worker imports stage1_cpu (for its helpers), which puts stage 1's choice in the
    environment; a llama.cpp or transformers worker must run as users run it (unset: OpenMP's
    own default), so as_users_run puts back what the worker was started with. Stage 1's own
    worker keeps stage 1's choice."""
    code = ("import os, bench.cpu\nfrom bench.common import as_users_run\n"
            "stage1 = os.environ.get('OMP_WAIT_POLICY')\nas_users_run('llama.cpp')\n"
            "print(stage1, os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if started_with:
        env["OMP_WAIT_POLICY"] = started_with
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    stage1, peer = out.stdout.split()
    assert stage1 == (started_with or stage1_cpu.WAIT_POLICY)
    assert peer == str(started_with)
