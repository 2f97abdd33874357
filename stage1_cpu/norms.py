"""RMSNorm, the first numba kernel of stage 1 (its numpy twin is ops.rmsnorm), and the
conventions every kernel file follows (kernels.py, matmul.py). It has a file of its own because
numba caches machine code per source file: an edit here recompiles these few functions, not
every op (docs/stage1.md, section 2)."""

import numpy as np
from numba import njit

# reassoc: LLVM may split sums over vector lanes; contract: FMA. error_model="numpy": x / 0 is
# inf, not an exception, one branch less per division (without it silu_mul did not vectorise: 6x).
FAST = {"reassoc", "contract"}

# Each kernel's body for one row (a matmul's output row, a norm's token) is an _inline
# helper; the kernels loop over it, _serial on one thread, _parallel with prange, and so does
# fast/decode_step.py's one parallel region: one body, the same bits (docs/stage1.md, section 7).
_inline = njit(inline="always", fastmath=FAST, error_model="numpy")
_serial = njit(cache=True, fastmath=FAST, error_model="numpy")
_parallel = njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")


@_inline
def rmsnorm_row(x2, w, eps, out2, t):
    # exercise 1.1 begin
    C = x2.shape[1]
    ss = np.float32(0.0)
    for c in range(C):
        ss += x2[t, c] * x2[t, c]
    rms = np.sqrt(ss / np.float32(C) + np.float32(eps))
    for c in range(C):
        out2[t, c] = x2[t, c] / rms * w[c]
    # exercise 1.1 end


@_serial
def _rmsnorm(x2, w, eps, out2):
    for t in range(x2.shape[0]):
        rmsnorm_row(x2, w, eps, out2, t)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: [T, C] with w [C], or [T, H, D] with w [D]: normalise the last axis. Serial: a
    row is a few hundred ns, less than starting the threads (tens of us when they sleep)."""
    x2 = np.ascontiguousarray(x).reshape(-1, x.shape[-1])  # [rows, last]
    out = np.empty_like(x2)
    _rmsnorm(x2, w, eps, out)
    return out.reshape(x.shape)
