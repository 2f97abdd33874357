"""Benchmarks, kept apart from the tests: they print tables and napkin maths (bytes per
token against measured bandwidth) and never fail on speed. `python -m bench --help` lists
the commands (bench/__main__.py); results and their history: docs/benchmarks.md.
"""
import os

# Before anything imports numpy: stop OpenBLAS's threads spinning after each call
# (stage1_cpu/__init__.py explains; this package is imported first by `python -m bench`).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
