"""Stand-in GPU tests for `bash bench/gpu_check.sh --dry-run` (not collected by the suite: the
file name does not start with test_). The kernel step selects the first by `-k "not engine"`,
the engine step the second by `-k engine`; QS_DRY_FAIL=1 plants a failure and a skipped GPU
test, QS_DRY_HANG=1 a test that outlives its cap (tests/test_gpu_check.py uses both)."""
import os
import time

import pytest


def test_kernel_stand_in_passes():
    assert sum(range(10)) == 45


def test_engine_stand_in_passes():
    assert "engine".upper() == "ENGINE"


if os.environ.get("QS_DRY_FAIL") == "1":
    def test_kernel_stand_in_fails():
        values = [1, 2, 3]
        assert sum(values) == 7, "a planted failure"

    @pytest.mark.gpu
    @pytest.mark.skipif(True, reason="CuPy cannot see a GPU (planted)")
    def test_kernel_stand_in_skips_without_gpu():
        pass

if os.environ.get("QS_DRY_HANG") == "1":
    def test_engine_stand_in_hangs():
        time.sleep(600)
