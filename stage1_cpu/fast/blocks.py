"""Decode matvecs by whole blocks of rows, and bf16 four rows per pass.

Changed from the core (stage1_cpu/matmul.py): the core's matmul_bf16 hands each
thread single rows (prange over rows) and reads them one at a time. Here each
thread takes whole blocks of rows, in order (decode_block: long sequential
streams for the hardware prefetcher, and few enough blocks that scheduling costs
nothing), and the bf16 rows are read four at a time (rows4_bf16). The int8 /
int4 kernels of fast/kernels.py take their rows by the same blocks.

Each row keeps its own sum, but the four-row loop is vectorised differently from
the core's one-row loop (and from the tail's, where LLVM sees four equal sums):
the bits differ from matmul.matmul_bf16 in the last place (fp32 rounding).
FastWeight.matmul (bf16 weights, decode) and the one-region step both run
rows_bf16, so the two agree bit for bit with each other.
"""

import numpy as np
from numba import njit, prange

from ..matmul import FAST, _inline, bf16_to_f32

# Weights per block of rows of the decode matvecs (~10 us of reading per block).
DECODE_BLOCK_BYTES = 1 << 18


@_inline
def decode_block(O, row_bytes):
    """Rows per block: ~DECODE_BLOCK_BYTES of weights, whole groups of 4 rows."""
    rows = min(O, max(1, DECODE_BLOCK_BYTES // row_bytes))
    return max(4, rows + (-rows) % 4)


@_inline
def rows4_bf16(x, t, w, r, m):
    """x[t] . w[r + i m] for i = 0..3, in one pass over x[t]: four rows m apart are
    four sequential streams (the prefetcher follows them), and each
    activation is loaded once for the four (the hot loop: 2 bytes per weight,
    converted by a shift). Each row has its own sum (m = 0: four times row r, the tail)."""
    a0, a1, a2, a3 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
    for k in range(x.shape[1]):
        xk = x[t, k]
        a0 += bf16_to_f32(w[r, k]) * xk
        a1 += bf16_to_f32(w[r + m, k]) * xk
        a2 += bf16_to_f32(w[r + 2 * m, k]) * xk
        a3 += bf16_to_f32(w[r + 3 * m, k]) * xk
    return a0, a1, a2, a3


@_inline
def rows_bf16(x, t, w, r0, r1, outf, ooff):
    """outf[ooff + r] = x[t] . w[r] for r0 <= r < r1: four rows per pass, a quarter of
    the range apart; the last (r1 - r0) % 4 rows one at a time, by the same body."""
    n4 = (r1 - r0) // 4
    for b in range(r0, r0 + n4):
        a0, a1, a2, a3 = rows4_bf16(x, t, w, b, n4)
        outf[ooff + b] = a0
        outf[ooff + b + n4] = a1
        outf[ooff + b + 2 * n4] = a2
        outf[ooff + b + 3 * n4] = a3
    for r in range(r0 + 4 * n4, r1):
        outf[ooff + r] = rows4_bf16(x, t, w, r, 0)[0]


@njit(parallel=True, cache=True, fastmath=FAST, error_model="numpy")
def matmul_bf16(x, w, out):
    """x: [T, K] f32, w: [O, K] uint16 bf16 bits -> out: [T, O] (contiguous)."""
    T, O = x.shape[0], w.shape[0]
    outf = out.reshape(-1)
    block = decode_block(O, 2 * w.shape[1])         # each thread takes whole blocks, in order
    for c in prange(-(-O // block)):
        for t in range(T):
            rows_bf16(x, t, w, c * block, min(O, (c + 1) * block), outf, t * O)
