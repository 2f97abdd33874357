"""Stage 1: a readable, exact CPU engine for Qwen3 (numpy reference ops, numba kernels,
INT8/INT4 group quantization, MoE routing), and beside it the fast path (stage1_cpu/fast/).
Reading order: docs/stage1.md."""
import os
from pathlib import Path

from .jit import numba_cache

# idle threads sleep: OpenBLAS's soon after a call (a core numba needs: docs/stage1.md, section 7),
# OpenMP's at once, measured faster beside busy programs (docs/benchmarks.md, the busy table)
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
WAIT_POLICY, WAIT_WHY = "PASSIVE", "fast on a busy CPU"
numba_cache.wait_policy(WAIT_POLICY, WAIT_WHY)
# numba's disk cache for stage 1, one folder per clone and per target (jit/numba_cache.py)
CACHE_DIR = numba_cache.use_folder("stage1", Path(__file__).parent,
                                   env=("QS_FAST_ISA", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"))
# the files whose numba code the plain path compiles (the warm-up mark follows them)
KERNEL_FILES = [Path(__file__).parent / f for f in ("norms.py", "kernels.py", "matmul.py")]
