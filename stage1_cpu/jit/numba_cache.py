"""Where numba keeps stage 1's compiled kernels, and when a warm-up is due.

numba's own cache (`cache=True`) files each function's machine code under the
source file that defines it, stamped with a hash of that file: an edit to the file
recompiles its functions, and only those. The warm-up mark (warm_mark) follows the
kernel files the same way: after an edit to any file that holds kernels, the next
start warms up again (compiling, before the first prompt, only what the edit made
stale); after an edit to a file without kernels (the chat, ops.py) nothing compiles
and no warm-up runs. (stage1_cpu/fast/ widens numba's stamps to the files a kernel
inlines from elsewhere: stage1_cpu/jit/numba_stamps.py.)
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path


def use_folder(name: str, here: Path, env: tuple[str, ...]) -> str:
    """Point numba's cache at ~/.cache/qwen3-stages/numba/<name>-<key> (or under
    $NUMBA_CACHE_DIR), the key a hash of where the sources live and of the variables
    that decide which instructions and functions are compiled. -> the folder."""
    h = hashlib.sha256(str(here.resolve()).encode() + b"\0")
    for var in env:
        h.update(f"{var}={os.environ.get(var, '')}\0".encode())
    base = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qwen3-stages", "numba")
    if os.path.basename(base.rstrip("/")).startswith(name + "-"):  # set by a parent process (below)
        base = os.path.dirname(base.rstrip("/"))
    folder = os.path.join(base, f"{name}-{h.hexdigest()[:16]}")
    # numba reads this when it is first imported; if it already was, set its config directly
    os.environ["NUMBA_CACHE_DIR"] = folder
    if "numba" in sys.modules:
        sys.modules["numba"].config.CACHE_DIR = folder
    return folder


def stamp(files) -> str:
    """A hash of the files' contents, in the order given."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes() + b"\0")
    return h.hexdigest()


def warm_mark(folder: str, files, *key: str) -> Path:
    """The file whose existence says: the kernels compiled from `files`, for `key`
    (format, kernels, activations), are in the cache as these sources are now."""
    return Path(folder) / ("warm-" + "-".join(key) + "-" + stamp(files)[:16])


def warm_up(forward, max_ctx: int, mark: Path) -> float:
    """Run forward(tokens, start_pos) on 1 token (decode), 2 (few tokens), 8 and 64 (prefill,
    serial and parallel variants), so that numba compiles (or loads) every kernel a
    conversation needs; then leave the mark. -> seconds it took."""
    import numpy as np
    t0 = time.perf_counter()
    pos = 0
    for T in (1, 2, 8, 64):
        if pos + T > max_ctx:
            break
        forward(np.zeros(T, dtype=np.int64), pos)
        pos += T
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.touch()
    return time.perf_counter() - t0


class WarmUp:
    """What stage 1's engine says and does about numba (the chat and generate call it): warm_up()
    and kernels_cold() by the mark that warm_key() names, and the banner's describe_kernels().
    The engine has weights, config, model (forward, kernels), max_ctx and reset()."""

    def warm_up(self) -> float | None:
        """Compile every kernel a conversation needs before the first prompt, unless a previous
        run did. -> seconds it took, or None."""
        if not self.kernels_cold():
            return None
        took = warm_up(self.model.forward, self.max_ctx, warm_mark(*self.warm_key()))
        self.reset()                              # the KV cache holds nothing a prompt can reuse
        return took

    def kernels_cold(self) -> bool:
        """True until warm_up() has run for this key, with the kernel files as they are now."""
        key = self.warm_key()
        return key is not None and not warm_mark(*key).exists()

    def warm_key(self) -> tuple | None:
        """(cache folder, kernel files, *key) for warm_mark(), or None when the model runs no
        numba code: the files the chosen kernels compile from, the layers' format, the kernels,
        the model kind (MoE layers run kernels of their own)."""
        # ops.py's numpy definitions compile nothing (imported here: numpy loads after
        # stage1_cpu/__init__.py has set OpenBLAS's variables)
        from .. import ops
        if self.model.kernels is ops:
            return None
        w, mlp = self.weights, "moe" if self.config.num_experts else "dense"
        files, kinds = (w.fast.files(), w.fast.kinds(w)) if w.fast else (KERNEL_FILES, "fp32")
        kernels = "fast" if w.fast else "plain"
        return CACHE_DIR, files, layers_format(w), kernels, mlp, kinds

    def describe_kernels(self) -> str:
        """Which kernels multiply the weights and how idle threads wait, for the banner."""
        w = self.weights
        kernels = w.fast.describe(w) if w.fast else "plain kernels"
        kernels += f" · {threads()}"               # omp threads sleep when idle (...)
        return f"{w.source} · {kernels}" if w.source else kernels


def layers_format(weights) -> str:
    """The layers' weight format: --quant's, or for a GGUF file's blocks as stored (--quant
    stored) the formats they hold, e.g. int4+int8."""
    mats = [w for lw in weights.layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down,
                                                 lw.experts_gate_up, lw.experts_down) if w]
    return "+".join(sorted({w.fmt for w in mats}))


def set_threads(n: int | None) -> int:
    """Use n threads for numba's parallel kernels (None: all cores). Returns the count."""
    import numba
    if n is None:
        n = numba.config.NUMBA_NUM_THREADS
    if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(
            f"threads={n} is not possible: this machine allows 1..{numba.config.NUMBA_NUM_THREADS} "
            f"(set NUMBA_NUM_THREADS before starting Python to allow more)"
        )
    numba.set_num_threads(n)
    return n


# how numba's idle omp threads wait and who chose it, for the banner (wait_policy() sets it)
OMP_IDLE = "spin a while, then sleep (OpenMP's default)"


def wait_policy(choice: str, why: str) -> None:
    """OMP_WAIT_POLICY as the user set it, else the stage's `choice` (`why`: its reason), set now:
    libgomp (numba's omp layer) reads it once, when numba starts its threads (docs/cpus.md)."""
    global OMP_IDLE
    user = os.environ.get("OMP_WAIT_POLICY", "").strip()
    os.environ["OMP_WAIT_POLICY"] = policy = user or choice
    how = {"ACTIVE": "spin", "PASSIVE": "sleep"}.get(policy.upper(), "spin a while, then sleep")
    OMP_IDLE = f"{how} when idle ({policy}, " + ("as you set)" if user else f"chosen: {why})")


def threads() -> str:
    """numba's threading layer (NUMBA_THREADING_LAYER's, else the first that loads: omp, tbb or
    workqueue) and how its idle threads wait, for the banner: OMP_WAIT_POLICY is OpenMP's alone
    (workqueue's idle threads sleep, TBB's spin a moment first)."""
    import numba
    numba.get_num_threads()        # starts the threads (if no parallel kernel has) and the layer
    layer = numba.threading_layer()
    return f"{layer} threads " + (OMP_IDLE if layer == "omp" else "(OMP_WAIT_POLICY: omp only)")


# stage 1's kernel files: the plain path compiles their numba code (the warm-up mark follows them)
STAGE1 = Path(__file__).parent.parent
KERNEL_FILES = [STAGE1 / f for f in ("norms.py", "kernels.py", "matmul.py")]
# numba's disk cache for stage 1, one folder per clone and per target (set before numba loads)
CACHE_DIR = use_folder("stage1", STAGE1,
                       env=("QS_FAST_ISA", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES"))
