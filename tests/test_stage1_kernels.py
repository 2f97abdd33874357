"""Stage 1's numba kernels against their numpy twins, and the weight formats.

- every kernel in stage1_cpu/kernels.py equals its definition in stage1_cpu/ops.py
  at awkward shapes (T=1, prefill T>1, odd head counts, GQA 16/8, one KV head);
- every quantized Weight.matmul (the fused numba path, and the tiled prefill
  path) equals its dequantize-then-matmul twin, also when in_features is not a
  multiple of the group size;
- the quantization error itself is bounded, and bf16 rounding is torch's.

Tolerances: kernels vs twins differ only in summation order, so fp32 rounding:
relative 1e-5 of the output's scale (measured up to ~1e-6).
"""
from __future__ import annotations

import numpy as np
import pytest

from stage1_cpu import kernels, ops, quant
from stage1_cpu.fast import cpu
from stage1_cpu.fast.weight import fast_quantize
from stage1_cpu.jit.numba_cache import set_threads
from stage1_cpu.quant import Weight, quantize

NO_INT8_DOT = ("this CPU (or NUMBA_CPU_NAME) has no int8 dot product: neither AVX-512 VNNI / "
               "AVX-VNNI (vpdpbusd), AVX2 (vpmaddubsw) nor ARM dotprod (sdot)")
NO_BF16 = "this CPU (or NUMBA_CPU_NAME) has no AVX-512 BF16 (vdpbf16ps)"

RTOL = 1e-5  # fp32, different summation order


def close(a: np.ndarray, b: np.ndarray, rtol: float = RTOL) -> float:
    """Largest error relative to the reference's largest magnitude; asserts it is < rtol."""
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == np.float32
    scale = float(np.abs(b).max())
    assert scale > 0, "reference is all zeros: the test would prove nothing"
    err = float(np.abs(a - b).max()) / scale
    assert err < rtol, f"relative error {err:.2e} >= {rtol:.0e}"
    return err


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------- element-wise ops


@pytest.mark.parametrize(
    "shape", [(1, 64), (5, 72), (70, 96), (1, 16, 128), (7, 3, 64), (5, 16, 8)]
)
def test_rmsnorm_matches_ops(rng, shape):
    # 2-D is the residual stream ([T, C]), 3-D the per-head q/k norm ([T, H, D], w [D]);
    # 70 rows and 5*16 rows take the parallel path, the rest the serial one
    x = randn(rng, *shape, scale=3.0)
    w = randn(rng, shape[-1])
    close(kernels.rmsnorm(x, w, 1e-6), ops.rmsnorm(x, w, 1e-6))


@pytest.mark.parametrize("T,F", [(1, 96), (3, 50), (20, 128)])
def test_silu_mul_matches_ops(rng, T, F):
    gate_up = np.concatenate([randn(rng, T, F, scale=4.0), randn(rng, T, F)], axis=1)   # [T, 2F]
    close(kernels.silu_mul(gate_up), ops.silu_mul(gate_up))


@pytest.mark.parametrize("T,H,D", [(1, 16, 128), (4, 3, 64), (17, 2, 16)])
def test_rope_matches_ops(rng, T, H, D):
    cos, sin = ops.rope_tables(64, D, 10000.0)
    x = randn(rng, T, H, D)
    start = 5
    c, s = cos[start:start + T], sin[start:start + T]
    close(kernels.rope(x, c, s), ops.rope(x, c, s))


@pytest.mark.parametrize("T,H,Hkv,D,start_pos", [
    (1, 16, 8, 128, 0),      # decode, first position, Qwen3-0.6B's GQA 16/8
    (1, 16, 8, 128, 37),     # decode over a filled cache
    (7, 3, 1, 64, 0),        # prefill, odd head count, one KV head
    (5, 6, 2, 32, 11),       # prefill that continues a cached prefix
    (8, 16, 8, 128, 600),    # few queries over a long cache
    (64, 4, 4, 64, 3),       # no GQA; the fast path's prefill in tiles (T >= ATT_BLAS_MIN_T)
    # BLAS: two of its query blocks of ATT_BLOCK, the second one partial; tiles: 3 blocks
    (130, 3, 1, 32, 9),
    # tiles: Qwen3-0.6B's heads, 32-query blocks, the second partial, after a prefix
    (40, 16, 8, 128, 21),
    # tiles: SmolLM2's 9 / 3 heads, 63 rows a block (padded to 64), not a multiple of 6
    (33, 9, 3, 64, 2),
    # tiles: 8 heads a KV head, 8-query blocks: three, taken in the order 0, 2, 1
    (19, 8, 1, 16, 0),
    (20, 2, 1, 40, 0),       # D = 40, not a multiple of 16: BLAS
])
def test_attention_matches_ops(rng, T, H, Hkv, D, start_pos):
    Tmax = start_pos + T + 9  # cache longer than used: stale rows beyond must be ignored
    q = randn(rng, T, H, D, scale=2.0)
    k_cache = randn(rng, Hkv, Tmax, D, scale=2.0)
    v_cache = randn(rng, Hkv, Tmax, D)
    ref = ops.attention(q, k_cache, v_cache, start_pos)
    close(kernels.attention(q, k_cache, v_cache, start_pos), ref)
    # the fast path's: tiles (or BLAS) from ATT_BLAS_MIN_T queries
    from stage1_cpu.fast import attention
    close(attention.attention(q, k_cache, v_cache, start_pos), ref)
    # each version on its own, into NaNs: every output must be written
    if T >= attention.ATT_BLAS_MIN_T:
        tiled = attention.TILED and D % 16 == 0
        rows = max(1, attention.ROWS // (H // Hkv))
        for run in [attention.attention_blas] + [
                lambda *a: attention.attention_tiled(*a, rows)] * tiled:
            out = np.full_like(q, np.nan)
            run(q, k_cache, v_cache, start_pos, out)
            close(out, ref)


@pytest.mark.parametrize(
    "T,E,k,norm", [(1, 8, 2, True), (5, 8, 4, False), (3, 128, 8, True), (2, 6, 1, False)]
)
def test_route_matches_ops(rng, T, E, k, norm):
    """The router's choice: the same experts, best first, and weights to fp32 rounding
    (ops.softmax uses np.exp, the kernel exp_f32, ~2 ulp)."""
    logits = rng.standard_normal((T, E)).astype(np.float32) * 3
    logits[0, 1] = logits[0, 0]                              # a tie: the lower id goes first
    top, w = kernels.route(logits, k, norm)
    top_ref, w_ref = ops.route(logits, k, norm)
    assert np.array_equal(top, top_ref)
    close(w, w_ref, 1e-6 * 4)
    if norm:
        assert np.allclose(w.sum(-1), 1, atol=1e-6)
    assert (np.diff(w, axis=-1) <= 0).all()                 # best first


@pytest.mark.parametrize("T,k,C", [(1, 2, 96), (4, 8, 130)])
def test_mix_and_gated_add_match_ops(rng, T, k, C):
    y = rng.standard_normal((T * k, C)).astype(np.float32)
    w = rng.random((T, k)).astype(np.float32)
    close(kernels.mix(y, w), ops.mix(y, w))
    out, ys, gate = (rng.standard_normal((T, C)).astype(np.float32),
                     rng.standard_normal((T, C)).astype(np.float32),
                     rng.standard_normal((T, 1)).astype(np.float32) * 4)
    close(kernels.gated_add(out, ys, gate), ops.gated_add(out, ys, gate))


def test_attention_rejects_uneven_gqa(rng):
    with pytest.raises(ValueError, match="3 KV heads"):
        kernels.attention(randn(rng, 1, 4, 8), randn(rng, 3, 4, 8), randn(rng, 3, 4, 8), 0)


# ---------------------------------------------------------------- quantized matmul

FORMAT_CASES = [("bf16", 0)] + [(f, gs) for f in ("int8", "int4") for gs in (32, 64, 128)]


@pytest.mark.parametrize("fmt,gs", FORMAT_CASES)
@pytest.mark.parametrize("O,K", [(96, 256), (40, 72)])   # 72: not a multiple of any group size
def test_quantized_matmul_matches_dequantized_twin(rng, fmt, gs, O, K):
    W = quantize(randn(rng, O, K), fmt, gs)
    assert (W.out_features, W.in_features, W.fmt) == (O, K, fmt)
    # T=1 and 3 take the fused decode kernel, PREFILL_MIN_T + 5 the tiled BLAS path
    for T in (1, 3, quant.PREFILL_MIN_T + 5):
        x = randn(rng, T, K)
        close(W.matmul(x), W.matmul_ref(x))


# 37 rows: blocks whose last group of four is part-filled
@pytest.mark.parametrize("O,K", [(96, 256), (37, 72)])
def test_fast_bf16_four_rows_per_pass_match_the_twin_and_the_core(rng, O, K):
    """fast/blocks.py's bf16 decode (four rows per pass, whole blocks of rows): each row
    is the twin's and the core's one-row kernel's to fp32 rounding."""
    from stage1_cpu.fast import blocks
    W = fast_quantize(randn(rng, O, K), "bf16")
    for T in (1, 3):
        x = randn(rng, T, K)
        out = np.empty((T, O), dtype=np.float32)
        blocks.matmul_bf16(x, W.data, out)
        assert np.array_equal(W.matmul(x), out)                       # FastWeight runs it at decode
        close(out, W.matmul_ref(x))
        close(out, Weight.matmul(W, x))                               # the core's one row at a time


ACT_CASES = ([("bf16", 0, "fp32", "bf16")]
             + [(f, gs, "int8", "fp32") for f in ("int8", "int4") for gs in (32, 128)]
             + [("int8", gs, "int16", "fp32") for gs in (32, 128)])


@pytest.mark.parametrize("fmt,gs,decode_act,prefill_act", ACT_CASES)
# 37 rows: a part-filled bf16 panel
@pytest.mark.parametrize("O,K", [(96, 256), (37, 96), (40, 72)])
def test_rounded_activation_matmul_matches_its_twin(rng, fmt, gs, decode_act, prefill_act, O, K):
    """simd.py's int8 (decode) and bf16 (prefill) dot products against the twin that
    rounds x (and for bf16, W) the same way, then multiplies in fp32: equal to fp32 rounding."""
    if decode_act != "fp32" and not cpu.INT8:
        pytest.skip(NO_INT8_DOT)
    if prefill_act == "bf16" and not cpu.BF16:
        pytest.skip(NO_BF16)
    if fmt == "bf16" and K % 2:
        pytest.skip("bf16 pairs need an even in_features")
    W = fast_quantize(
        randn(rng, O, K), fmt, gs or 64, decode_act=decode_act, prefill_act=prefill_act
    )
    rounded = []
    for T in (1, 3, quant.PREFILL_MIN_T, 21):             # 21 tokens: a part-filled block of 8
        x = randn(rng, T, K, scale=3.0)
        close(W.matmul(x), W.matmul_ref(x))
        as_fp32 = x @ W.dequantize().T
        rounded.append(
            not np.allclose(W.matmul(x), as_fp32, rtol=0, atol=1e-5 * np.abs(as_fp32).max())
        )
    # the rounding shows exactly on the paths that round: decode (T=1, 3), prefill (T=8, 21)
    assert rounded == [decode_act != "fp32"] * 2 + [prefill_act != "fp32"] * 2


def test_rounded_activations_refused_where_they_cannot_run(rng):
    with pytest.raises(ValueError, match="not available"):
        fast_quantize(randn(rng, 4, 64), "none", decode_act="int8")
    with pytest.raises(ValueError, match="not available"):
        # odd in_features: no bf16 pairs
        fast_quantize(randn(rng, 4, 63), "bf16", prefill_act="bf16")
    with pytest.raises(ValueError, match="fp32, int8 or int16"):
        fast_quantize(randn(rng, 4, 64), "int8", decode_act="int4")
    with pytest.raises(ValueError, match="not available"):
        fast_quantize(randn(rng, 4, 64), "int4", decode_act="int16")
    # int8 / int4 prefill: integers
    with pytest.raises(ValueError, match="not available"):
        fast_quantize(randn(rng, 4, 64), "int8", prefill_act="bf16")


def test_int8_activations_keep_nan_and_inf(rng):
    if not cpu.INT8:
        pytest.skip(NO_INT8_DOT)
    W = fast_quantize(randn(rng, 8, 64), "int8", 32, decode_act="int8")
    x = randn(rng, 1, 64)
    x[0, 3] = np.nan
    x[0, 40] = np.inf
    assert np.isnan(W.matmul(x)).all() and np.isnan(W.matmul_ref(x)).all()


@pytest.mark.parametrize("fmt,gs", [("none", 0)] + FORMAT_CASES)
def test_rows_equal_dequantized_rows(rng, fmt, gs):
    W = quantize(randn(rng, 50, 72), fmt, gs or 64)
    ids = np.array([0, 49, 7, 7])
    got = W.rows(ids)
    np.testing.assert_array_equal(got, W.dequantize()[ids])
    assert got.shape == (4, 72) and np.abs(got).max() > 0


def test_fp32_matmul_decode_kernel_and_prefill_blas_match_numpy(rng):
    w = randn(rng, 64, 48)
    x = randn(rng, 3, 48)                                  # decode sizes: the numba kernel
    close(quantize(w, "none").matmul(x), x @ w.T)
    x = randn(rng, quant.PREFILL_MIN_T, 48)                # prefill: BLAS itself, bit for bit
    np.testing.assert_array_equal(quantize(w, "none").matmul(x), x @ w.T)


def test_lm_head_shape_rows_and_matvec(rng):
    # a wide matrix like the tied embedding / lm_head, to exercise long prange ranges
    W = quantize(randn(rng, 4099, 64), "int4", 32)
    x = randn(rng, 1, 64)
    close(W.matmul(x), W.matmul_ref(x))


def test_threads_do_not_change_results(rng):
    W = quantize(randn(rng, 130, 256), "int8", 64)
    x = randn(rng, 2, 256)
    set_threads(1)
    one = W.matmul(x)
    set_threads(None)
    np.testing.assert_allclose(W.matmul(x), one, rtol=0, atol=0)


# ---------------------------------------------------------------- quantization error

# Measured on this seed (256 x 1024 standard normal): bf16 0.17 %, int8 0.54 / 0.59 / 0.65 %,
# int4 7.8 / 9.0 / 10.0 % at group sizes 32 / 64 / 128. The bounds leave a margin.
ERROR_BOUND = {"bf16": 0.003, "int8": 0.01, "int4": 0.11}


@pytest.mark.parametrize("fmt,gs", FORMAT_CASES)
def test_quantization_error_is_bounded(rng, fmt, gs):
    w = randn(rng, 256, 1024)
    W = quantize(w, fmt, gs)
    err = np.linalg.norm(W.dequantize() - w) / np.linalg.norm(w)
    assert 0 < err < ERROR_BOUND[fmt], f"{fmt} gs{gs}: relative error {err:.4f}"
    # and the product, which is what the model sees
    x = randn(rng, 4, 1024)
    y = x @ w.T
    out_err = np.linalg.norm(W.matmul(x) - y) / np.linalg.norm(y)
    assert out_err < ERROR_BOUND[fmt]


def test_int4_reproduces_a_4bit_grid_exactly(rng):
    # weights that already lie on a Q4_1 grid (fp16 scale and minimum per group of 32,
    # like the demo model's GGUF) come back bit for bit
    O, K, gs = 8, 128, 32
    G = K // gs
    s = np.float16(2.0) ** -rng.integers(4, 8, (O, G, 1))
    m = (-8 * s).astype(np.float16) + np.float16(0.001)
    q = rng.integers(0, 16, (O, G, gs))
    q[:, :, 0], q[:, :, 1] = 0, 15            # each group spans the full range
    w = (q * s.astype(np.float32) + m.astype(np.float32)).reshape(O, K).astype(np.float32)
    np.testing.assert_array_equal(quantize(w, "int4", gs).dequantize(), w)


def test_int8_reproduces_an_8bit_grid_exactly(rng):
    O, K, gs = 8, 128, 64
    s = np.float16(2.0) ** -rng.integers(4, 8, (O, K // gs, 1))
    q = rng.integers(-127, 128, (O, K // gs, gs))
    q[:, :, 0] = 127
    w = (q * s.astype(np.float32)).reshape(O, K).astype(np.float32)
    np.testing.assert_array_equal(quantize(w, "int8", gs).dequantize(), w)


def test_constant_and_zero_groups(rng):
    w = np.zeros((4, 64), np.float32)
    w[1] = 0.25                                 # a constant row: scale 0, all in the minimum
    w[2, :32] = rng.standard_normal(32)
    for fmt in ("int8", "int4"):
        W = quantize(w, fmt, 32)
        assert np.all(np.isfinite(W.dequantize()))
        np.testing.assert_array_equal(W.dequantize()[0], 0)
        x = randn(rng, 1, 64)
        close(W.matmul(x), W.matmul_ref(x))
    np.testing.assert_allclose(quantize(w, "int4", 32).dequantize()[1], 0.25, rtol=1e-3)


def test_bf16_rounding_equals_torch(rng):
    torch = pytest.importorskip("torch")
    u = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    # plus the hard cases: exact ties (low half 0x8000) with even and odd kept bit,
    # values that round up to inf, signed zeros, subnormals, infinities
    special = np.array([0x3F808000, 0x3F818000, 0x3F80_7FFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x0,
                        0x80000000, 0x00000001, 0x00008000, 0x00018000, 0x7F800000, 0xFF800000],
                       dtype=np.uint32)
    w = np.concatenate([u, special]).view(np.float32)
    finite_or_inf = ~np.isnan(w)
    ours = quant.f32_to_bf16_bits(w)
    theirs = torch.from_numpy(w.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(ours[finite_or_inf], theirs[finite_or_inf])
    # NaN stays NaN (torch canonicalises the payload; we keep it)
    assert np.isnan(quant.bf16_bits_to_f32(ours[~finite_or_inf])).all()
    # and the kernel's conversion (shift left 16) is the exact inverse on these bits
    W = Weight("bf16", 1, 64, 0, ours[finite_or_inf][:64].reshape(1, 64).copy())
    np.testing.assert_array_equal(W.rows(np.array([0]))[0], quant.bf16_bits_to_f32(W.data[0]))


# ---------------------------------------------------------------- errors a user can cause


def test_clear_errors():
    w = np.ones((4, 64), np.float32)
    with pytest.raises(ValueError, match="choose one of"):
        quantize(w, "int3")
    with pytest.raises(ValueError, match="group-size"):
        quantize(w, "int8", 48)
    with pytest.raises(ValueError, match=r"x \[T, 64\]"):
        quantize(w, "int8").matmul(np.ones((1, 63), np.float32))
    with pytest.raises(ValueError, match="fp16"):
        quantize(w * 1e9, "int8")
