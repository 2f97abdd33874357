"""Benchmarks, kept apart from the tests: they print tables and napkin maths
(bytes per token against measured bandwidth), and never fail on speed.

    python -m bench cpu [--quick]     stage 1 vs llama.cpp vs transformers, both wait policies (bench/cpu.py)
    python -m bench ladder            the ablation ladder: naive matmul -> threads -> fused -> int4 -> int8 activations
    python -m bench kernels           the stage-1 matmul kernels alone (bench/kernels.py)
    python -m bench profile           one stage-1 forward pass, op by op (bench/profile.py)
    python -m bench prefill-pair      prefill, stage 1 against llama.cpp round by round (bench/prefill_pair.py)

Results and their history: docs/benchmarks.md.
"""
import os

# Before anything imports numpy: stop OpenBLAS's threads spinning after each call
# (stage1_cpu/__init__.py explains; this package is imported first by `python -m bench`).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
