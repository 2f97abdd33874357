"""Benchmarks, kept apart from the tests: they print tables and napkin maths
(bytes per token against measured bandwidth), and never fail on speed.

    python -m bench cpu [--quick]     stage 1 vs llama.cpp vs transformers (bench/cpu.py)
    python -m bench kernels           the stage-1 matmul kernels alone (bench/kernels.py)

Results and their history: docs/benchmarks.md.
"""
