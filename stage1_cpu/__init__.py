"""Stage 1: a readable, exact CPU engine for Qwen3 (numpy reference ops, numba kernels,
INT8/INT4 group quantization, MoE routing), and beside it the fast path (stage1_cpu/fast/).
Reading order: docs/stage1.md."""
import os

# numba's cache folder for stage 1 and its kernel files (jit/numba_cache.py), before numba loads
from .jit import numba_cache

# idle threads sleep: OpenBLAS's soon after a call (a core numba needs: docs/stage1.md, section 7),
# OpenMP's at once, measured faster beside busy programs (docs/benchmarks.md, the busy table)
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
WAIT_POLICY, WAIT_WHY = "PASSIVE", "fast on a busy CPU"
numba_cache.wait_policy(WAIT_POLICY, WAIT_WHY)
