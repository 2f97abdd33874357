"""Benchmarks, kept apart from the tests: they print tables and napkin maths (bytes per
token against measured bandwidth) and never fail on speed. `python -m bench --help` lists
the commands (bench/__main__.py); results and their history: docs/benchmarks.md.
"""
import os

# Before anything imports numpy: stop OpenBLAS's threads spinning after each call
# (stage1_cpu/__init__.py explains; this package is imported first by `python -m bench`).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# The wait policy this process was started with (None: unset), before importing stage1_cpu
# sets stage 1's own choice: a peer's worker puts it back (bench.common.as_users_run).
STARTED_WITH_OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")
