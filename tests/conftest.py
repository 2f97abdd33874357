import os
import sys
from pathlib import Path

# OpenMP threads that busy-wait collapse numba/torch speed when the other core is busy
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Registers and shared memory of every kernel, as ptxas reported them
    (tests/test_cuda_compile.py)."""
    lines = config.__dict__.get("_qs_cuda_resources")
    if lines:
        terminalreporter.section("CUDA kernels: registers and shared memory (ptxas -v)")
        for line in sorted(set(lines)):
            terminalreporter.write_line(line)
