"""The fast path's int8 dot-product instructions, checked on the CPU that runs the tests.

- cpu.py's choice: from numba's target features alone, and never an instruction the
  target lacks (x86: VNNI, AVX2; ARM64: sdot with dotprod; else none);
- the compiled kernels contain the chosen instruction (numba's inspect_asm): a kernel
  that silently fell back to scalar or float code fails here, and the core's float
  kernel, which never names it, shows the check can tell;
- the kernels equal the integer definition bit for bit: weights and activations that
  sit exactly on their int8 / int4 grids (scales 1, activation scales 1) make every
  output an integer below 2^24, which fp32 holds exactly whatever the order of the sums.
  A lane dropped, a wrong sign or a saturated pair sum changes the bits.

Under qemu (tests/arm64/run.sh) the ARM64 path runs with and without dotprod.
"""
from __future__ import annotations

import numba
import numpy as np
import pytest

from stage1_cpu import matmul, quant
from stage1_cpu.fast import cpu
from stage1_cpu.fast import kernels as fk
from stage1_cpu.fast.weight import as_fast

NEEDS_INT8 = pytest.mark.skipif(
    not cpu.INT8, reason="no int8 dot product on this target (VNNI, AVX2 or dotprod)"
)
# the instruction each choice multiplies bytes with, as the disassembly names it
MNEMONIC = {"vnni": "vpdpbusd", "avx2": "vpmaddubsw", "sdot": "sdot"}


@pytest.fixture
def rng():
    return np.random.default_rng(50)


def test_choice_follows_the_target_features(monkeypatch):
    monkeypatch.delenv("QS_FAST_ISA", raising=False)
    monkeypatch.setattr(cpu, "ARM64", True)
    assert cpu._choose_int8({"neon", "dotprod", "i8mm"}) == "sdot"
    # a Cortex-A53 / A72: the float kernels
    assert cpu._choose_int8({"neon", "fp-armv8"}) is None
    monkeypatch.setenv("QS_FAST_ISA", "none")
    assert cpu._choose_int8({"neon", "dotprod"}) is None           # lowered, never raised
    monkeypatch.delenv("QS_FAST_ISA")
    monkeypatch.setattr(cpu, "ARM64", False)
    # an ARM feature name means nothing on x86
    assert cpu._choose_int8({"dotprod"}) is None
    assert cpu._choose_int8({"avx2"}) == "avx2"
    assert cpu._choose_int8({"avx2", "avx512vnni", "avx512vl"}) == "vnni"


def test_this_target_gets_what_its_features_allow():
    expected = cpu._choose_int8(cpu.FEATURES) if (cpu.X86 or cpu.ARM64) else None
    assert cpu.INT8 == expected
    # ARM64 prefill stays on sgemm under auto
    assert cpu.INT16_GEMM == (cpu.INT8 in ("vnni", "avx2"))
    if cpu.INT8 == "sdot":
        assert "dotprod" in cpu.FEATURES and "sdot" in cpu.instructions()
    if cpu.INT8 is None:
        assert "no int8 dot instruction" in cpu.instructions()


def _on_grid(rng, fmt, O, K, gs):
    """A Weight whose stored values are W itself: int8 q in -127..127 with a 127 in every group
    (scale 1), int4 nibbles 0..15 with a 0 and a 15 in every group (scale 1, minimum 0)."""
    G = -(-K // gs)
    if fmt == "int8":
        w = rng.integers(-127, 128, (O, G * gs))
        w[:, ::gs] = 127
    else:
        w = rng.integers(0, 16, (O, G * gs))
        w[:, ::gs], w[:, 1::gs] = 15, 0
    w = w[:, :K].astype(np.float32)
    W = quant.quantize(w, fmt, gs)
    # the grid is exact: scales 1, minima 0
    np.testing.assert_array_equal(W.dequantize(), w)
    return W, w


def _activations(rng, T, K, gs, qmax):
    """Integers in -qmax..qmax with a qmax in every group: the rounding keeps them as they are
    (scale 1). int16: the other values stay within 127, so that a row's products sum below 2^24."""
    x = rng.integers(-min(qmax, 127), min(qmax, 127) + 1, (T, K))
    x[:, ::gs] = qmax
    return x.astype(np.float32)


def _exact(x, w):
    """x @ w.T in int64, as float32 (exact: every sum of |products| stays below 2^24)."""
    xi, wi = x.astype(np.int64), w.astype(np.int64)
    assert (np.abs(xi) @ np.abs(wi).T).max() < 2 ** 24
    return (xi @ wi.T).astype(np.float32)


@NEEDS_INT8
@pytest.mark.parametrize("fmt,act", [("int8", "int8"), ("int4", "int8"), ("int8", "int16")])
@pytest.mark.parametrize("gs", [32, 128])
# row tails (4-row calls), group tails, 8-group blocks
@pytest.mark.parametrize("O,K", [(37, 200), (64, 1000)])
def test_decode_kernels_equal_the_integer_definition_bit_for_bit(rng, fmt, act, gs, O, K):
    # int16: two groups stay below 2^24
    K = K if act == "int8" else 2 * gs - 5
    W, w = _on_grid(rng, fmt, O, K, gs)
    x = _activations(rng, 3, K, gs, 127 if act == "int8" else 32767)
    # T = 3 < PREFILL_MIN_T: the decode kernels
    got = as_fast(W, decode_act=act).matmul(x)
    np.testing.assert_array_equal(got, _exact(x, w))


@NEEDS_INT8
@pytest.mark.parametrize(
    "fmt,act", [("int8", "int8"), ("int4", "int8"), ("int8", "int16"), ("int4", "int16")]
)
@pytest.mark.parametrize("gs", [32, 128])
def test_prefill_gemm_equals_the_integer_definition_bit_for_bit(rng, fmt, act, gs):
    K = 400 if act == "int8" else 2 * gs - 5
    W, w = _on_grid(rng, fmt, 70, K, gs)                           # 70 rows: a partial 8-row vector
    x = _activations(rng, quant.PREFILL_MIN_T + 11, K, gs, 127 if act == "int8" else 32767)
    # the integer GEMM reads the tiles
    decode = "int16" if fmt == "int8" else "int8"
    got = as_fast(W, decode_act=decode, prefill_act=act).matmul(x)  # T >= PREFILL_MIN_T: gemm.py
    np.testing.assert_array_equal(got, _exact(x, w))


def _asm(kernel, sig=None) -> str:
    """The machine code of kernel, for a signature it was called with (the first by default),
    compiled afresh from its source (a function loaded from numba's disk cache keeps no assembly),
    serially: prange's body holds the same instructions, and a parallel compile takes minutes
    under emulation."""
    options = {k: v for k, v in kernel.targetoptions.items() if k not in ("nopython", "parallel")}
    sig = sig or kernel.signatures[0]
    fresh = numba.njit(**options)(kernel.py_func)
    fresh.compile(sig)
    return fresh.inspect_asm(sig)


@NEEDS_INT8
def test_compiled_kernels_contain_the_chosen_instruction(rng):
    mnemonic = MNEMONIC[cpu.INT8]
    # compile each kernel by running it
    for fmt in ("int8", "int4"):
        W, _ = _on_grid(rng, fmt, 16, 64, 32)
        x = _activations(rng, quant.PREFILL_MIN_T, 64, 32, 127)
        as_fast(W, decode_act="int8", prefill_act="int8").matmul(x[:1])
        as_fast(W, decode_act="int8", prefill_act="int8").matmul(x)
    from stage1_cpu.fast import gemm
    for name, kernel in {"matmul_tiled": fk.matmul_tiled, "gemm_tiled": gemm.gemm_tiled}.items():
        # one signature per kind (k8_8, k8_16, k4_8, k4_16 last): those of int8 activations
        q8 = [sig for sig in kernel.signatures if str(sig[-3]) == str(sig[-1]) == "none"]
        assert len(q8) == 2, (
            f"{name} was not compiled for int8 and int4 weights on int8 activations"
        )
        for sig in q8:
            assert mnemonic in _asm(kernel, sig), f"{name}{sig}: no {mnemonic} in its machine code"
    # the check can tell: the core's int8 kernel (int8 weights to float, float multiply-adds) has
    # none
    W, _ = _on_grid(rng, "int8", 16, 64, 32)
    W.matmul(x[:1])
    assert matmul.matmul_int8.signatures and mnemonic not in _asm(matmul.matmul_int8)


def test_threading_layer_is_named_before_any_parallel_kernel():
    from stage1_cpu.jit.numba_cache import threads
    assert threads().startswith(f"{numba.threading_layer()} threads ")
    assert numba.threading_layer() in ("omp", "tbb", "workqueue")
