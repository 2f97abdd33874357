import os
import sys
from pathlib import Path

import pytest

# OpenMP threads that busy-wait collapse numba/torch speed when the other core is busy
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Stage 1's one-region step compiles every row body at once, not only the model's own (one
# compile for the many formats the tests run; test_stage1_decode_step.py checks the other way too)
os.environ.setdefault("QS_FAST_ALL_KINDS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.testbed.qwen_tokenizer import build_qwen3_tokenizer  # noqa: E402  (the paths first)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    """A folder with Qwen3's tokenizer.json + tokenizer_config.json (session-wide)."""
    return build_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer"))


@pytest.fixture(scope="session")
def qwen3_hf_tokenizer(qwen3_tokenizer_dir):
    """transformers' tokenizer for the same folder (the oracle), loaded once per session."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))


# ---------------------------------------------------------------------------
# time limits (pytest-timeout; the default, 300 s, is in pyproject.toml)
# ---------------------------------------------------------------------------
# Files whose first test pays for a cold compile (numba's stage-1 kernels, g++ of the
# emulated kernels, nvcc / NVRTC of every .cu, CuPy's first RawModule) or that start a
# subprocess (the chat under pexpect, a server) get more: a hang still fails, a slow cold
# start on a busy 2-core runner does not.
SLOW_FILES = {
    "test_quant_quality.py": 1200, "test_default_model.py": 1200, "test_families.py": 1200,
    "test_gguf_engines.py": 1200,
    "test_chat.py": 900, "test_server.py": 900, "test_stage2_serve.py": 900,
    "test_serve_faults.py": 900,
    "test_stage2_cuda_emulated.py": 900, "test_cuda_compile.py": 600,
    "test_stage2_gpu.py": 600, "test_stage3_gpu.py": 600, "test_gpu_check.py": 900,
}
# the emulated kernels block inside a C call, where the signal method cannot interrupt
# them: there pytest-timeout's thread method dumps every stack and ends the run instead
THREAD_METHOD_FILES = {"test_stage2_cuda_emulated.py"}

REQUIRE_GPU = os.environ.get("QS_REQUIRE_GPU") == "1"


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        # numba, cold
        limit = SLOW_FILES.get(name, 1200 if name.startswith("test_stage1_") else None)
        if limit is not None and item.get_closest_marker("timeout") is None:
            kw = {"method": "thread"} if name in THREAD_METHOD_FILES else {}
            item.add_marker(pytest.mark.timeout(limit, **kw))


# ---------------------------------------------------------------------------
# QS_REQUIRE_GPU=1 (bench/gpu_check.sh sets it): a GPU test that skips is a failure
# ---------------------------------------------------------------------------
# Without a GPU the tests marked `gpu` skip, and a run of only skips exits 0. On the GPU
# machine that would read as a pass when CuPy could not start: there every skip of a
# `gpu` test is turned into a failure that says why it skipped.

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_GPU and report.skipped and item.get_closest_marker("gpu") is not None:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"QS_REQUIRE_GPU=1 and this GPU test skipped: {reason}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Registers and shared memory of every kernel, as ptxas reported them
    (tests/test_cuda_compile.py)."""
    lines = config.__dict__.get("_qs_cuda_resources")
    if lines:
        terminalreporter.section("CUDA kernels: registers and shared memory (ptxas -v)")
        for line in sorted(set(lines)):
            terminalreporter.write_line(line)
