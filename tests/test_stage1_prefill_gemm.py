"""The int8-activation prefill GEMM (stage1_cpu/fast/gemm.py) against its definitions.

- gemm_ref: the same arithmetic in numpy (activations rounded per token and group,
  exact integer dot products, the scales in float64). The kernel adds the groups'
  fp32 terms one after another, so the bound is stated:
  |kernel - ref| <= (G + 8) * 2^-23 * sum_g |term_g|.
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

NEEDS_INT8 = pytest.mark.skipif(not cpu.INT8, reason="no int8 dot product on this target (VNNI, "
                                                     "AVX2 or ARM dotprod)")
EPS = 2.0 ** -23


@pytest.fixture
def rng():
    return np.random.default_rng(28)


def _weight(rng, fmt, gs, O, K, **act):
    if act.get("prefill_act") in ("int8", "int16"):
        # the integer GEMM reads the decode tiles
        act.setdefault("decode_act", "int8")
    return fast_quantize((rng.standard_normal((O, K)) * 0.5).astype(np.float32), fmt, gs, **act)


def _rounded(w, x, act="int8"):
    """x [T, K] -> xq, xs, xsum as the kernel sees them (padded to whole groups); act int16: x16, xs
    and xsum = xs sum(x16), computed here in float64 from the integers."""
    xp = np.zeros((x.shape[0], w.padded_in), dtype=np.float32)
    xp[:, : x.shape[1]] = x
    if act == "int16":
        x16, xs, _ = fk.quantize_activations16(xp.reshape(x.shape[0], -1, w.group_size))
        return x16, xs, x16.astype(np.int64).sum(-1) * xs.astype(np.float64)
    xq, _, xs, xsum = fk.quantize_activations(xp.reshape(x.shape[0], -1, w.group_size))
    return xq, xs, xsum


def _abs_terms(w, xq, xs, xsum):
    """sum_g |s xs (q . xq)| (+ |m xsum|): the scale of the fp32 rounding bound."""
    from stage1_cpu.fast import gemm

    from stage1_cpu.fast import tiles
    data, scales, mins = tiles.untile(w.data, w.scales, w.mins, w.out_features, w.seg, w.padded_in,
                                      w.fmt == "int4")

    class Abs:                                             # |W| and |xq| through the same twin
        fmt, out_features = w.fmt, w.out_features
    Abs.scales = np.abs(scales.view(np.float16)).view(np.uint16)
    Abs.data = np.abs(data.astype(np.int16)).astype(np.int8) if w.fmt == "int8" else data
    Abs.mins = None if mins is None else np.abs(mins.view(np.float16)).view(np.uint16)
    return gemm.gemm_ref(np.abs(xq.astype(np.int32)), xs,
                         None if xsum is None else np.abs(xsum), Abs)


@NEEDS_INT8
@pytest.mark.parametrize("fmt,act",
                         [("int8", "int8"), ("int4", "int8"), ("int8", "int16"), ("int4", "int16")])
@pytest.mark.parametrize("gs", [32, 64, 128])
# row / token / group tails
@pytest.mark.parametrize("O,K,T", [(37, 200, 11), (64, 256, 8), (70, 384, 67)])
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
@pytest.mark.parametrize("fmt,gs,act", [("int8", 32, "int8"), ("int4", 64, "int8"),
                                        ("int8", 128, "int8"),
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
    # fp32 sums (the int16 rounding is smaller)
    slack = (1e-4 if act == "int8" else 2e-6) * np.abs(exact).max()
    assert (err <= bound * (1 + 1e-3) + slack).all()
    if act == "int8":      # and the rounding does show (the path taken is the int8 one, not fp32)
        assert err.max() > 1e-4 * np.abs(exact).max()


@NEEDS_INT8
def test_only_prefill_int8_takes_the_gemm(rng):
    """prefill_act fp32 keeps the core's tile + sgemm bit for bit (on rows read back from the
    tiles); int8 changes only T >= PREFILL_MIN_T."""
    K = 96
    x = (rng.standard_normal((quant.PREFILL_MIN_T + 3, K))).astype(np.float32)
    plain = quant.quantize((rng.standard_normal((40, K))).astype(np.float32), "int8", 32)
    tiled = as_fast(plain, "int8", "fp32")
    assert tiled.tiled and not np.shares_memory(tiled.data, plain.data)
    np.testing.assert_array_equal(tiled.matmul(x), plain.matmul(x))
    gem = as_fast(plain, "int8", "int8")
    assert not np.array_equal(gem.matmul(x), plain.matmul(x))
    np.testing.assert_array_equal(gem.matmul(x[:3]), tiled.matmul(x[:3]))   # decode: untouched
    with pytest.raises(ValueError, match="decode activations to int8 or int16"):
        # the GEMM reads the tiles decode makes
        as_fast(plain, "fp32", "int8")
    assert choose_act("int8", "fp32", K)["prefill_act"] == "fp32"
    assert choose_act("int4", "fp32", K)["prefill_act"] == "fp32"
    # where AVX-512 BF16 exists too, the integer GEMM ranks ahead of the bf16 one for int8 / int4
    # weights (docs/stage1.md, section 14, "What did not pay off"); bf16 weights keep theirs
    assert choose_act("int8", "int8", K)["prefill_act"] == "int8"
    assert choose_act("int4", "int8", K)["prefill_act"] == "int8"
    for fmt in ("int8", "int4"):                               # auto: both, on int16 activations
        # ARM64: sgemm (cpu.INT16_GEMM)
        assert choose_act(fmt, "auto", K)["prefill_act"] == (
            "int16" if fmt in AUTO_GEMM_PREFILL and cpu.INT16_GEMM else "fp32")
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
    from bench.testbed.models import hf_logits, make_model
    from test_stage1_model import PROMPT, QUANT_TOL, logits_all, rel_err
    folder = make_model(family, hidden_size=128, intermediate_size=256, initializer_range=0.05)
    from common.config import ModelConfig
    from stage1_cpu.weights import load_weights
    cfg = ModelConfig.from_folder(folder)
    w = load_weights(folder, cfg, "int4", 32, progress=False, activations="int8")
    assert w.layers[0].wqkv.prefill_act == "int8"
    ref = hf_logits(folder, PROMPT)
    for fmt in ("int8", "int4"):
        gemm_err = rel_err(logits_all(folder, PROMPT, fmt=fmt,
                                      group_size=32, activations="int8"), ref)
        assert 0 < gemm_err < QUANT_TOL[fmt], (fmt, gemm_err)
    # --activations auto: int8 and int4 weights on int16 activations, as close as fp32 activations
    for fmt in ("int8", "int4"):
        w = load_weights(folder, cfg, fmt, 32, progress=False)
        assert w.layers[0].wqkv.prefill_act == "int16"
        auto_err = rel_err(logits_all(folder, PROMPT, fmt=fmt, group_size=32), ref)
        fp32_err = rel_err(logits_all(folder, PROMPT, fmt=fmt,
                                      group_size=32, activations="fp32"), ref)
        assert 0 < auto_err < QUANT_TOL[fmt] and auto_err < 1.05 * fp32_err + 1e-4, (fmt, auto_err,
                                                                                    fp32_err)


@NEEDS_INT8
# a part-filled last block;
@pytest.mark.parametrize("O,K,seg", [(21, 128, 21), (24, 512, 24), (36, 128, 12)])
# full ones; 3 segments of 12
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_tiles_put_eight_rows_side_by_side(rng, fmt, O, K, seg):
    """tiles.to_tiles (made once per matrix at load): block v, step u holds 4 values of 8 rows
    side by side (int4: the bytes of nibble pairs), each segment of seg rows (one expert) padded
    with zero rows to whole blocks; the fp16 scales and minima of those rows side by side; and
    what reads them back (rows, dequantize) gives the matrix as stored."""
    from stage1_cpu.fast import tiles
    w = quant.quantize((rng.standard_normal((O, K)) * 0.5).astype(np.float32), fmt, 64)
    data, scales, mins = tiles.to_tiles(w.data, w.scales, w.mins, seg)
    seg8 = -(-seg // 8) * 8
    assert data.shape[0] == (O // seg) * seg8 // 8 and scales.shape == (data.shape[0], K // 64, 8)
    # [O, Kp] bytes (int4: Kp / 2 nibble pairs)
    stored = w.data.reshape(O, -1)
    for r in range(O):
        t = (r // seg) * seg8 + r % seg                        # the row's place in the tiles
        np.testing.assert_array_equal(data[t // 8, :,
                                           4 * (t % 8):4 * (t % 8) + 4].reshape(-1), stored[r])
        np.testing.assert_array_equal(scales[t // 8, :, t % 8], w.scales[r].view(np.uint16))
        if fmt == "int4":
            np.testing.assert_array_equal(mins[t // 8, :, t % 8], w.mins[r].view(np.uint16))
    padding = [t for t in range(data.shape[0] * 8) if t % seg8 >= seg]
    assert all(not data[t // 8, :,
                        4 * (t % 8):4 * (t % 8) + 4].any() and not scales[t // 8, :, t % 8].any()
               for t in padding)
    fw = as_fast(w, "int8", "fp32")
    np.testing.assert_array_equal(fw.dequantize(), w.dequantize())
    np.testing.assert_array_equal(fw.rows(np.array([O - 1, 0, 5])), w.rows(np.array([O - 1, 0, 5])))


@NEEDS_INT8
@pytest.mark.parametrize("fmt,act", [("int8", "int8"), ("int4", "int8"), ("int4", "int16")])
def test_expert_parts_equal_the_part_alone(rng, fmt, act):
    """MoE multiplies w.part(e * n, (e + 1) * n), a view of one expert's blocks in the stacked tiles
    (each expert padded to whole blocks of 8 rows: n = 20 is not one): each equals the expert
    tiled and multiplied on its own, at decode and at prefill. A part across experts is refused."""
    from common.loader import stack
    K, n = 128, 20
    experts = [quant.quantize((rng.standard_normal((n, K)) * 0.5).astype(np.float32), fmt, 32)
               for _ in range(4)]
    w = stack([as_fast(e, "int8", act) for e in experts])      # as the loader stacks them
    assert w.seg == n and w.data.shape[0] == 4 * 3
    for T in (3, quant.PREFILL_MIN_T + 5):
        x = rng.standard_normal((T, K)).astype(np.float32)
        for e in (1, 3):
            np.testing.assert_array_equal(w.part(e * n, (e + 1) * n).matmul(x),
                                          as_fast(experts[e], "int8", act).matmul(x))
    with pytest.raises(ValueError, match="segments"):
        w.part(4, 4 + n)
