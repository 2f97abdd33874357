"""The int8-activation prefill GEMM (stage1_cpu/fast/gemm.py) against its definitions.

- gemm_ref: the same arithmetic in numpy (activations rounded per token and group,
  exact integer dot products, the scales in float64). The kernel sums the groups'
  fp32 terms in its own order (8 lanes per (row, token), then a reduction), so the
  bound is stated: |kernel - ref| <= (G + 8) * 2^-23 * sum_g |term_g|.
- fp32 activations: rounding x to xq * xs moves each activation by at most xs / 2,
  so |kernel - x @ W.T| <= sum_k |W[r, k]| xs[t, g(k)] / 2 (+ the same fp32 slack).
- FastWeight routes prefill (T >= PREFILL_MIN_T) there only with prefill_act="int8";
  --activations fp32 never does.
The logits of whole models on this path against transformers and against the numpy
twin are test_stage1_model.py's (the int8 / int4 bounds there).
"""
from __future__ import annotations

import numpy as np
import pytest

from stage1_cpu import quant
from stage1_cpu.fast import AUTO_GEMM_PREFILL, choose_act, cpu
from stage1_cpu.fast import kernels as fk
from stage1_cpu.fast.weight import as_fast, fast_quantize

NEEDS_INT8 = pytest.mark.skipif(not cpu.INT8, reason="no int8 dot product on this target (VNNI or AVX2)")
EPS = 2.0 ** -23


@pytest.fixture
def rng():
    return np.random.default_rng(28)


def _weight(rng, fmt, gs, O, K, **act):
    return fast_quantize((rng.standard_normal((O, K)) * 0.5).astype(np.float32), fmt, gs, **act)


def _rounded(w, x, act="int8"):
    """x [T, K] -> xq, xs, xsum as the kernel sees them (padded to whole groups); act int16: x16, xs and
    xsum = xs sum(x16), computed here in float64 from the integers."""
    xp = np.zeros((x.shape[0], w.padded_in), dtype=np.float32)
    xp[:, : x.shape[1]] = x
    if act == "int16":
        x16, xs = fk.quantize_activations16(xp.reshape(x.shape[0], -1, w.group_size))
        return x16, xs, x16.astype(np.int64).sum(-1) * xs.astype(np.float64)
    xq, _, xs, xsum = fk.quantize_activations(xp.reshape(x.shape[0], -1, w.group_size))
    return xq, xs, xsum


def _abs_terms(w, xq, xs, xsum):
    """sum_g |s xs (q . xq)| (+ |m xsum|): the scale of the fp32 rounding bound."""
    from stage1_cpu.fast import gemm

    class Abs:                                             # |W| and |xq| through the same twin
        fmt, out_features = w.fmt, w.out_features
        scales = np.abs(w.scales.view(np.float16)).view(np.uint16)
        data = np.abs(w.data.astype(np.int16)).astype(np.int8) if w.fmt == "int8" else w.data
        mins = None if w.mins is None else np.abs(w.mins.view(np.float16)).view(np.uint16)
    return gemm.gemm_ref(np.abs(xq.astype(np.int32)), xs, None if xsum is None else np.abs(xsum), Abs)


@NEEDS_INT8
@pytest.mark.parametrize("fmt,act", [("int8", "int8"), ("int4", "int8"), ("int8", "int16"), ("int4", "int16")])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("O,K,T", [(37, 200, 11), (64, 256, 8), (70, 384, 67)])  # row / token / group tails
def test_prefill_gemm_equals_its_integer_definition(rng, fmt, act, gs, O, K, T):
    from stage1_cpu.fast import gemm
    w = _weight(rng, fmt, gs, O, K, decode_act="int8", prefill_act=act)
    x = (rng.standard_normal((T, K)) * 2.0).astype(np.float32)
    got = w.matmul(x)
    xq, xs, xsum = _rounded(w, x, act)
    ref = gemm.gemm_ref(xq, xs, xsum, w)
    G = xq.shape[1]
    bound = (G + 8) * EPS * _abs_terms(w, xq, xs, xsum) + 1e-30
    err = np.abs(got - ref)
    assert (err <= bound).all(), float((err / bound).max())
    assert np.abs(ref).max() > 1.0                           # not a test of zeros
    # the twin FastWeight.matmul_ref rounds x the same way (fp32 BLAS after it)
    ref32 = w.matmul_ref(x)
    assert np.abs(got - ref32).max() <= 1e-5 * np.abs(ref32).max()


@NEEDS_INT8
@pytest.mark.parametrize("fmt,gs,act", [("int8", 32, "int8"), ("int4", 64, "int8"), ("int8", 128, "int8"),
                                        ("int8", 32, "int16"), ("int4", 64, "int16")])
def test_prefill_gemm_within_the_activation_rounding_of_fp32(rng, fmt, gs, act):
    """Against fp32 activations: no more than the rounding of each x to its group's grid allows
    (int16: a grid 258 times finer, so a bound 258 times tighter)."""
    O, K, T = 48, 320, 19
    w = _weight(rng, fmt, gs, O, K, decode_act="int8", prefill_act=act)
    x = (rng.standard_normal((T, K)) * 3.0).astype(np.float32)
    got = w.matmul(x)
    exact = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
    _, xs, _ = _rounded(w, x, act)
    step = np.repeat(xs, gs, axis=1)[:, :K] / 2                # |x - xq xs| <= xs / 2
    bound = step @ np.abs(w.dequantize()).T.astype(np.float64)
    err = np.abs(got - exact)
    slack = (1e-4 if act == "int8" else 2e-6) * np.abs(exact).max()      # fp32 sums (the int16 rounding is smaller)
    assert (err <= bound * (1 + 1e-3) + slack).all()
    if act == "int8":      # and the rounding does show (the path taken is the int8 one, not fp32)
        assert err.max() > 1e-4 * np.abs(exact).max()


@NEEDS_INT8
def test_only_prefill_int8_takes_the_gemm(rng):
    """prefill_act fp32 keeps the core's tile + sgemm bit for bit; int8 changes only T >= PREFILL_MIN_T."""
    K = 96
    x = (rng.standard_normal((quant.PREFILL_MIN_T + 3, K))).astype(np.float32)
    plain = quant.quantize((rng.standard_normal((40, K))).astype(np.float32), "int8", 32)
    np.testing.assert_array_equal(as_fast(plain, "int8", "fp32").matmul(x), plain.matmul(x))
    gem = as_fast(plain, "fp32", "int8")
    assert not np.array_equal(gem.matmul(x), plain.matmul(x))
    np.testing.assert_array_equal(gem.matmul(x[:3]), plain.matmul(x[:3]))   # decode: untouched
    assert choose_act("int8", "fp32", K)["prefill_act"] == "fp32"
    assert choose_act("int4", "fp32", K)["prefill_act"] == "fp32"
    # where AVX-512 BF16 exists too, the integer GEMM ranks ahead of the bf16 one for int8 / int4 weights
    # (docs/stage1.md, section 14, "What did not pay off"); bf16 weights keep theirs
    assert choose_act("int8", "int8", K)["prefill_act"] == "int8"
    assert choose_act("int4", "int8", K)["prefill_act"] == "int8"
    for fmt in ("int8", "int4"):                               # auto: both, on int16 activations
        assert choose_act(fmt, "auto", K)["prefill_act"] == ("int16" if fmt in AUTO_GEMM_PREFILL else "fp32")
    assert AUTO_GEMM_PREFILL == ("int8", "int4")
    assert choose_act("bf16", "auto", K)["prefill_act"] == ("bf16" if cpu.BF16 else "fp32")


def test_int8_prefill_refused_without_an_int8_dot(rng):
    if cpu.INT8:
        with pytest.raises(ValueError, match="not available"):
            fast_quantize(np.ones((4, 64), np.float32), "bf16", prefill_act="int8")
        return
    # NUMBA_CPU_NAME=generic (no AVX2): refused, and auto never asks for it, so nothing compiles it
    with pytest.raises(ValueError, match="int8 prefill activations are not available"):
        fast_quantize(np.ones((4, 64), np.float32), "int8", prefill_act="int8")
    assert choose_act("int8", "auto", 64)["prefill_act"] == "fp32"


@NEEDS_INT8
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_int8_prefill_logits_close_to_transformers(family):
    """A whole prompt (14 tokens: the prefill path) through the int8 GEMM, against
    transformers' fp32 logits: within the int8 / int4 bounds test_stage1_model.py uses."""
    from models import hf_logits, make_model
    from test_stage1_model import PROMPT, QUANT_TOL, logits_all, rel_err
    folder = make_model(family, hidden_size=128, intermediate_size=256, initializer_range=0.05)
    from stage1_cpu.weights import load_weights
    assert load_weights(folder, "int4", 32, progress=False, activations="int8").layers[0].wqkv.prefill_act == "int8"
    ref = hf_logits(folder, PROMPT)
    for fmt in ("int8", "int4"):
        gemm_err = rel_err(logits_all(folder, PROMPT, fmt=fmt, group_size=32, activations="int8"), ref)
        assert 0 < gemm_err < QUANT_TOL[fmt], (fmt, gemm_err)
    # --activations auto: int8 and int4 weights on int16 activations, as close as fp32 activations
    for fmt in ("int8", "int4"):
        assert load_weights(folder, fmt, 32, progress=False).layers[0].wqkv.prefill_act == "int16"
        auto_err = rel_err(logits_all(folder, PROMPT, fmt=fmt, group_size=32), ref)
        fp32_err = rel_err(logits_all(folder, PROMPT, fmt=fmt, group_size=32, activations="fp32"), ref)
        assert 0 < auto_err < QUANT_TOL[fmt] and auto_err < 1.05 * fp32_err + 1e-4, (fmt, auto_err, fp32_err)


@NEEDS_INT8
@pytest.mark.parametrize("O,K", [(21, 128), (24, 512)])      # a last vector of 5 rows, G = 2; two full ones, G = 8
@pytest.mark.parametrize("fmt,per", [("int8", 2), ("int8", 4), ("int4", 4), ("int4", 2)])
def test_repacked_block_puts_eight_rows_side_by_side(rng, fmt, per, O, K):
    """repack_int8 / repack_int4 (what each thread builds before its tiles): vector v, group g,
    step j holds rows r0+8v..r0+8v+7's values j*per.. of group g (zeros past O), and the fp16
    scales / minima of those rows (8 groups at a time through a transpose where G % 8 == 0);
    int8 in the pairs layout (per 2) and in the quads one as q + 128 (per 4, VNNI's tile_int8_q8),
    int4 in the quads layout (per 4) and the pairs one (per 2)."""
    from numba import njit

    from stage1_cpu.fast import gemm
    w = _weight(rng, fmt, 64, O, K)                            # from r0 = 8, two vectors of 8 rows
    r0, nv, G = 8, 2, K // 64
    data, s = w.data.reshape(O, -1), w.scales.view(np.uint16)
    sl, ml = np.full(nv * G * 8, 7, np.uint16), np.full(nv * G * 8, 7, np.uint16)
    if fmt == "int8":
        word, flip = (np.int16, 0) if per == 2 else (np.uint32, 0x80808080)
        wl = np.full(nv * K * 8 // per, 7, word)
        njit(lambda q, s, r0, wl, sl, flip: gemm.repack_int8(q, s, r0, wl, sl, flip))(data.view(word), s, r0, wl, sl,
                                                                                      flip)
        q = w.data if per == 2 else (w.data.astype(np.int16) + 128).astype(np.uint8)     # q + 128: unsigned bytes
    else:
        word = np.uint32 if per == 4 else np.uint16
        wl = np.full(nv * K * 8 // per, 7, word)
        njit(lambda b, s, m, gs, r0, wl, sl, ml: gemm.repack_int4(b, s, m, gs, r0, wl, sl, ml))(
            data.view(word), s, w.mins.view(np.uint16), 64, r0, wl, sl, ml)
        q = np.stack([w.data & 15, w.data >> 4], axis=2).reshape(O, -1, 64)
    wp, sp = wl.view(q.dtype).reshape(nv, G, 64 // per, 8, per), sl.reshape(nv, G, 8)
    for r, g, k in [(8, 0, 0), (9, 1, 37), (20, 1, 63), (15, 0, 5), (O - 1, G - 1, 62)]:
        assert wp[(r - r0) // 8, g, k // per, r % 8, k % per] == q[r, g, k]
    for got, half in [(sp, w.scales)] + ([(ml.reshape(nv, G, 8), w.mins)] if fmt == "int4" else []):
        want = np.zeros((nv, G, 8), np.uint16)                 # every scale's (minimum's) bits in its lane, zeros past O
        for r in range(r0, min(O, r0 + 8 * nv)):
            want[(r - r0) // 8, :, r % 8] = half[r].view(np.uint16)
        np.testing.assert_array_equal(got, want)
    if O == 21:
        assert not wp[1, :, :, 5:].any()


@NEEDS_INT8
@pytest.mark.parametrize("fmt,act", [("int8", "int8"), ("int4", "int8"), ("int4", "int16")])
def test_expert_parts_equal_the_part_alone(rng, fmt, act):
    """MoE prefill multiplies w.part(e * n, (e + 1) * n), a view of the stacked rows, on or off an
    8-row boundary: each equals the part copied out and multiplied on its own."""
    K, n = 128, 24
    w = _weight(rng, fmt, 32, 4 * n, K, prefill_act=act)
    x = rng.standard_normal((quant.PREFILL_MIN_T + 5, K)).astype(np.float32)
    for r0, r1 in [(n, 2 * n), (3 * n, 4 * n), (4, 4 + n)]:                 # aligned, the last, unaligned
        part = w.part(r0, r1)
        alone = as_fast(quant.Weight(w.fmt, r1 - r0, K, 32, w.data[r0:r1].copy(), w.scales[r0:r1].copy(),
                                     None if w.mins is None else w.mins[r0:r1].copy()), "fp32", act)
        np.testing.assert_array_equal(part.matmul(x), alone.matmul(x))
