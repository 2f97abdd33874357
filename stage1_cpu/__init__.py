"""Stage 1: a readable, exact CPU engine for Qwen3 (numpy reference ops, numba kernels,
INT8/INT4 group quantization, MoE routing). Reading order: docs/stage1.md."""
import os

# numpy's OpenBLAS keeps its worker threads spinning for 2^28 cycles (~0.1 s) after each
# call, taking a core away from the numba kernels that run next: a 512-token bf16 prefill
# measured 2.96 s with the default and 2.23 s with the spin cut to 2^4 cycles. OpenBLAS
# reads this when numpy loads it, so it is set here, before stage 1 imports numpy (with
# `python -m stage1_cpu.chat` this package is imported first; bench/common.py sets it too).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
