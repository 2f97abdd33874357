"""fast/tiles.py's register tiles (8 rows side by side, 1 or 4 tokens a tile) against a float64
definition, at the shapes where tiles go wrong:

- every kind (int8 / int4 weights x int8 / int16 activations), 1 to 8 tokens, rows that fill
  no whole block of 8, group sizes 32, 64, 128, group counts 1, odd, even;
- T tokens at once equal T single tokens bit for bit (the same float operations per output,
  whatever the tile's size or the tokens beside it: what makes a verify step exact);
- the tile never reads past the last block (an unreadable page follows it) and writes only
  the rows and tokens it is given (a sentinel around them keeps its value);
- a NaN in a token's activations reaches exactly that token's outputs; very large and very
  small values keep their relative precision.

Tolerance: fp32 sums in another order than the float64 definition: 1e-5 of the row's sum of
|terms| (measured ~1e-7).
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
from numba import njit

from stage1_cpu import quant
from stage1_cpu.fast import cpu, gemm
from stage1_cpu.fast import kernels as fk
from stage1_cpu.fast.weight import as_fast

pytestmark = pytest.mark.skipif(not cpu.INT8,
                                reason="the CPU (or NUMBA_CPU_NAME) has no int8 dot product: "
                                "neither AVX-512 VNNI / AVX-VNNI (vpdpbusd), AVX2 (vpmaddubsw) "
                                "nor ARM dotprod (sdot)")
RTOL = 1e-5
KINDS = [("int8", "int8"), ("int8", "int16"), ("int4", "int8"), ("int4", "int16")]


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def weight(rng, fmt, O, K, gs, s_range=(1e-3, 2e-2)):
    """A stored int8 / int4 Weight with random values and scales in s_range (int4 minima
    negative)."""
    G = -(-K // gs)
    G += G % 2 if fmt == "int4" else 0
    if fmt == "int8":
        data = rng.integers(-127, 128, (O, G, gs)).astype(np.int8)
        mins = None
    else:
        data = rng.integers(0, 256, (O, G // 2, gs)).astype(np.uint8)
        mins = (
            np.maximum(-8 * rng.uniform(*s_range, (O, G)), -6e4).astype(np.float16).view(np.uint16)
        )
    scales = rng.uniform(*s_range, (O, G)).astype(np.float16).view(np.uint16)
    return quant.Weight(fmt, O, K, gs, data, scales, mins)


def rounded(x, w, act):
    """x [T, K] -> the tiles' inputs: (xq or x16 [T, Kp], xs, xcorr, xsum [T, G])."""
    xp = np.zeros((x.shape[0], w.padded_in), dtype=np.float32)
    xp[:, :x.shape[1]] = x
    x3 = xp.reshape(x.shape[0], -1, w.group_size)
    if act == "int16":
        x16, xs, xsum = fk.quantize_activations16(x3)
        return x16.reshape(x.shape[0], -1), xs, np.zeros(xs.shape, dtype=np.int32), xsum
    xq, xcorr, xs, xsum = fk.quantize_activations(x3)
    return xq.reshape(x.shape[0], -1), xs, xcorr, xsum


def terms(w, xint, xs, xsum):
    """[T, O, G (+ G)] float64: s xs (q . x) per group (and int4's m xsum)."""
    G, gs = xs.shape[1], w.group_size
    O = w.out_features
    q = w.data.astype(np.int64).reshape(O, G, gs) if w.fmt == "int8" else \
        np.stack([w.data & 15, w.data >> 4], axis=2).reshape(O, G, gs).astype(np.int64)
    xg = xint.reshape(xint.shape[0], G, gs).astype(np.float64)
    t = np.einsum("ogj,tgj->tog", q.astype(np.float64), xg)
    t = t * w.scales.view(np.float16).astype(np.float64)[None] * xs.astype(np.float64)[:, None, :]
    if w.fmt == "int4":
        mins = w.mins.view(np.float16).astype(np.float64)
        t = np.concatenate([t, mins[None] * xsum.astype(np.float64)[:, None]], axis=-1)
    return t


def check(out, t, rtol=RTOL):
    """out [T, O] against the sum of terms t, per element relative to the sum of |terms|."""
    bound = np.abs(t).sum(-1)
    assert np.isfinite(out).all() and (bound > 0).all(), "a row without terms proves nothing"
    err = float((np.abs(out - t.sum(-1)) / bound).max())
    assert err < rtol, f"relative error {err:.2e} >= {rtol:.0e}"


@njit(cache=False)
def run_tiles(
    x, xs, xcorr, xsum, data, scales, mins, out, ooff, ostride, v0, v1, T, k8_8, k8_16, k4_8, k4_16
):
    """kernels.tile_rows on one thread: blocks v0..v1, T tokens, into out (flat)."""
    G = scales.shape[1]
    fk.tile_rows(x.reshape(-1), 0, xs.reshape(-1), xcorr.reshape(-1), xsum.reshape(-1), 0,
                 data.reshape(-1), data.size // data.shape[0], scales.reshape(-1), mins.reshape(-1),
                 G, x.shape[1] // G, out, ooff, ostride, v0, v1, T, k8_8, k8_16, k4_8, k4_16)


def kind_flags(fmt, act):
    k = [None] * 4
    k[2 * (fmt == "int4") + (act == "int16")] = True
    return k


# ---------------------------------------------------------------- tests

# (O, K, gs)
SHAPES = [(1, 40, 32), (5, 32, 64), (13, 200, 32), (22, 5 * 128, 128), (37, 9 * 64 - 7, 64)]


@pytest.mark.parametrize("fmt,act", KINDS)
@pytest.mark.parametrize("O,K,gs", SHAPES)
def test_tiles_equal_the_definition_and_each_token_alone(rng, fmt, act, O, K, gs):
    W = weight(rng, fmt, O, K, gs)
    F = as_fast(W, decode_act="int8" if act == "int8" or fmt == "int4" else "int16")
    data, scales, mins = F.data, F.scales, F.scales if F.mins is None else F.mins
    V = data.shape[0]
    x = (rng.standard_normal((8, K)) * 2).astype(np.float32)
    xint, xs, xcorr, xsum = rounded(x, W, act)
    for T in (1, 2, 3, 4, 5, 7, 8):
        out = np.full((T, 8 * V), -7.0, dtype=np.float32)
        run_tiles(xint[:T], xs[:T], xcorr[:T], xsum[:T], data, scales, mins, out.reshape(-1), 0,
                  8 * V, 0, V, T, *kind_flags(fmt, act))
        check(out[:, :O], terms(W, xint[:T], xs[:T], xsum[:T]))
        for t in range(T):                                       # each token alone: the same bits
            one = np.empty((1, 8 * V), dtype=np.float32)
            run_tiles(xint[t:t + 1], xs[t:t + 1], xcorr[t:t + 1], xsum[t:t + 1], data, scales, mins,
                      one.reshape(-1), 0, 8 * V, 0, V, 1, *kind_flags(fmt, act))
            assert np.array_equal(one[0, :O], out[t, :O]), (T, t)


def guarded(a: np.ndarray) -> np.ndarray:
    """A copy of a whose last byte is followed by a page that cannot be read (a read past the
    end faults). The mapping stays alive with the returned array."""
    page = mmap.PAGESIZE
    data = -(-a.nbytes // page) * page
    mm = mmap.mmap(-1, data + page)
    b = np.frombuffer(mm, dtype=a.dtype, count=a.size, offset=data - a.nbytes).reshape(a.shape)
    b[...] = a
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + data, page, 0) == 0, "mprotect failed"       # PROT_NONE
    return b


@pytest.mark.parametrize("fmt,act", KINDS)
@pytest.mark.parametrize("T", [1, 3, 6])
def test_tiles_read_no_block_past_the_last_and_write_only_their_own(rng, fmt, act, T):
    # 3 blocks; tiles over blocks 1..3 (a tile of 4 or 8 blocks covers them: the rest repeat the
    # last, read, never stored); the data ends at an unreadable page, the output has a sentinel
    # around
    O, K, gs = 21, 96, 32
    W = weight(rng, fmt, O, K, gs)
    F = as_fast(W, decode_act="int8" if act == "int8" or fmt == "int4" else "int16")
    data, scales = guarded(F.data), guarded(F.scales)
    mins = scales if F.mins is None else guarded(F.mins)
    x = rng.standard_normal((T, K)).astype(np.float32)
    xint, xs, xcorr, xsum = rounded(x, W, act)
    ostride = 2 * 8 + 5
    out = np.full(3 + T * ostride, 12345.0, dtype=np.float32)
    run_tiles(
        xint, xs, xcorr, xsum, data, scales, mins, out, 3, ostride, 1, 3, T, *kind_flags(fmt, act)
    )
    got = out[3:].reshape(T, ostride)
    assert (out[:3] == 12345.0).all() and (got[:, 16:] == 12345.0).all()
    check(got[:, :O - 8], terms(W, xint, xs, xsum)[:, 8:])


@pytest.mark.parametrize("fmt,act", KINDS)
def test_nan_reaches_its_token_only(rng, fmt, act):
    # token 1: a NaN in group 4; token 3: an inf in group 9 (the last)
    O, K, gs = 9, 10 * 32, 32
    W = weight(rng, fmt, O, K, gs)
    F = as_fast(W, decode_act="int8" if act == "int8" or fmt == "int4" else "int16")
    x = rng.standard_normal((5, K)).astype(np.float32)
    x[1, 4 * 32 + 7], x[3, 9 * 32] = np.nan, np.inf
    xint, xs, xcorr, xsum = rounded(x, W, act)
    assert np.isnan(xs[1, 4]) and np.isnan(xs[3, 9])
    out = np.zeros((5, 16), dtype=np.float32)
    run_tiles(xint, xs, xcorr, xsum, F.data, F.scales, F.scales if F.mins is None else F.mins,
              out.reshape(-1), 0, 16, 0, 2, 5, *kind_flags(fmt, act))
    assert np.isnan(out[[1, 3], :O]).all() and np.isfinite(out[[0, 2, 4], :O]).all()


@pytest.mark.parametrize("fmt,act", KINDS)
@pytest.mark.parametrize(
    "x_scale,s_range", [(1e20, (1e3, 6e4)), (1e-20, (1e-4, 1e-3)), (1e-12, (2e-7, 1e-6))]
)
def test_extreme_magnitudes_keep_their_precision(rng, fmt, act, x_scale, s_range):
    O, K, gs = 9, 12 * 64, 64
    W = weight(rng, fmt, O, K, gs, s_range=s_range)
    F = as_fast(W, decode_act="int8" if act == "int8" or fmt == "int4" else "int16")
    x = (rng.standard_normal((2, K)) * x_scale).astype(np.float32)
    xint, xs, xcorr, xsum = rounded(x, W, act)
    out = np.zeros((2, 16), dtype=np.float32)
    run_tiles(xint, xs, xcorr, xsum, F.data, F.scales, F.scales if F.mins is None else F.mins,
              out.reshape(-1), 0, 16, 0, 2, 2, *kind_flags(fmt, act))
    t = terms(W, xint, xs, xsum)
    check(out[:, :O], t)


def test_the_twin_is_the_integer_definition(rng):
    # gemm_ref (float64, exact integer dots) reads a tiled weight the same as the stored one
    for fmt in ("int8", "int4"):
        W = weight(rng, fmt, 19, 200, 32)
        x = rng.standard_normal((3, 200)).astype(np.float32)
        xint, xs, xcorr, xsum = rounded(x, W, "int8")
        F = as_fast(W, decode_act="int8")
        x3 = xint.reshape(3, -1, 32)
        np.testing.assert_array_equal(
            gemm.gemm_ref(x3, xs, xsum, F), gemm.gemm_ref(x3, xs, xsum, W)
        )
        check(F.matmul(x), terms(W, xint, xs, xsum))
