"""Stage 3's CUDA sources run on the CPU under the g++ emulator, each against its numpy twin.

The emulator is bench/testbed/cuda_emulator.py (one OS thread per CUDA thread, blocks in a seeded
shuffled order, poisoned shared memory, checked barriers and shuffle masks), used as it is.
The tensor-core kernel, which it cannot run by itself, gets a fragment shim here: a copy
of prefill_attention_tc.cu with the CPU versions of its five PTX wmma helpers in front
(FRAGMENT_SHIM below). The kernels are launched through
stage3_optimized/kernels.py itself, with the emulator's stand-in for CuPy plus a stand-in
for cuBLAS's gemmEx that reads its arguments the way cuBLAS does (column-major, leading
dimensions, op T / op N), so the wrappers' argument order, dtypes, launch grids and the
GEMM's transposition are checked too; finally the whole stage-3 engine runs with
device="cuda" on the emulated kernels.

Tolerances. Kernel and twin compute in fp32 and round once to bf16, but not in the
same order (a warp's shuffle tree vs numpy's pairwise sums, x * rsqrt vs x / sqrt), so
an output may land on the neighbouring bf16 value: outputs must agree within 2 bf16
steps (relative 2^-7, plus 1e-3 of the output's scale for values that cancel towards
zero), and most of them (>= 90 %) must be bit-identical, which a kernel that merely
computes something similar would not reach. Copies (embedding, the V rows, the fp32
residual) must be exact.
"""
from __future__ import annotations

import functools
import gc
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.testbed import cuda_emulator as emu
from stage3_optimized import kernels, ops
from stage3_optimized.ops import bf16_bits, f32
from test_stage2_kernels import paged

CUDA_DIR = Path(kernels.__file__).parent / "cuda"

# The tensor-core fragment shim: the CPU versions of the five functions that
# prefill_attention_tc.cu defines with PTX wmma under __CUDA_ARCH__. A real fragment spreads
# a 16x16 tile over the 32 lanes of a warp in an unspecified layout, and the calls are
# warp-collective; here every lane keeps the whole tile and does the whole product (the same
# result, 32 times the work), and only lane 0 stores, so the kernel must __syncwarp() before
# it reads a stored tile, exactly as on a GPU. Products of bf16 values are exact in fp32 and
# are summed in fp32, as the tensor cores do (in an unspecified order).
FRAGMENT_SHIM = r"""
#include <cstring>
struct FragA { float v[16][16]; };
struct FragB { float v[16][16]; };
struct FragC { float v[16][16]; };
inline float qs_bf16(unsigned short b)
{
    unsigned u = (unsigned)b << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline void fill_zero(FragC& c)
{
    for (int r = 0; r < 16; r++) for (int k = 0; k < 16; k++) c.v[r][k] = 0.0f;
}
inline void load_a_row(FragA& a, const unsigned short* p, unsigned ld)
{
    for (int r = 0; r < 16; r++) for (int k = 0; k < 16; k++) a.v[r][k] = qs_bf16(p[r * ld + k]);
}
template <bool COL>
inline void load_b(FragB& b, const unsigned short* p, unsigned ld)
{
    for (int k = 0; k < 16; k++)
        for (int c = 0; c < 16; c++) b.v[k][c] = qs_bf16(COL ? p[c * ld + k] : p[k * ld + c]);
}
template <bool COL>
inline void mma(FragC& c, const FragA& a, const FragB& b)
{
    for (int r = 0; r < 16; r++)
        for (int j = 0; j < 16; j++) {
            float sum = c.v[r][j];
            for (int k = 0; k < 16; k++) sum += a.v[r][k] * b.v[k][j];
            c.v[r][j] = sum;
        }
}
inline void store_c_row(float* p, const FragC& c, unsigned ld)
{
    if (threadIdx.x % 32 != 0) return;                 // one lane writes the warp's tile
    for (int r = 0; r < 16; r++) for (int j = 0; j < 16; j++) p[r * ld + j] = c.v[r][j];
}
"""


def shimmed_copy(cu: Path, folder: Path) -> Path:
    """A copy of a tensor-core .cu file with FRAGMENT_SHIM in front (g++ skips the PTX versions)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / cu.name
    out.write_text(FRAGMENT_SHIM + cu.read_text())
    return out


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """kernel name -> EmulatedKernel: every stage-3 .cu compiled under the emulator (the
    tensor-core one through its shimmed copy)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    build = tmp_path_factory.mktemp("cuda3-emulated")
    sources = []
    for cu in sorted({CUDA_DIR / f for f in kernels.KERNEL_FILES.values()}):
        sources.append(
            cu if emu.unsupported(cu.read_text()) is None else shimmed_copy(cu, build / "shimmed")
        )
    return emu.build(sources, build / "build")


@pytest.fixture
def gpu(emulated, monkeypatch):
    """kernels.py on the emulator's stand-in CuPy (and cuBLAS through ctypes) with the emulated
    kernels: -> dev(numpy) -> device array. gemv.cu's grid is capped at 4 blocks here (each
    warp strides over more rows): the emulator starts 256 OS threads per block."""
    monkeypatch.setattr(kernels, "GEMV_MAX_BLOCKS", 4)
    return emu.install(monkeypatch, kernels, emulated).dev


def assert_bf16_close(got, expect, min_exact=0.9):
    """Two bf16 bit arrays: within 2 bf16 steps (see the module docstring), mostly bit-identical."""
    got, expect = np.asarray(got).view(np.ndarray), np.asarray(expect).view(np.ndarray)
    assert got.dtype == expect.dtype == np.uint16 and got.shape == expect.shape
    g, e = f32(got), f32(expect)
    scale = float(np.abs(e).max())
    assert scale > 0, "an all-zero reference proves nothing"
    np.testing.assert_allclose(g, e, rtol=2 ** -7, atol=1e-3 * scale)
    exact = float(np.mean(got == expect))
    assert exact >= min_exact, f"only {exact:.1%} of the values are bit-identical"


def bf16_random(rng, shape, scale=1.0):
    return bf16_bits(rng.standard_normal(shape).astype(np.float32) * scale)


def test_every_kernel_is_emulated(emulated):
    assert set(emulated) == set(kernels.KERNEL_FILES)


def test_embedding_starts_the_fp32_residual_stream(gpu):
    rng = np.random.default_rng(0)
    # even: word reads; odd: one value per thread
    for C in (96, 33):
        table = bf16_random(rng, (50, C))
        ids = rng.integers(0, 50, size=7).astype(np.int32)
        got = kernels.embedding(gpu(ids), gpu(table)).get()
        assert got.dtype == np.float32 and np.abs(got).max() > 0
        np.testing.assert_array_equal(got, ops.embedding(ids, table))


@pytest.mark.parametrize("N,C", [(1, 96), (3, 300), (5, 1024)])
def test_rmsnorm_equals_twin(gpu, N, C):
    rng = np.random.default_rng(C)
    residual = rng.standard_normal((N, C)).astype(np.float32) * 5
    w = bf16_random(rng, (C,))
    dev_res = gpu(residual)
    h = kernels.rmsnorm(dev_res, gpu(w), 1e-6)
    assert_bf16_close(h.get(), ops.rmsnorm_bf16(residual, w, 1e-6))
    np.testing.assert_array_equal(dev_res.get(), residual)    # the stream is read, not written


@pytest.mark.parametrize("H,Hkv,D,norm", [(4, 2, 32, True), (2, 1, 48, True), (16, 8, 128, True),
                                          (4, 4, 64, False), (3, 1, 256, True)])
def test_qk_norm_rope_store_equals_twin(gpu, H, Hkv, D, norm):
    rng = np.random.default_rng(H * D)
    N, NB, P = 6, 5, 4
    qkv = bf16_random(rng, (N, (H + 2 * Hkv) * D), 2.0)
    qn, kn = (bf16_random(rng, (D,)), bf16_random(rng, (D,))) if norm else (None, None)
    pos = rng.integers(0, 900, size=N)
    cos, sin = ops.rope_tables(1000, D, 1e6)
    slots = rng.permutation(NB * P)[:N].astype(np.int32)
    slots[2] = -1                                              # a padding token: no store
    pool = lambda: np.zeros((2, NB, P, Hkv, D), np.uint16)     # noqa: E731  [L, NB, P, Hkv, D]
    dk, dv = gpu(pool()), gpu(pool())
    ek, ev = pool(), pool()
    pos = pos.astype(np.int32)
    norms = (None, None) if qn is None else (gpu(qn), gpu(kn))
    on_dev = ops.LayerHeads(*norms, gpu(cos), gpu(sin), dk[1], dv[1], H, Hkv, 1e-6)
    q = kernels.qk_norm_rope_store(gpu(qkv), on_dev, gpu(pos), gpu(slots))
    on_host = ops.LayerHeads(qn, kn, cos, sin, ek[1], ev[1], H, Hkv, 1e-6)
    eq = ops.qk_norm_rope_store(qkv, on_host, pos, slots)
    assert_bf16_close(q.get(), eq)
    # most slots stay 0
    assert_bf16_close(dk.get()[1].reshape(-1), ek[1].reshape(-1), min_exact=0.5)
    np.testing.assert_array_equal(dv.get(), ev)                # V rows are copied bit for bit
    # the other layer untouched; V was stored
    assert not dk.get()[0].any() and ev[1].any()


def test_swiglu_equals_twin(gpu):
    rng = np.random.default_rng(1)
    for N, F in [(1, 48), (7, 300)]:
        gu = bf16_random(rng, (N, 2 * F), 2.0)
        assert_bf16_close(kernels.swiglu(gpu(gu)).get(), ops.swiglu(gu))


def test_linear_reads_the_weight_transposed_like_cublas(gpu):
    """Five rows: the cuBLAS path (gemv.cu takes at most four), through ctypes (cublas.py)."""
    rng = np.random.default_rng(2)
    x, w = bf16_random(rng, (5, 96)), bf16_random(rng, (40, 96))
    assert_bf16_close(kernels.linear(gpu(x), gpu(w)).get(), ops.linear(x, w), min_exact=1.0)
    np.testing.assert_allclose(
        kernels.linear(gpu(x), gpu(w), out_f32=True).get(), ops.linear(x, w, True), rtol=1e-5
    )


def _count_launches(fn):
    """fn() -> (its result, the kernel launches and cuBLAS calls it made)."""
    before = emu.STATE.calls.as_dict()
    out = fn()
    after = emu.STATE.calls.as_dict()
    return out, after["launches"] - before["launches"], after["blas"] - before["blas"]


# gemv.cu's shapes: one to four rows (a decode batch), K a multiple of 8 but not of the
# 32 * 8 * UNROLL a warp reads per pass, M not a multiple of the 8 rows of a block, and
# more rows than the grid's blocks x 8 warps (the grid capped at 2 blocks: each warp strides)
GEMV_CASES = [(1, 96, 40, 8), (2, 1024, 13, 8), (3, 264, 1, 8), (4, 3072, 24, 8), (1, 64, 37, 2)]


def check_gemv(dev, N, K, M, counted=None, kernels=kernels, ops=ops):
    """A decode batch's projections against their twins: plain (bf16 and fp32 out), with the
    RMSNorm in front (+ a bias), and with the residual add behind (after a plain input and
    after SwiGLU). counted(run) -> the run's result, after checking it launched one kernel.
    kernels, ops: a lesson rung's modules (tests/test_stage3_lessons.py), stage 3's by default."""
    rng = np.random.default_rng(N * K + M)
    x, w = bf16_random(rng, (N, K)), bf16_random(rng, (M, K), 0.5)
    residual = rng.standard_normal((N, K)).astype(np.float32) * 4
    norm_w, bias = bf16_random(rng, (K,)), rng.standard_normal(M).astype(np.float32)
    gate_up = bf16_random(rng, (N, 2 * K), 2.0)
    stream = rng.standard_normal((N, M)).astype(np.float32)
    close = lambda got, expect: np.testing.assert_allclose(got, expect, rtol=1e-4,   # noqa: E731
                                                           atol=1e-4 * np.abs(expect).max())
    cases = [
        (lambda: kernels.linear(dev(x), dev(w)).get(), ops.linear(x, w), "bf16"),
        (lambda: kernels.linear(dev(x), dev(w), out_f32=True).get(), ops.linear(x, w, True), "f32"),
        (lambda: kernels.rmsnorm_linear(dev(residual), dev(norm_w), 1e-6, dev(w)).get(),
         ops.rmsnorm_linear(residual, norm_w, 1e-6, w), "bf16"),
        (lambda: kernels.rmsnorm_linear(dev(residual), dev(norm_w), 1e-6, dev(w),
                                        bias=dev(bias)).get(),
         ops.rmsnorm_linear(residual, norm_w, 1e-6, w, bias), "bf16"),
        (lambda: kernels.linear(dev(x), dev(w), add_into=dev(stream)).get(),
         stream + ops.linear(x, w, True), "f32"),
        (lambda: kernels.swiglu_linear(dev(gate_up), dev(w), dev(stream)).get(),
         stream + ops.linear(ops.swiglu(gate_up), w, True), "f32"),
    ]
    for run, expect, kind in cases:
        got = counted(run) if counted else run()
        if kind == "bf16":
            assert_bf16_close(got, expect, min_exact=0.8)
        else:
            close(got, expect)


def check_gemv_prologues(dev, kernels=kernels):
    """The fused RMSNorm (prologue 1) gives bit for bit what rmsnorm.cu then a plain gemv.cu
    give, and the fused SwiGLU what swiglu.cu then gemv.cu give: the same bits go into the same
    sums. A prologue that rounds or sums in another order fails this, not just the tolerance."""
    rng = np.random.default_rng(7)
    N, K, M = 3, 1024, 20
    w = dev(bf16_random(rng, (M, K)))
    residual, norm_w = (
        dev(rng.standard_normal((N, K)).astype(np.float32) * 3),
        dev(bf16_random(rng, (K,))),
    )
    fused = kernels.rmsnorm_linear(residual, norm_w, 1e-6, w).get()
    plain = kernels.linear(kernels.rmsnorm(residual, norm_w, 1e-6), w).get()
    np.testing.assert_array_equal(fused, plain)
    gate_up = dev(bf16_random(rng, (N, 2 * K), 3.0))
    stream = rng.standard_normal((N, M)).astype(np.float32)
    fused = kernels.swiglu_linear(gate_up, w, dev(stream)).get()
    plain = kernels.linear(kernels.swiglu(gate_up), w, add_into=dev(stream)).get()
    np.testing.assert_array_equal(fused, plain)


@pytest.mark.parametrize("N,K,M,blocks", GEMV_CASES)
def test_gemv_projections_equal_twins_in_one_launch(gpu, monkeypatch, N, K, M, blocks):
    """Each projection of a decode batch: one gemv.cu launch, no cuBLAS call, the twin's values."""
    monkeypatch.setattr(kernels, "GEMV_MAX_BLOCKS", blocks)

    def counted(run):
        got, launches, blas = _count_launches(run)
        assert (launches, blas) == (1, 0)
        return got
    check_gemv(gpu, N, K, M, counted)


def test_gemv_at_the_8b_mlp_input_raises_its_shared_memory_attribute(gpu):
    """Two rows of K = 12,288 (Qwen3-8B's down projection, two sequences): 48 KB of input rows
    plus gemv.cu's 32 static bytes, over the 48 KB a block gets unless the kernel's attribute
    is raised. kernels.py raises it when it loads the kernel (RAISED_SMEM)."""
    check_gemv(gpu, 2, 12288, 16)


def test_gemv_over_the_default_shared_memory_is_refused_as_cuda_does(gpu, monkeypatch, tmp_path):
    """Without the raised attribute the same launch is CUDA's invalid-argument error: the
    emulator sums the static part (from the kernel's __shared__ variables, as ptxas does) with
    the dynamic part, against 48 KB. A fresh build: the attribute lives with the kernel."""
    monkeypatch.setattr(kernels, "RAISED_SMEM", {})
    fresh = emu.build([CUDA_DIR / "gemv.cu"], tmp_path / "build")
    assert fresh["gemv"].static_smem == 32
    assert fresh["gemv"].max_dynamic_shared_size_bytes == 48 * 1024 - 32
    dev = emu.install(monkeypatch, kernels, fresh).dev
    x, w = np.zeros((2, 12288), np.uint16), np.zeros((16, 12288), np.uint16)
    refused = (r"49152 bytes of dynamic shared memory, over the kernel's "
               r"max_dynamic_shared_size_bytes \(49120\), the 49152 bytes a block gets by default "
               r"less its 32 static bytes")
    with pytest.raises(emu.EmulatorError, match=refused):
        kernels.linear(dev(x), dev(w))
    kernels.linear(dev(x[:, :12264]), dev(w[:, :12264]))          # 49,056 bytes: within


VECTOR_COPY = r"""
extern "C" __global__ void copy16(const unsigned short* x, unsigned short* out, int n8)
{
    extern __shared__ ALIGN unsigned short xs[];           // read and written as uint4
    for (int i = threadIdx.x; i < n8; i += blockDim.x) ((uint4*)xs)[i] = ((const uint4*)x)[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n8; i += blockDim.x) ((uint4*)out)[i] = ((const uint4*)xs)[i];
}
"""


@pytest.mark.skipif(not emu.RACE, reason="QS_EMU_RACE=0: the alignment check needs the race hooks")
@pytest.mark.parametrize("align", ["", "__align__(16)"])
def test_a_uint4_access_to_shared_memory_needs_the_arrays_declared_alignment(gpu, tmp_path, align):
    """Dynamic shared memory is only as aligned as its declaration says (it starts after the
    static variables). A uint4 through `extern __shared__ unsigned short xs[]` is the GPU's
    misaligned-address error, which the emulator reports; with __align__(16) it copies."""
    src = tmp_path / "copy16.cu"
    src.write_text(VECTOR_COPY.replace("ALIGN", align))
    kernel = emu.build([src], tmp_path / "build")["copy16"]
    x = np.arange(64, dtype=np.uint16)
    out = gpu(np.zeros(64, np.uint16))
    args = (gpu(x), out, np.int32(8))
    if not align:
        misaligned = "16-byte access at an address 2 bytes past a multiple of 16"
        with pytest.raises(emu.EmulatorError, match=misaligned):
            kernel((1,), (32,), args, shared_mem=128)
        return
    kernel((1,), (32,), args, shared_mem=128)
    np.testing.assert_array_equal(out.get(), x)


def test_gemv_prologues_feed_the_sums_the_bits_of_the_unfused_kernels(gpu):
    check_gemv_prologues(gpu)


def test_big_batches_take_the_unfused_path_with_the_same_arithmetic(gpu):
    """Five rows: rmsnorm.cu + cuBLAS, swiglu.cu + cuBLAS with beta = 1: the twins' values."""
    rng = np.random.default_rng(8)
    N, K, M = 5, 64, 24
    w, norm_w = bf16_random(rng, (M, K)), bf16_random(rng, (K,))
    residual = rng.standard_normal((N, K)).astype(np.float32)
    got, launches, blas = _count_launches(
        lambda: kernels.rmsnorm_linear(gpu(residual), gpu(norm_w), 1e-6, gpu(w)).get()
    )
    assert (launches, blas) == (1, 1)
    assert_bf16_close(got, ops.rmsnorm_linear(residual, norm_w, 1e-6, w), min_exact=0.8)
    gate_up, stream = bf16_random(rng, (N, 2 * K)), rng.standard_normal((N, M)).astype(np.float32)
    got, launches, blas = _count_launches(
        lambda: kernels.swiglu_linear(gpu(gate_up), gpu(w), gpu(stream)).get())
    assert (launches, blas) == (1, 1)
    expect = stream + ops.linear(ops.swiglu(gate_up), w, True)
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4)


# float32 bit patterns for the rounding to bf16: the NaN a GPU makes (0x7FFFFFFF), x86's NaNs
# (+ and -), NaNs with other payloads, the infinities, the largest float (rounds to infinity),
# ties to even (down and up), a denormal, -0, 1 and pi
BF16_CASES = np.array([0x7FFFFFFF, 0x7FC00000, 0xFFC00000, 0xFFFFFFFF, 0x7F800001, 0x7FBFFFFF,
                       0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x00000001,
                       0x80000000, 0x3F800000, 0x40490FDB], np.uint32)
BF16_PROBE = r"""
extern "C" __global__ void bf16_probe_{stem}(const unsigned* bits, unsigned short* out, int n)
{{
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(__int_as_float((int)bits[i]));
}}
"""


def test_every_f32_to_bf16_keeps_a_nan_a_nan_as_the_twins_do(gpu, tmp_path):
    """Each .cu file's own f32_to_bf16 (run in the emulator through a probe kernel appended to
    a copy of the file), kernels.to_bf16 and the cuBLAS stand-in's rounding give ops.bf16_bits'
    bits, and a NaN stays a NaN. Rounded as a number, the GPU's NaN 0x7FFFFFFF carries into the
    sign bit and becomes -0.0: a blow-up would turn into zeros, the logits into a flat row and
    the degenerate-row error (sample.cu's -1) into token 0. x86's NaN 0x7FC00000 survives that
    rounding, which is why the numpy twins never showed it."""
    floats = BF16_CASES.view(np.float32)
    with np.errstate(invalid="ignore"):
        expect = ops.bf16_bits(floats)
    nan = np.isnan(floats)
    assert np.isnan(f32(expect[nan])).all() and not np.isnan(f32(expect[~nan])).any()
    files = [cu for cu in sorted(CUDA_DIR.glob("*.cu")) if "f32_to_bf16(float" in cu.read_text()]
    assert len(files) >= 7
    for cu in files:
        shim = FRAGMENT_SHIM if emu.unsupported(cu.read_text()) else ""
        (tmp_path / cu.name).write_text(shim + cu.read_text() + BF16_PROBE.format(stem=cu.stem))
    probes = emu.build([tmp_path / cu.name for cu in files], tmp_path / "build")
    for cu in files:
        out = gpu(np.zeros(len(floats), np.uint16))
        probes[f"bf16_probe_{cu.stem}"]((1,), (32,), (gpu(BF16_CASES), out, np.int32(len(floats))))
        np.testing.assert_array_equal(out.get(), expect, err_msg=cu.name)
    np.testing.assert_array_equal(kernels.to_bf16(gpu(floats)).get(), expect)
    np.testing.assert_array_equal(emu._narrow(floats, np.uint16), expect)


@pytest.mark.parametrize("N", [2, 5])
def test_a_gpu_nan_in_the_residual_stream_reaches_the_sampler_as_a_degenerate_row(gpu, N):
    """Row 0 of the residual stream holds the GPU's NaN: the final norm and the lm_head (gemv.cu's
    fused norm for 2 rows, rmsnorm.cu and the GEMM for 5) give that row NaN logits, and the
    sampler -1 for it alone; the other rows keep their tokens."""
    rng = np.random.default_rng(11)
    C, V = 64, 40
    residual = rng.standard_normal((N, C)).astype(np.float32)
    residual[0] = np.uint32(0x7FFFFFFF).view(np.float32)
    norm_w, w = bf16_random(rng, (C,)), bf16_random(rng, (V, C))
    logits = kernels.rmsnorm_linear(gpu(residual), gpu(norm_w), 1e-6, gpu(w), out_f32=True)
    assert np.isnan(logits.get()[0]).all() and np.isfinite(logits.get()[1:]).all()
    params = (np.zeros(N, np.float32), np.zeros(N, np.int32), np.ones(N, np.float32),
              np.full(N, 0.5, np.float32))                        # greedy
    tokens = kernels.sample(logits, *map(gpu, params)).get()
    assert tokens[0] == -1
    np.testing.assert_array_equal(tokens[1:], np.argmax(logits.get()[1:], axis=1))


# decode attention at awkward shapes: one position, lengths off the page, one KV head,
# Qwen3's GQA ratios (0.6B: 16/8, 8B: 32/8, 30B-A3B: 32/4); a split length below, between
# and above the tile, so a split may hold several tiles, part of one, or nothing
DECODE_CASES = [(H, Hkv, D, P, lens, split)
                for H, Hkv, D in [(1, 1, 32), (4, 1, 64), (16, 8, 128), (32, 8, 128), (32, 4, 64),
                                  (2, 1, 48)]
                for P, lens, split in [(16, [1], 512), (16, [1, 16, 17, 40], 8),
                                       (5, [3, 11, 70], 45), (256, [7, 260], 100), (5, [3, 50], 45)]
                # the emulator runs a thread per CUDA thread: the wide groups get the small cases
                if not (H >= 16 and max(lens) > 100) and not (H >= 32 and split not in (512, 45))
                and not (H >= 32 and max(lens) == 70) and not (H < 32 and lens == [3, 50])]


@pytest.mark.parametrize("H,Hkv,D,P,lens,split", DECODE_CASES)
def test_decode_attention_splits_and_merge_equal_twins(gpu, emulated, H, Hkv, D, P, lens, split):
    rng = np.random.default_rng(H + P + split)
    k32, v32, tables, *_ = paged(rng, lens, Hkv, D, P)
    k_cache, v_cache = bf16_bits(k32), bf16_bits(v32)
    q = bf16_random(rng, (len(lens), H, D))
    ctx = np.array(lens, np.int32)
    # the split kernel alone, against its twin (fp32 partials)
    splits = (max(lens) + split - 1) // split
    S = len(lens)
    part_out, part_ml = (
        gpu(np.zeros((S, H, splits, D), np.float32)),
        gpu(np.zeros((S, H, splits, 2), np.float32)),
    )
    emulated["paged_decode_attention"](
        (S * Hkv, splits), (32 * (H // Hkv),),
        (gpu(q), gpu(k_cache), gpu(v_cache), gpu(tables), gpu(ctx), part_out, part_ml,
         np.int32(H), np.int32(Hkv), np.int32(D), np.int32(P), np.int32(tables.shape[1]),
         np.int32(split), np.int32(splits), np.float32(1 / np.sqrt(D))),
        shared_mem=kernels.decode_shared_bytes(D))
    e_out, e_ml = ops.decode_attention_splits(q, k_cache, v_cache, tables, ctx, split, splits)
    # [S, splits] pieces with positions
    used = np.arange(splits)[None, :] < ((ctx + split - 1) // split)[:, None]
    got_ml = part_ml.get()
    got_ml_u = np.moveaxis(got_ml, 2, 1)[used]                 # [pieces, H, 2]
    np.testing.assert_allclose(got_ml_u, np.moveaxis(e_ml, 2, 1)[used], rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(np.moveaxis(part_out.get(), 2, 1)[used],
                               np.moveaxis(e_out, 2, 1)[used], rtol=2e-5, atol=1e-4)
    # the two kernels through kernels.py, against the one-softmax definition
    out = kernels.paged_decode_attention(
        gpu(q), gpu(k_cache), gpu(v_cache), gpu(tables), gpu(ctx), split_len=split
    )
    assert_bf16_close(out.get(), ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx))
    # and the merge twin over the split twin is the same definition
    assert_bf16_close(
        ops.merge_attention(e_out, e_ml),
        ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx),
    )


PREFILL_CASES = [(H, Hkv, D, P, chunks)
                 for H, Hkv, D in [(1, 1, 32), (4, 2, 64), (16, 8, 128), (2, 1, 48)]
                 for P, chunks in [(16, [(0, 1)]), (16, [(0, 17), (5, 3), (16, 6)]),
                                   (5, [(0, 7), (12, 1), (3, 9)])]
                 if not (H >= 16 and P == 5)]


@pytest.mark.parametrize("H,Hkv,D,P,chunks", PREFILL_CASES)
def test_prefill_attention_equals_twin(gpu, H, Hkv, D, P, chunks):
    rng = np.random.default_rng(H * 3 + P)
    lens = [b + n for b, n in chunks]
    k32, v32, tables, *_ = paged(rng, lens, Hkv, D, P)
    k_cache, v_cache = bf16_bits(k32), bf16_bits(v32)
    token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(chunks)]).astype(np.int32)
    positions = np.concatenate([np.arange(b, b + n) for b, n in chunks]).astype(np.int32)
    q = bf16_random(rng, (len(positions), H, D))
    out = kernels.prefill_attention(
        gpu(q), gpu(k_cache), gpu(v_cache), gpu(tables), gpu(token_seq), gpu(positions)
    )
    assert_bf16_close(
        out.get(), ops.prefill_attention(q, k_cache, v_cache, tables, token_seq, positions)
    )


# the tensor-core kernel at awkward shapes: one token, chunks that straddle the 16-token tile
# and the page, a cached prefix before the chunk, one KV head, GQA groups of 2, 4 and 8
# (8 takes two blocks of 4 heads), head dims 64 and 128
TC_CASES = [(H, Hkv, D, P, chunks)
            for H, Hkv, D in [(1, 1, 64), (4, 2, 64), (8, 2, 128), (8, 1, 64), (2, 1, 128)]
            for P, chunks in [(16, [(0, 1)]), (16, [(0, 17), (5, 3), (16, 6)]),
                              (5, [(0, 33), (12, 1), (40, 9)])]
            if not (D == 128 and P == 5 and H >= 8)]


@pytest.mark.parametrize("H,Hkv,D,P,chunks", TC_CASES)
def test_prefill_attention_tensor_cores_equals_twin(gpu, H, Hkv, D, P, chunks):
    """Tolerance: the kernel rounds the probabilities to bf16 before P V (the tensor cores take
    bf16), a relative error of up to 2^-9 per probability that the fp32 twin does not make, on
    top of the output's own bf16 rounding: outputs agree within 2^-6 relative, plus 1 % of the
    scale for values that cancel, and at least a third bit for bit."""
    from stage3_optimized.batch import PREFILL_TILE
    rng = np.random.default_rng(H * 7 + P + D)
    lens = [b + n for b, n in chunks]
    k32, v32, tables, *_ = paged(rng, lens, Hkv, D, P)
    k_cache, v_cache = bf16_bits(k32), bf16_bits(v32)
    token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(chunks)]).astype(np.int32)
    positions = np.concatenate([np.arange(b, b + n) for b, n in chunks]).astype(np.int32)
    starts = np.cumsum([0] + [n for _, n in chunks])
    tiles = [(t, min(PREFILL_TILE, stop - t)) for a, stop in zip(starts[:-1], starts[1:])
             for t in range(a, stop, PREFILL_TILE)]
    tile_start = np.array([t for t, _ in tiles], np.int32)
    tile_count = np.array([c for _, c in tiles], np.int32)
    q = bf16_random(rng, (len(positions), H, D), 2.0)
    args = [gpu(q), gpu(k_cache), gpu(v_cache), gpu(tables), gpu(token_seq), gpu(positions)]
    out = kernels.prefill_attention(*args, gpu(tile_start), gpu(tile_count)).get()
    expect = ops.prefill_attention(q, k_cache, v_cache, tables, token_seq, positions)
    g, e = f32(out), f32(expect)
    np.testing.assert_allclose(g, e, rtol=2 ** -6, atol=1e-2 * float(np.abs(e).max()))
    assert float(np.mean(out == expect)) >= 0.33
    # and the plain kernel it replaces agrees with the same twin more tightly
    plain = kernels.prefill_attention(
        *args, gpu(tile_start), gpu(tile_count), tensor_cores=False
    ).get()
    assert_bf16_close(plain, expect)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_engine_on_emulated_kernels_equals_engine_on_twins(gpu, monkeypatch, family):
    """The whole stage-3 engine with device="cuda" (model.py's GPU branch, kernels.py's launches
    and cuBLAS calls, the prefix cache) on the emulated kernels: the same tokens as device="cpu".
    A MoE model whose layer 1 is dense, small pages and budget (chunked prefill, page crossings),
    and a shared prefix so the third request starts from cached pages. qwen2_moe adds the
    q/k/v biases (fp32 add, then the device rounding) and the gated shared expert."""
    from common.engine import Request
    from common.sampling import SamplingParams
    from bench.testbed.models import make_model
    from stage3_optimized import engine as engine_module

    folder = make_model(family, mlp_only_layers=[1])
    # the second prompt is one whose next tokens are clear of a near-tie in that tiny model
    prompts = [list(range(40, 53)), [5, 9, 3] if family == "qwen3_moe" else [250, 12, 300],
               list(range(40, 50)) + [7]]

    def run(device):
        eng = engine_module.LLMEngine(folder, max_ctx=64, slots=3, token_budget=8, page_size=4,
                                      num_pages=32, device=device, progress=False)
        out = {str(i): [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            eng.add_request(
                Request(str(i), p, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
            )
            # the first one computes its prompt first
            while eng.has_work() and i == 0 and not out["0"]:
                for ev in eng.step():
                    out[ev.request_id].append(ev.token_id)
        while eng.has_work():
            for ev in eng.step():
                out[ev.request_id].append(ev.token_id)
        assert eng.num_free_pages() == 32
        return out, eng

    expect, cpu_eng = run("cpu")
    monkeypatch.setattr(engine_module, "array_module", lambda device: sys.modules["cupy"])
    got, eng = run("cuda")
    assert (
        isinstance(eng.model.cache.k_pool, emu.Dev)
        and isinstance(eng.weights.embed.data, emu.Dev)
    )
    assert eng.num_cached_tokens("2") == 8 == cpu_eng.num_cached_tokens("2")
    assert got == expect and all(len(t) == 3 for t in got.values())


def _graph_engine(folder, device, graphs, monkeypatch=None, **kw):
    """An engine with device="cuda" on the stand-in (graphs: DecodeGraphs with the real
    CupyCapture, on the stand-in's recording stream), or device="cpu"."""
    from stage3_optimized import engine as engine_module
    from stage3_optimized.cuda_graphs import DecodeGraphs
    if device == "cuda":
        monkeypatch.setattr(engine_module, "array_module", lambda device: sys.modules["cupy"])
    args = dict(max_ctx=48, slots=5, token_budget=32, page_size=4, num_pages=40, device=device,
                progress=False, enforce_eager=True)
    args.update(kw)
    eng = engine_module.LLMEngine(folder, **args)
    if graphs:
        eng.graphs = DecodeGraphs(eng.model, eng.inputs, args["slots"])   # buckets 1, 2, 4, 5
    return eng


def _drive(eng, prompts, lengths, params=None):
    from common.engine import Request
    from common.sampling import SamplingParams
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        eng.add_request(Request(str(i), p, params or greedy))
    out = {str(i): [] for i in range(len(prompts))}
    while eng.has_work():
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
    return out


def test_decode_graphs_capture_on_the_emulated_cupy_and_give_the_eager_twins_tokens(
    gpu, monkeypatch
):
    """The CUDA-graph path for real on the stand-in: CupyCapture records each bucket's step (the
    forward pass's kernel launches and ctypes cuBLAS calls, then the sampling kernel) without
    running it, and a replay runs the recorded launches again on the emulated kernels, with
    the pointers and scalars of the capture. The stand-in refuses in a capture what CuPy
    refuses (its cuBLAS wrapper, a sync, an allocation), so a step that did any of those
    would fail here. Padded buckets, block tables as wide as max_ctx, the decode grid sized
    for max_ctx (splits of 8 positions: most of a short context's splits are empty), padding
    rows with slot -1: the tokens must be those of the eager twins."""
    from bench.testbed.models import make_model
    folder = make_model("qwen3")
    prompts, lengths = [list(range(40, 50)), [5, 9, 3], [300, 301, 302, 303]], [5, 2, 4]
    expect = _drive(_graph_engine(folder, "cpu", False), prompts, lengths)
    monkeypatch.setattr(kernels, "SPLIT_LEN", 8)
    eng = _graph_engine(folder, "cuda", True, monkeypatch)
    got = _drive(eng, prompts, lengths)
    assert eng.graphs.error is None, eng.graphs.error
    # 3 sequences ride in the bucket of 4 (one padding row), then 2 and 1
    assert eng.graphs.num_replays > 0 and sorted(eng.graphs.graphs) == [1, 2, 4]
    assert emu.STATE.calls.graph_launches == eng.graphs.num_replays
    assert got == expect and [len(got[str(i)]) for i in range(3)] == lengths


@pytest.mark.parametrize(
    "planted", ["cupy_cublas_wrapper", "synchronize", "allocation", "host_copy"]
)
def test_a_refused_call_planted_in_the_captured_step_fails_the_capture(gpu, monkeypatch, planted):
    """Each call CuPy (or CUDA) refuses during a capture, planted in the decode step: the capture
    fails with that call's own error, the engine says why (DecodeGraphs.error) and goes on
    eagerly with the right tokens. This is the class of bug the first GPU run found (CuPy's
    cuBLAS wrapper inside the graph): the stand-in must not be kinder than CuPy."""
    from bench.testbed.models import make_model
    from stage3_optimized.model import Model
    folder = make_model("qwen3")
    prompts, lengths = [[5, 9, 3]], [4]
    expect = _drive(_graph_engine(folder, "cpu", False), prompts, lengths)
    cp = sys.modules["cupy"]
    plant = {"cupy_cublas_wrapper":
             lambda: cp.cuda.cublas.setStream(0, cp.cuda.get_current_stream().ptr),
             "synchronize": lambda: cp.cuda.Device().synchronize(),
             "allocation": lambda: cp.empty(4, cp.float32),
             "host_copy": lambda: cp.asarray(np.ones(4, np.float32))}[planted]
    real = Model.forward

    def forward(self, tokens, batch, all_logits=False):
        plant()
        return real(self, tokens, batch, all_logits)
    eng = _graph_engine(folder, "cuda", True, monkeypatch)
    monkeypatch.setattr(Model, "forward", forward)
    with pytest.warns(UserWarning, match="CUDA graph capture or replay failed"):
        got = _drive(eng, prompts, lengths)
    message = {
        "cupy_cublas_wrapper": "calling cuBLAS API during stream capture is currently unsupported"
    }
    assert eng.graphs.error is not None and eng.graphs.num_replays == 0
    assert message.get(planted, "not permitted while a stream is capturing") in eng.graphs.error
    assert got == expect


def test_a_capture_on_the_legacy_default_stream_is_refused_as_cupy_does(gpu):
    """CuPy refuses begin_capture on the null stream; on a blocking stream, a launch on the
    legacy stream during the capture is CUDA's implicit-dependency error; on a non-blocking
    one it runs at once and stays out of the graph."""
    cp = sys.modules["cupy"]
    with pytest.raises(RuntimeError, match=r"cannot capture on the default \(legacy\) stream"):
        cp.cuda.get_current_stream().begin_capture()
    gu = bf16_random(np.random.default_rng(12), (3, 2 * 40))
    for non_blocking in (False, True):
        capturing = cp.cuda.Stream(non_blocking=non_blocking)
        out = gpu(np.zeros((3, 40), np.uint16))
        with capturing:
            capturing.begin_capture()
        x = gpu(gu)
        try:
            if non_blocking:
                kernels.swiglu(x, out=out)                       # run now, not recorded
            else:
                with pytest.raises(emu.CaptureError, match="cudaErrorStreamCaptureImplicit"):
                    kernels.swiglu(x, out=out)
        finally:
            with capturing:
                graph = capturing.end_capture()
        assert graph.calls == []
        if non_blocking:
            np.testing.assert_array_equal(out.get(), ops.swiglu(gu))


@pytest.mark.parametrize("kind", ["kernel", "cublas"])
def test_a_graph_replay_after_its_arrays_were_freed_is_refused(gpu, kind):
    """A CUDA graph keeps pointers, not arrays: once an array it reads is freed, a replay reads
    memory the pool may have given to another array. The stand-in's graph keeps no reference
    either, and its replay fails with the freed argument named (a kernel's, or a cuBLAS call's,
    seven rows: the GEMM path)."""
    cp = sys.modules["cupy"]
    rng = np.random.default_rng(13)
    if kind == "kernel":
        x, out, expect = gpu(bf16_random(rng, (3, 80))), gpu(np.zeros((3, 40), np.uint16)), None
        run = functools.partial(kernels.swiglu, x, out=out)
        expect = ops.swiglu(x.get())
    else:
        a, w = bf16_random(rng, (7, 32)), bf16_random(rng, (24, 32))
        x, wd, out = gpu(a), gpu(w), gpu(np.zeros((7, 24), np.uint16))
        run = functools.partial(kernels.linear, x, wd, out=out)
        expect = ops.linear(a, w)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        run()
        graph = stream.end_capture()
    graph.launch()
    assert_bf16_close(out.get(), expect, min_exact=0.5)
    del run, x
    gc.collect()
    with pytest.raises(emu.CaptureError, match="whose memory was freed after the capture"):
        graph.launch()


def test_an_engine_whose_graph_lost_its_buffers_stops_replaying(gpu, monkeypatch):
    """A planted bug: the model's buffers are allocated anew after the first graph is captured.
    The graph still points at the old ones, freed: its replay fails (on the GPU it would read
    freed memory and give wrong tokens), the engine says why and runs eagerly, with the twins'
    tokens."""
    from bench.testbed.models import make_model
    from stage3_optimized.buffers import Activations
    folder = make_model("qwen3")
    prompts, lengths = [[5, 9, 3], [40, 41]], [6, 6]
    expect = _drive(_graph_engine(folder, "cpu", False), prompts, lengths)
    eng = _graph_engine(folder, "cuda", True, monkeypatch)
    real_run = eng.graphs.run

    def run(tokens, batch, sampling):
        out = real_run(tokens, batch, sampling)
        if eng.graphs.graphs and not getattr(eng, "_planted", False):
            m = eng.model                                      # after the first capture
            sizes = len(m.buffers.x), len(m.buffers.logits)
            m.buffers = Activations.allocate(m.xp, m.config, *sizes, m.max_ctx)
            eng._planted = True
            gc.collect()
        return out
    monkeypatch.setattr(eng.graphs, "run", run)
    with pytest.warns(UserWarning, match="CUDA graph capture or replay failed"):
        got = _drive(eng, prompts, lengths)
    assert "whose memory was freed after the capture" in eng.graphs.error
    assert eng.graphs.num_replays == 0
    assert got == expect


def test_a_graph_decode_step_makes_one_replay_two_copies_and_no_allocation(gpu, monkeypatch):
    """The host's calls in one decode step of two sequences, counted by the stand-in: eagerly,
    one input copy, the forward pass's launches (gemv.cu for every projection: no cuBLAS call),
    the sampling kernel, the ids copied back, and no allocation; as a graph replay, the same
    two copies and one graph launch, no kernel launched from the host."""
    from bench.testbed.models import make_model
    folder = make_model("qwen3")
    eng = _graph_engine(folder, "cuda", True, monkeypatch)
    L = eng.config.num_layers
    from common.engine import Request
    from common.sampling import SamplingParams
    for i, p in enumerate([[5, 9, 3], [40, 41]]):
        eng.add_request(
            Request(str(i), p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        )
    eng.step()                                                   # the prefill
    counts = []
    # warm-up + capture, then two replays
    for _ in range(3):
        before = emu.STATE.calls.as_dict()
        eng.step()
        counts.append({k: v - before[k] for k, v in emu.STATE.calls.as_dict().items()})
    warm, replay = counts[0], counts[2]
    per_layer = 7                                                # 4 gemv, rope/store, split, merge
    # + embedding, lm_head, sample; eager, then captured
    assert warm["launches"] == 2 * (L * per_layer + 3)
    assert warm["blas"] == 0 and warm["allocations"] == 0 and warm["elementwise"] == 0
    assert replay == dict(
        launches=0, blas=0, allocations=0, elementwise=0, copies=2, syncs=2, graph_launches=1
    )
    assert eng.graphs.num_replays == 2


def _wide_step(points: np.ndarray, near: float, width: float = 2e-3) -> float:
    """The middle of the step of points (cumulative shares in [0, 1], increasing) nearest to
    `near` among those wider than width: a value whose side of every boundary no fp32
    rounding can change."""
    lo = np.concatenate([[0.0], points[:-1]])
    wide = np.flatnonzero(points - lo > width)
    assert len(wide), "no step is wide enough"
    j = wide[np.argmin(np.abs((lo[wide] + points[wide]) / 2 - near))]
    return float((lo[j] + points[j]) / 2)


@pytest.mark.parametrize("V", [50, 1000, 4099])
def test_sample_kernel_equals_twin_on_the_same_uniform_numbers(gpu, V):
    """Greedy, temperature alone, top-k, top-p, both, top-k 1, a tiny top-p. u and top_p are
    put in the middle of a step at least 2e-3 wide (a token's share of the mass), away from
    the boundaries where fp32 sums in another order may round the other way: there,
    kernel and twin must pick the very same token."""
    rng = np.random.default_rng(V)
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.9), (0.8, 40, 0.75),
                (1.0, 1, 1.0), (1.0, 0, 0.01), (0.5, V - 1, 0.5)]
    S = len(settings)
    logits = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    logits[0, V // 3] = logits[0, V // 2] = logits[0].max() + 1      # a tie: greedy takes the first
    temperature = np.array([t for t, _, _ in settings], np.float32)
    top_k = np.array([k for _, k, _ in settings], np.int32)
    top_p = np.array([p for _, _, p in settings], np.float32)
    u = rng.random(S).astype(np.float32)
    for s in range(S):
        if temperature[s] <= 0:
            continue
        # top_p in the middle of a step of the mass
        if top_p[s] < 1:
            keep, w = ops.sampling_set(logits[s], temperature[s], top_k[s], 1.0)
            mass = np.cumsum(np.sort(w[keep].astype(np.float64))[::-1])
            top_p[s] = _wide_step(mass / mass[-1], float(top_p[s]))
        keep, w = ops.sampling_set(logits[s], temperature[s], top_k[s], top_p[s])
        run = np.cumsum(np.where(keep, w, 0).astype(np.float64))
        # u in the middle of a kept token's step
        u[s] = _wide_step(run[keep] / run[-1], float(u[s]))
    expect = ops.sample(logits, temperature, top_k, top_p, u)
    got = kernels.sample(gpu(logits), gpu(temperature), gpu(top_k), gpu(top_p), gpu(u)).get()
    np.testing.assert_array_equal(got, expect)
    # greedy: the first of the tied maxima
    assert expect[0] == V // 3
    # top-k 1 is greedy whatever u is
    assert expect[5] == int(np.argmax(logits[5]))
    sizes = [
        int(ops.sampling_set(logits[s], temperature[s], top_k[s], top_p[s])[0].sum())
        for s in range(1, S)
    ]
    assert sizes[0] == V and sizes[1] == min(20, V) and sizes[2] < V and sizes[3] <= min(40, V)
    # top-p 0.01 keeps the head only
    assert sizes[5] <= 3
    # the twin's choices are real draws: over many u, a row's tokens follow its kept distribution
    many = ops.sample(np.repeat(logits[1:2], 400, 0), np.full(400, 1.0, np.float32),
                      np.zeros(400, np.int32), np.ones(400, np.float32),
                      rng.random(400).astype(np.float32))
    assert len(set(many.tolist())) > 5


# ---------------------------------------------------------------------------
# the bugs a review found, each with the case that showed it
# ---------------------------------------------------------------------------

def test_sample_owner_finds_its_token_where_chunk_start_plus_each_weight_rounds_away(gpu):
    """Thread 0's chunk holds the weight 1 (logit 0), thread 1's chunk [16, 32) sixteen weights
    e^-17 = 4.1e-8, each under half an ulp of 1 (2^-24): 1 + w rounds back to 1 in fp32, their
    sum from 0 does not. u = 1 - 2^-23 puts the target inside thread 1's chunk. A walk that
    starts from chunk_start (v1) never passes the target and falls back to the row's last
    kept index (V - 1); the walk over local's own sums stops inside the chunk, as the twin does."""
    V = 256 * 16                                           # BLOCK 256: chunks of 16
    logits = np.full((1, V), -np.inf, np.float32)
    logits[0, 0] = 0.0
    logits[0, 16:32] = -17.0
    args = (np.ones(1, np.float32), np.zeros(1, np.int32), np.ones(1, np.float32),
            np.array([1 - 2 ** -23], np.float32))
    expect = ops.sample(logits, *args)
    got = kernels.sample(gpu(logits), *map(gpu, args)).get()
    assert 16 <= expect[0] < 32, expect
    assert 16 <= got[0] < 32 and abs(int(got[0]) - int(expect[0])) <= 2, (got, expect)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9), (1.0, 0, 0.5)]
)
def test_sample_degenerate_rows_give_minus_one_not_a_token(gpu, temperature, top_k, top_p):
    """All NaN (v1, greedy: id V, out of range), all -inf (v1, top-p: -1 or V - 1), one NaN or
    one +inf among finite logits: -1 from kernel and twin alike; a finite row beside them
    still gets its token."""
    V = 300
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((5, V)).astype(np.float32)
    logits[0] = np.nan
    logits[1] = -np.inf
    logits[2, 17] = np.nan
    logits[3, 200] = np.inf
    S = len(logits)
    args = (np.full(S, temperature, np.float32), np.full(S, top_k, np.int32),
            np.full(S, top_p, np.float32), np.full(S, 0.37, np.float32))
    expect = ops.sample(logits, *args)
    got = kernels.sample(gpu(logits), *map(gpu, args)).get()
    assert expect[:4].tolist() == [-1, -1, -1, -1] and 0 <= expect[4] < V
    np.testing.assert_array_equal(got, expect)


def test_swiglu_grid_stays_within_the_limits_for_more_than_65535_rows(gpu, emulated, monkeypatch):
    """v1 put the N rows in grid.y: 70,000 tokens were an invalid launch. The grid is checked
    by the emulator's launch limits (the run itself, 70,000 blocks of OS threads, would be slow)."""
    grids = []

    def check(grid, block, args, **kw):
        emulated["swiglu"]._check_launch(grid, block, 0)
        grids.append(grid)

    monkeypatch.setattr(kernels, "_kernel", lambda name: check)
    kernels.swiglu(gpu(np.zeros((70_000, 2 * 8), np.uint16)))
    assert grids and grids[0][1] <= 65535


def test_swiglu_strides_its_rows_over_grid_y(gpu, monkeypatch):
    """With grid.y cut to 3, every one of 11 rows is still computed (rows 3, 6, 9
    by block y 0...)."""
    monkeypatch.setattr(kernels, "MAX_GRID_Y", 3)
    gu = bf16_random(np.random.default_rng(5), (11, 2 * 40), 2.0)
    assert_bf16_close(kernels.swiglu(gpu(gu)).get(), ops.swiglu(gu))


def test_decode_split_past_the_context_returns_without_writing(gpu, emulated):
    """A split that starts past its sequence's context leaves its partials as they were (the
    early return; the merge reads only the used splits): a context of 3 in splits of 8 of a
    grid sized for 40 positions uses split 0 only, the second sequence (context 17) splits 0..2."""
    rng = np.random.default_rng(6)
    H, Hkv, D, P, split, lens = 4, 2, 32, 4, 8, [3, 17]
    k32, v32, tables, *_ = paged(rng, lens, Hkv, D, P)
    q = bf16_random(rng, (2, H, D))
    splits = 5
    part_out = gpu(np.full((2, H, splits, D), 7.0, np.float32))
    part_ml = gpu(np.full((2, H, splits, 2), 7.0, np.float32))
    emulated["paged_decode_attention"](
        (2 * Hkv, splits), (32 * (H // Hkv),),
        (gpu(q), gpu(bf16_bits(k32)), gpu(bf16_bits(v32)), gpu(tables),
         gpu(np.array(lens, np.int32)), part_out, part_ml, np.int32(H), np.int32(Hkv), np.int32(D),
         np.int32(P), np.int32(tables.shape[1]), np.int32(split), np.int32(splits),
         np.float32(1 / np.sqrt(D))),
        shared_mem=kernels.decode_shared_bytes(D))
    ml = part_ml.get()
    assert (ml[0, :, 1:] == 7.0).all() and (ml[1, :, 3:] == 7.0).all()        # untouched
    assert (ml[0, :, 0] != 7.0).all() and (ml[1, :, :3] != 7.0).all()         # written


def test_decode_shared_memory_is_sized_by_the_head_dim():
    assert (
        kernels.decode_shared_bytes(64) == 8 * 1024
        and kernels.decode_shared_bytes(128) == 16 * 1024
    )
    assert kernels.decode_shared_bytes(256) == 32 * 1024 <= emu.DEFAULT_DYNAMIC_SMEM
    src = (CUDA_DIR / "decode_attention.cu").read_text()
    assert "__shared__ unsigned short k_tile[TILE][MAX_D]" not in src and "extern __shared__" in src


@pytest.mark.skipif(not emu.RACE, reason="QS_EMU_RACE=0: built without the race detector")
def test_planted_swiglu_grid_stride_from_zero_is_a_race(gpu, emulated, tmp_path, monkeypatch):
    """The grid-stride loop written from row 0 in every block (a classic slip): blocks with
    different blockIdx.y write the same rows, which the race detector reports; the real
    kernel passes it at the same launch."""
    src = (CUDA_DIR / "swiglu.cu").read_text()
    old = "for (size_t n = blockIdx.y; n < (size_t)N; n += gridDim.y)"
    assert src.count(old) == 1
    bad = tmp_path / "swiglu.cu"
    bad.write_text(src.replace(old, "for (size_t n = 0; n < (size_t)N; n++)"))
    planted = emu.build([bad], tmp_path / "build")
    monkeypatch.setattr(kernels, "MAX_GRID_Y", 3)
    gu = bf16_random(np.random.default_rng(7), (5, 2 * 16))
    assert_bf16_close(kernels.swiglu(gpu(gu)).get(), ops.swiglu(gu))     # the real kernel: no race
    monkeypatch.setattr(kernels, "_kernel", lambda name: planted[name])
    with pytest.raises(
        emu.EmulatorError,
        match=r"race: block \(0,\d,0\) .* writes out\[\d+\], which block \(0,\d,0\) wrote",
    ):
        kernels.swiglu(gpu(gu))


def test_engine_reports_a_degenerate_logits_row_as_an_error_for_that_request_only(monkeypatch):
    """device="cpu" (the twins): the logits of request "bad" (greedy: the device sampler) and
    "bad_host" (a repetition penalty: the host Sampler) are NaN; each gets one event, token -1
    and finish_reason "error", and no token; "ok" gets its tokens as if alone; every page is
    freed."""
    from common.engine import Request
    from common.sampling import SamplingParams
    from bench.testbed.models import make_model
    from stage3_optimized.engine import LLMEngine

    folder = make_model("qwen3")

    def run(poison, names):
        eng = LLMEngine(folder, max_ctx=48, slots=4, token_budget=32, page_size=4, num_pages=40,
                        device="cpu", progress=False, enforce_eager=True)
        if poison:
            real_inputs, real_forward, step_seqs = eng._sampling_inputs, eng.model.forward, []

            def inputs(seqs):
                step_seqs[:] = seqs                          # this step's sampling rows, in order
                return real_inputs(seqs)

            def forward(tokens, batch, all_logits=False):
                logits = real_forward(tokens, batch, all_logits)
                for i, seq in enumerate(step_seqs):
                    if seq.id.startswith("bad"):
                        logits[i] = np.nan
                return logits
            monkeypatch.setattr(eng, "_sampling_inputs", inputs)
            monkeypatch.setattr(eng.model, "forward", forward)
        params = {"ok": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                  "bad": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                  "bad_host": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                             repetition_penalty=1.1)}
        for name in names:
            eng.add_request(Request(name, [5, 9, 3, 17, 40], params[name]))
        events = {name: [] for name in names}
        while eng.has_work():
            for ev in eng.step():
                events[ev.request_id].append((ev.token_id, ev.finish_reason))
        assert eng.num_free_pages() == 40
        return events

    alone = run(False, ["ok"])
    got = run(True, ["ok", "bad", "bad_host"])
    assert got["bad"] == [(-1, "error")] and got["bad_host"] == [(-1, "error")]
    assert got["ok"] == alone["ok"] and len(got["ok"]) == 4 and got["ok"][-1][1] == "length"


def test_pages_of_a_request_whose_logits_went_degenerate_leave_the_prefix_cache(monkeypatch):
    """device="cpu" (the twins), prefix caching on, pages of 4: a request whose logits come out
    NaN ends in an error, and a later request with the same 10-token prompt finds none of its
    pages cached (they may hold what made the NaN) and makes the tokens a fresh engine makes;
    after a request that ended well, the same prompt finds its 2 full pages (8 tokens) cached."""
    from common.engine import Request
    from common.sampling import SamplingParams
    from bench.testbed.models import make_model
    from stage3_optimized.engine import LLMEngine

    folder, prompt = make_model("qwen3"), [5, 9, 3, 17, 40, 2, 8, 11, 30, 7]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    def engine(poison):
        eng = LLMEngine(folder, max_ctx=48, slots=4, token_budget=32, page_size=4, num_pages=40,
                        device="cpu", progress=False, enforce_eager=True)
        real = eng.model.forward

        def forward(tokens, batch, all_logits=False):
            logits = real(tokens, batch, all_logits)
            if poison[0]:
                logits[:] = np.nan
            return logits
        monkeypatch.setattr(eng.model, "forward", forward)
        return eng

    def run(eng, name):
        eng.add_request(Request(name, list(prompt), params))
        out = []
        while eng.has_work():
            out += [(ev.token_id, ev.finish_reason) for ev in eng.step()]
        return out

    fresh = run(engine([False]), "fresh")
    poison = [True]
    eng = engine(poison)
    assert run(eng, "bad") == [(-1, "error")]
    poison[0] = False
    assert run(eng, "again") == fresh and len(fresh) == 3
    assert eng.cached_tokens["again"] == 0
    assert run(eng, "once more") == fresh and eng.cached_tokens["once more"] == 8
    assert eng.num_free_pages() == 40


def test_failed_capture_keeps_the_first_error_not_end_captures():
    """A launch fails inside the capture; end_capture() then raises "capture invalidated".
    DecodeGraphs.error must name the launch's error (v1 kept end_capture's)."""
    import types
    from stage3_optimized.cuda_graphs import CupyCapture

    class Stream:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def begin_capture(self):
            pass

        def end_capture(self):
            raise RuntimeError(
                "cudaErrorStreamCaptureInvalidated: operation failed due to a previous error"
            )

    cap = CupyCapture.__new__(CupyCapture)
    cap.cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None)))
    cap.stream = Stream()

    def step():
        raise ValueError("cuLaunchKernel: too many resources requested for launch (the cause)")

    with pytest.raises(ValueError, match="the cause"):
        cap(step)


def test_every_step_sends_its_inputs_in_one_copy_at_addresses_fixed_by_their_sizes(
    gpu, monkeypatch
):
    """StepInputs: each step (eager prefill, eager decode, graph decode) makes exactly one
    host-to-device copy, and two uploads with the same sizes put every field at the same
    address (what a graph's recorded pointers rely on)."""
    from bench.testbed.models import make_model
    from stage3_optimized.batch import build_batch
    from stage3_optimized.buffers import StepInputs
    copies = []
    real = StepInputs._copy
    monkeypatch.setattr(StepInputs, "_copy", lambda self, n: (copies.append(n), real(self, n))[1])
    eng = _graph_engine(make_model("qwen3"), "cuda", True, monkeypatch, slots=3)
    out = _drive(eng, [[5, 9, 3], [6, 9, 3, 4], [7, 2]], [4, 4, 4])
    assert all(len(t) == 4 for t in out.values())
    assert len(copies) == eng.num_steps and all(0 < n <= eng.inputs.host.size for n in copies)
    # the same sizes, other values: the same addresses
    from common.engine import Request
    from common.sampling import SamplingParams
    eng.add_request(
        Request("x", [5, 9, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    )
    sched = eng.scheduler.schedule()
    _, tokens, batch = build_batch(sched.seqs, sched.num_tokens, eng.page_size)
    a = eng.inputs.upload(tokens, batch)
    b = eng.inputs.upload(tokens + 1, batch)
    assert (
        a[0].ctypes.data == b[0].ctypes.data
        and a[1].block_tables.ctypes.data == b[1].block_tables.ctypes.data
    )
    assert (b[0].get() == tokens + 1).all()
