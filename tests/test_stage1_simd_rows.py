"""simd.dot_int8_rows / dot_int8_rows_i16 / dot_int4_rows (up to 4 rows per call)
against a float64 definition, and the int8 ones against the one-row kernels
dot_int8_row / dot_int8_row_i16.

- every row of a matrix, in calls of 4 adjacent rows plus a tail of 1-3, and in
  calls of 4 rows m = O // 4 rows apart (then their scales and outputs are m
  rows apart too); group sizes 32, 64, 128 (and 96, 256: the generic loop);
  group counts 1, odd, below / at / above a multiple of 8; several tokens;
- rows i >= n_rows are neither written nor read: the weights and scales end at
  a page that cannot be read, and the output around the rows keeps its values;
- a NaN in the activation scales reaches exactly its token's outputs; very
  large and very small values keep their relative precision.

Tolerance: fp32 sums in another order than the float64 definition: 1e-5 of the
row's sum of |terms| (measured ~1e-7).
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np
import pytest
from numba import njit

from stage1_cpu.fast import cpu, simd
from stage1_cpu.fast import kernels

pytestmark = pytest.mark.skipif(not cpu.INT8, reason="the CPU (or NUMBA_CPU_NAME) has no int8 dot product: "
                                "neither AVX-512 VNNI / AVX-VNNI (vpdpbusd), AVX2 (vpmaddubsw) nor ARM dotprod (sdot)")

RTOL = 1e-5


# ---------------------------------------------------------------- numba callers
# (each compiled for one group size: the Python wrappers below pass simd.chunks(gs))


@njit(cache=False)
def _rows8(xq, xa, xs, q, s, out, spread, gsk):
    """out [T, O] by dot_int8_rows: calls of 4 rows (adjacent, or O // 4 rows apart
    when spread), then the last O % 4 rows in one call."""
    T, G, gs = xq.shape
    O = q.shape[0]
    qf, sf, xqf, xaf = q.reshape(-1), s.reshape(-1), xq.reshape(-1), xa.reshape(-1)
    xsf, of = xs.reshape(-1), out.reshape(-1)
    for t in range(T):
        m = O // 4 if spread else 1
        blocks = O // 4
        for b in range(blocks):
            r = b if spread else 4 * b
            simd.dot_int8_rows(qf, r * G * gs, m * G * gs, xqf, xaf, t * G * gs, sf, r * G, xsf, t * G, G, gs,
                               of, t * O + r, 4, gsk)
        r = 4 * blocks
        if r < O:
            simd.dot_int8_rows(qf, r * G * gs, G * gs, xqf, xaf, t * G * gs, sf, r * G, xsf, t * G, G, gs,
                               of, t * O + r, O - r, gsk)


@njit(cache=False)
def _rows16(x16, xs, q, s, out, spread, gsk):
    """rows8 for dot_int8_rows_i16."""
    T, G, gs = x16.shape
    O = q.shape[0]
    qf, sf, xf, xsf, of = q.reshape(-1), s.reshape(-1), x16.reshape(-1), xs.reshape(-1), out.reshape(-1)
    for t in range(T):
        m = O // 4 if spread else 1
        blocks = O // 4
        for b in range(blocks):
            r = b if spread else 4 * b
            simd.dot_int8_rows_i16(qf, r * G * gs, m * G * gs, xf, t * G * gs, sf, r * G, xsf, t * G, G, gs,
                                   of, t * O + r, 4, gsk)
        r = 4 * blocks
        if r < O:
            simd.dot_int8_rows_i16(qf, r * G * gs, G * gs, xf, t * G * gs, sf, r * G, xsf, t * G, G, gs,
                                   of, t * O + r, O - r, gsk)


@njit(cache=False)
def _rows4(xq, xs, xsum, q, s, m, out, spread, gsk):
    """rows8 for dot_int4_rows (q [O, G/2, gs] bytes, m [O, G] minima)."""
    T, G, gs = xq.shape
    O = q.shape[0]
    row = G * gs // 2
    qf, sf, mf, xqf = q.reshape(-1), s.reshape(-1), m.reshape(-1), xq.reshape(-1)
    xsf, xsumf, of = xs.reshape(-1), xsum.reshape(-1), out.reshape(-1)
    for t in range(T):
        k = O // 4 if spread else 1
        blocks = O // 4
        for b in range(blocks):
            r = b if spread else 4 * b
            simd.dot_int4_rows(qf, r * row, k * row, xqf, t * G * gs, sf, r * G, xsf, t * G, G, gs,
                               of, t * O + r, 4, mf, xsumf, gsk)
        r = 4 * blocks
        if r < O:
            simd.dot_int4_rows(qf, r * row, row, xqf, t * G * gs, sf, r * G, xsf, t * G, G, gs,
                               of, t * O + r, O - r, mf, xsumf, gsk)


@njit(cache=False)
def _one_call4(q, row_stride, xq, s, xs, m, xsum, G, gs, out, ooff, n_rows, gsk):
    simd.dot_int4_rows(q, 0, row_stride, xq, 0, s, 0, xs, 0, G, gs, out, ooff, n_rows, m, xsum, gsk)


@njit(cache=False)
def _one_call8(q, row_stride, xq, xa, s, xs, G, gs, out, ooff, n_rows, gsk):
    """One dot_int8_rows call on rows 0.. of flat arrays (token 0)."""
    simd.dot_int8_rows(q, 0, row_stride, xq, xa, 0, s, 0, xs, 0, G, gs, out, ooff, n_rows, gsk)


@njit(cache=False)
def _one_call16(q, row_stride, x16, s, xs, G, gs, out, ooff, n_rows, gsk):
    simd.dot_int8_rows_i16(q, 0, row_stride, x16, 0, s, 0, xs, 0, G, gs, out, ooff, n_rows, gsk)


@njit(cache=False)
def old8(xq, xa, xs, q, s, out):
    T, G, gs = xq.shape
    qf, sf, xqf, xaf, xsf = q.reshape(-1), s.reshape(-1), xq.reshape(-1), xa.reshape(-1), xs.reshape(-1)
    for t in range(T):
        for r in range(q.shape[0]):
            out[t, r] = simd.dot_int8_row(qf, r * G * gs, xqf, xaf, t * G * gs, sf, r * G, xsf, t * G, G, gs)


@njit(cache=False)
def old16(x16, xs, q, s, out):
    T, G, gs = x16.shape
    qf, sf, xf, xsf = q.reshape(-1), s.reshape(-1), x16.reshape(-1), xs.reshape(-1)
    for t in range(T):
        for r in range(q.shape[0]):
            out[t, r] = simd.dot_int8_row_i16(qf, r * G * gs, xf, t * G * gs, sf, r * G, xsf, t * G, G, gs)


def rows8(xq, xa, xs, q, s, out, spread):
    _rows8(xq, xa, xs, q, s, out, spread, simd.chunks(xq.shape[2]))


def rows16(x16, xs, q, s, out, spread):
    _rows16(x16, xs, q, s, out, spread, simd.chunks(x16.shape[2]))


def rows4(xq, xs, xsum, q, s, m, out, spread):
    _rows4(xq, xs, xsum, q, s, m, out, spread, simd.chunks(xq.shape[2]))


def one_call4(q, row_stride, xq, s, xs, m, xsum, G, gs, out, ooff, n_rows):
    _one_call4(q, row_stride, xq, s, xs, m, xsum, G, gs, out, ooff, n_rows, simd.chunks(gs))


def one_call8(q, row_stride, xq, xa, s, xs, G, gs, out, ooff, n_rows):
    _one_call8(q, row_stride, xq, xa, s, xs, G, gs, out, ooff, n_rows, simd.chunks(gs))


def one_call16(q, row_stride, x16, s, xs, G, gs, out, ooff, n_rows):
    _one_call16(q, row_stride, x16, s, xs, G, gs, out, ooff, n_rows, simd.chunks(gs))


# ---------------------------------------------------------------- definition and inputs


def terms(xint, xs, q, s):
    """[T, O, G] float64: s[r, g] * xs[t, g] * (q[r, g] . xint[t, g])."""
    dots = np.einsum("ogj,tgj->tog", q.astype(np.float64), xint.astype(np.float64))
    return dots * s.view(np.float16).astype(np.float64)[None] * xs.astype(np.float64)[:, None, :]


def check(out, terms_, rtol=RTOL):
    """out [T, O] against the sum of terms, per element relative to the sum of |terms|."""
    ref = terms_.sum(-1)
    bound = np.abs(terms_).sum(-1)
    assert np.isfinite(out).all()
    assert (bound > 0).all(), "a row without terms proves nothing"
    err = float((np.abs(out - ref) / bound).max())
    assert err < rtol, f"relative error {err:.2e} >= {rtol:.0e}"
    return err


def problem(rng, T, O, G, gs, x_scale=1.0, s_range=(1e-3, 2e-2)):
    """q [O, G, gs] int8 (-127..127), s [O, G] fp16 bits, x [T, G, gs] float32."""
    q = rng.integers(-127, 128, (O, G, gs)).astype(np.int8)
    s = rng.uniform(*s_range, (O, G)).astype(np.float16).view(np.uint16)
    x = (rng.standard_normal((T, G, gs)) * x_scale).astype(np.float32)
    return q, s, x


def problem4(rng, T, O, G, gs, x_scale=1.0):
    """int4 weights: nibbles [O, G, gs] (0..15) packed as q [O, G/2, gs] bytes, s and
    m [O, G] fp16 bits (m negative, as quantize makes it: the group's minimum), x."""
    nib = rng.integers(0, 16, (O, G, gs)).astype(np.uint8)
    pairs = nib.reshape(O, G // 2, 2, gs)
    q = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).astype(np.uint8)
    s = rng.uniform(1e-3, 2e-2, (O, G)).astype(np.float16).view(np.uint16)
    m = (-8 * rng.uniform(1e-3, 2e-2, (O, G))).astype(np.float16).view(np.uint16)
    x = (rng.standard_normal((T, G, gs)) * x_scale).astype(np.float32)
    return nib, q, s, m, x


def terms4(xq, xs, xsum, nib, s, m):
    """[T, O, 2G] float64: the scaled group dots, then the minimum terms m[r, g] * xsum[t, g]."""
    mins = m.view(np.float16).astype(np.float64)[None] * xsum.astype(np.float64)[:, None, :]
    return np.concatenate([terms(xq, xs, nib, s), mins], axis=-1)


def guarded(a: np.ndarray) -> np.ndarray:
    """A copy of a whose last byte is followed by a page that cannot be read (a
    read past the end faults). The mapping stays alive with the returned array."""
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


@pytest.fixture
def rng():
    return np.random.default_rng(7)


# ---------------------------------------------------------------- tests

SHAPES = [(1, 1), (2, 3), (3, 8), (5, 9), (7, 17), (13, 40), (22, 5)]   # (O, G): tails of 1-3 rows, G % 8


@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("O,G", SHAPES)
@pytest.mark.parametrize("spread", [False, True])
def test_int8_rows(rng, gs, O, G, spread):
    q, s, x = problem(rng, 2, O, G, gs)
    xq, xa, xs, _ = kernels.quantize_activations(x)
    out = np.full((2, O), -7.0, dtype=np.float32)
    rows8(xq, xa, xs, q, s, out, spread)
    t = terms(xq, xs, q, s)
    check(out, t)
    old = np.empty_like(out)
    old8(xq, xa, xs, q, s, old)
    check(old, t)
    assert float((np.abs(out - old) / np.abs(t).sum(-1)).max()) < RTOL


@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("O,G", SHAPES)
@pytest.mark.parametrize("spread", [False, True])
def test_int16_rows(rng, gs, O, G, spread):
    q, s, x = problem(rng, 2, O, G, gs)
    x16, xs = kernels.quantize_activations16(x)
    out = np.full((2, O), -7.0, dtype=np.float32)
    rows16(x16, xs, q, s, out, spread)
    t = terms(x16, xs, q, s)
    check(out, t)
    old = np.empty_like(out)
    old16(x16, xs, q, s, old)
    check(old, t)
    assert float((np.abs(out - old) / np.abs(t).sum(-1)).max()) < RTOL


SHAPES4 = [(1, 2), (2, 4), (3, 8), (5, 10), (7, 18), (13, 40), (22, 6)]   # G even (nibble pairs)


@pytest.mark.parametrize("gs", [32, 64, 128, 96])
@pytest.mark.parametrize("O,G", SHAPES4)
@pytest.mark.parametrize("spread", [False, True])
def test_int4_rows(rng, gs, O, G, spread):
    nib, q, s, m, x = problem4(rng, 2, O, G, gs)
    xq, xa, xs, xsum = kernels.quantize_activations(x)
    out = np.full((2, O), -7.0, dtype=np.float32)
    rows4(xq, xs, xsum, q, s, m, out, spread)
    check(out, terms4(xq, xs, xsum, nib, s, m))


@pytest.mark.parametrize("n_rows", [1, 2, 3, 4])
def test_int4_rows_beyond_n_rows_untouched(rng, n_rows):
    G, gs = 10, 32
    nib, q, s, m, x = problem4(rng, 1, n_rows, G, gs)
    xq, xa, xs, xsum = kernels.quantize_activations(x)
    qg, sg, mg = guarded(q.reshape(-1)), guarded(s.reshape(-1)), guarded(m.reshape(-1))
    out = np.full(n_rows + 6, 12345.0, dtype=np.float32)
    one_call4(qg, G * gs // 2, xq.reshape(-1), sg, xs.reshape(-1), mg, xsum.reshape(-1), G, gs, out, 3, n_rows)
    assert (out[:3] == 12345.0).all() and (out[3 + n_rows:] == 12345.0).all()
    check(out[None, 3:3 + n_rows], terms4(xq, xs, xsum, nib, s, m))


def test_int4_matmul_is_the_twin(rng):
    # the whole matvec (threads, blocks of rows) against FastWeight's numpy twin, on a real quantized matrix
    from stage1_cpu.fast.weight import fast_quantize
    for gs in (32, 64, 128):
        W = fast_quantize(rng.standard_normal((301, 4 * gs + 7)).astype(np.float32), "int4", gs, decode_act="int8")
        x = rng.standard_normal((3, W.in_features)).astype(np.float32)
        ref = W.matmul_ref(x)
        np.testing.assert_allclose(W.matmul(x), ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


@pytest.mark.parametrize("gs", [96, 256])
def test_other_group_sizes(rng, gs):
    # not 32 / 64 / 128: the loop over a group's chunks (dot_int8_row itself needs a power of 2)
    q, s, x = problem(rng, 1, 6, 11, gs)
    xq, xa, xs, _ = kernels.quantize_activations(x)
    x16, xs16 = kernels.quantize_activations16(x)
    out = np.zeros((1, 6), dtype=np.float32)
    rows8(xq, xa, xs, q, s, out, False)
    check(out, terms(xq, xs, q, s))
    rows16(x16, xs16, q, s, out, True)
    check(out, terms(x16, xs16, q, s))


@pytest.mark.parametrize("n_rows", [1, 2, 3, 4])
@pytest.mark.parametrize("gs", [32, 128])
def test_rows_beyond_n_rows_untouched(rng, n_rows, gs):
    # q and s hold exactly n_rows rows, followed by an unreadable page; the output
    # around the n_rows results keeps its sentinel
    G = 9
    q, s, x = problem(rng, 1, n_rows, G, gs)
    xq, xa, xs, _ = kernels.quantize_activations(x)
    x16, xs16 = kernels.quantize_activations16(x)
    qg, sg = guarded(q.reshape(-1)), guarded(s.reshape(-1))
    out = np.full(n_rows + 6, 12345.0, dtype=np.float32)
    one_call8(qg, G * gs, xq.reshape(-1), xa.reshape(-1), sg, xs.reshape(-1), G, gs, out, 3, n_rows)
    assert (out[:3] == 12345.0).all() and (out[3 + n_rows:] == 12345.0).all()
    check(out[None, 3:3 + n_rows], terms(xq, xs, q, s))
    out[:] = 12345.0
    one_call16(qg, G * gs, x16.reshape(-1), sg, xs16.reshape(-1), G, gs, out, 3, n_rows)
    assert (out[:3] == 12345.0).all() and (out[3 + n_rows:] == 12345.0).all()
    check(out[None, 3:3 + n_rows], terms(x16, xs16, q, s))


def test_padded_rows(rng):
    # row_stride between one and two rows: still adjacent rows (scales n_groups apart, outputs 1 apart)
    O, G, gs, pad = 7, 5, 64, 32
    q, s, x = problem(rng, 1, O, G, gs)
    xq, xa, xs, _ = kernels.quantize_activations(x)
    qp = np.zeros((O, G * gs + pad), dtype=np.int8)
    qp[:, :G * gs] = q.reshape(O, -1)
    qf = qp.reshape(-1)
    out = np.zeros(O, dtype=np.float32)
    for r in range(0, O, 4):
        n = min(4, O - r)
        one_call8(qf[r * (G * gs + pad):], G * gs + pad, xq.reshape(-1), xa.reshape(-1), s.reshape(-1)[r * G:],
                  xs.reshape(-1), G, gs, out[r:], 0, n)
    check(out[None], terms(xq, xs, q, s))


def test_nan_reaches_its_token(rng):
    # token 1: a NaN in group 4 (a block of 8 groups), token 3: in group 9 (the groups after the blocks)
    O, G, gs = 9, 10, 32
    q, s, x = problem(rng, 4, O, G, gs)
    x[1, 4, 7] = np.nan
    x[3, 9, 0] = np.nan
    xq, xa, xs, xsum = kernels.quantize_activations(x)
    assert np.isnan(xs[1, 4]) and np.isnan(xs[3, 9])
    x16, xs16 = kernels.quantize_activations16(x)
    for spread in (False, True):
        for run in (lambda out: rows8(xq, xa, xs, q, s, out, spread), lambda out: rows16(x16, xs16, q, s, out, spread)):
            out = np.zeros((4, O), dtype=np.float32)
            run(out)
            assert np.isnan(out[[1, 3]]).all() and np.isfinite(out[[0, 2]]).all()
    _, q4, s4, m4, _ = problem4(rng, 4, O, G, gs)
    for spread in (False, True):
        out = np.zeros((4, O), dtype=np.float32)
        rows4(xq, xs, xsum, q4, s4, m4, out, spread)
        assert np.isnan(out[[1, 3]]).all() and np.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("x_scale,s_range", [(1e20, (1e3, 6e4)), (1e-20, (1e-4, 1e-3)), (1e-12, (2e-7, 1e-6))])
def test_extreme_magnitudes(rng, x_scale, s_range):
    O, G, gs = 9, 12, 64
    q, s, x = problem(rng, 1, O, G, gs, x_scale=x_scale, s_range=s_range)
    xq, xa, xs, _ = kernels.quantize_activations(x)
    x16, xs16 = kernels.quantize_activations16(x)
    out = np.zeros((1, O), dtype=np.float32)
    rows8(xq, xa, xs, q, s, out, False)
    check(out, terms(xq, xs, q, s))
    rows16(x16, xs16, q, s, out, True)
    check(out, terms(x16, xs16, q, s))
