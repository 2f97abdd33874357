"""Stage 1: a readable, exact CPU engine for Qwen3 (numpy reference ops, numba kernels,
INT8/INT4 group quantization, MoE routing), and beside it the fast path (stage1_cpu/fast/).
Reading order: docs/stage1.md."""
import hashlib
import os
import sys
from pathlib import Path

# numpy's OpenBLAS keeps its worker threads spinning for 2^28 cycles (~0.1 s) after each
# call, taking a core away from the numba kernels that run next: cutting the spin to 2^4
# cycles made a 512-token bf16 prefill about a quarter faster
# (docs/benchmarks.md, log: Figures moved out of the stage-1 docstrings). OpenBLAS
# reads this when numpy loads it, so it is set here, before stage 1 imports numpy (with
# `python -m stage1_cpu.chat` this package is imported first; bench/common.py sets it too).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


def _numba_cache_dir() -> str:
    """Where numba keeps stage 1's compiled kernels: a folder named after a hash of every
    stage-1 source file (and of what decides which instructions are emitted).

    numba's own cache notices an edit to a kernel's file, but not to a function it
    inlines from another file (fast/decode_step.py inlines kernels.py's row bodies and
    simd.py's instructions): after such an edit it would run stale machine code. A new
    hash after any edit means a fresh folder, so that cannot happen. The folder the
    sources live in is part of the hash too: numba files its cache by source path, so a
    second clone starts cold, and must not find the first one's "already warmed up" mark
    (engine.warm_up) and then compile for minutes inside the first answer."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    h.update(str(here).encode() + b"\0")
    for f in sorted(here.rglob("*.py")):
        h.update(str(f.relative_to(here)).encode() + b"\0" + f.read_bytes())
    for var in ("QS_FAST_ISA", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"):
        h.update(f"{var}={os.environ.get(var, '')}\0".encode())
    base = os.environ.get("NUMBA_CACHE_DIR") or \
        os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qwen3-stages", "numba")
    if os.path.basename(base.rstrip("/")).startswith("stage1-"):   # set by a parent process (below)
        base = os.path.dirname(base.rstrip("/"))
    return os.path.join(base, "stage1-" + h.hexdigest()[:16])


CACHE_DIR = _numba_cache_dir()
# Read by numba when it is first imported; if it already was, set its config directly
# (the kernels' cache locations are fixed when they are decorated, after this).
os.environ["NUMBA_CACHE_DIR"] = CACHE_DIR
if "numba" in sys.modules:
    sys.modules["numba"].config.CACHE_DIR = CACHE_DIR
