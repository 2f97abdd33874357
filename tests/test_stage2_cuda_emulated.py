"""The CUDA sources of stage 2 themselves, launched by kernels.py, run on the CPU.

Without a GPU, nvcc only proves that a kernel compiles. Here each .cu file is compiled
as C++ (g++) under a tiny emulator of the CUDA execution model, one OS thread per CUDA
thread: blockIdx / threadIdx per thread, `__shared__` memory shared by the block,
`__syncthreads()` as a barrier of the block, `__shfl_xor_sync` as an exchange through
a per-warp buffer between two barriers of the warp. Blocks run one after another. That
is enough to execute the index arithmetic, the online softmax, the warp reductions and
the shared-memory merges exactly as written, so a wrong offset or a missed rescale
fails here instead of on the GPU.

The kernels are launched through stage2_batched/kernels.py itself, with a stand-in
for CuPy (arrays are numpy arrays of a marker type; RawModule functions become the
emulated kernels, and every argument is checked against the kernel's C signature:
a float* must get a contiguous float32 array, an int an np.int32 ...). So the
wrappers' argument order, dtypes and launch grids are checked too, and finally the
whole engine (model.py's GPU branch) runs on the emulated kernels. What it cannot catch: races that need real
parallelism, memory-model and performance issues — tests/test_stage2_gpu.py runs the
same comparisons on a GPU.

Skipped only where no C++20 compiler (g++) is installed.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from stage2_batched import kernels, ops
from test_stage2_kernels import paged

CUDA_DIR = Path(kernels.__file__).parent / "cuda"
TOL = dict(rtol=1e-5, atol=1e-5)

EMULATOR = r"""
// --- a minimal CUDA execution model on CPU threads (blocks run one at a time) ---
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local Dim3 threadIdx, blockIdx;
static Dim3 blockDim, gridDim;
static std::barrier<>* block_barrier;
static std::barrier<>* warp_barrier[32];
static float warp_buffer[32][32];                       // [warp][lane]
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static                               // one copy, shared by the block's threads
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
    const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    warp_buffer[warp][lane] = v;
    warp_barrier[warp]->arrive_and_wait();             // everybody has written ...
    const float other = warp_buffer[warp][lane ^ offset];
    warp_barrier[warp]->arrive_and_wait();             // ... and read, before the next exchange
    return other;
}
inline float __int_as_float(unsigned bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

template <class Body>
void launch(unsigned gx, unsigned gy, unsigned threads, Body body) {
    gridDim = {gx, gy, 1};
    blockDim = {threads, 1, 1};
    for (unsigned by = 0; by < gy; by++) {
        for (unsigned bx = 0; bx < gx; bx++) {
            std::barrier<> block(threads);
            block_barrier = &block;
            std::vector<std::unique_ptr<std::barrier<>>> warps;
            for (unsigned w = 0; w * 32 < threads; w++) {
                warps.push_back(std::make_unique<std::barrier<>>(threads - w * 32 < 32 ? threads - w * 32 : 32));
                warp_barrier[w] = warps.back().get();
            }
            std::vector<std::thread> pool;
            for (unsigned t = 0; t < threads; t++) {
                pool.emplace_back([=] { threadIdx = {t, 0, 0}; blockIdx = {bx, by, 0}; body(); });
            }
            for (auto& th : pool) th.join();
        }
    }
}
"""

def kernel_signature(cu: str) -> tuple[str, list[str]]:
    """The kernel's name and its parameter declarations, as written in the .cu file."""
    text = (CUDA_DIR / cu).read_text()
    m = re.search(r'extern "C" __global__ void (\w+)\((.*?)\)\s*\{', text, re.S)
    params = re.sub(r"//[^\n]*", "", m.group(2))
    return m.group(1), [" ".join(p.split()) for p in params.split(",")]


C_TYPES = {"int": ctypes.c_int, "float": ctypes.c_float, "long long": ctypes.c_longlong}
NP_SCALARS = {"int": np.int32, "float": np.float32, "long long": np.int64}
NP_POINTEES = {"int": np.int32, "float": np.float32}


class EmulatedKernel:
    """What cupy.RawModule(...).get_function(name) returns: kernel((grid), (block), (args))."""

    def __init__(self, fn, name: str, params: list[str]):
        self.name, self.params = name, params
        self.fn = fn
        self.fn.argtypes = [ctypes.c_uint] * 3 + [
            ctypes.c_void_p if "*" in p else C_TYPES[" ".join(p.split()[:-1])] for p in params]

    def __call__(self, grid, block, args):
        assert len(args) == len(self.params), f"{self.name}: {len(args)} arguments for {len(self.params)} parameters"
        assert len(block) == 1 and 1 <= len(grid) <= 2, f"{self.name}: grid {grid}, block {block}"
        values = []
        for arg, param in zip(args, self.params):
            words = param.replace("*", " * ").split()
            base = " ".join(w for w in words[:-1] if w not in ("const", "__restrict__", "*"))
            if "*" in words:
                assert isinstance(arg, Dev), f"{self.name}: {param} got {type(arg).__name__}, not a device array"
                assert arg.flags.c_contiguous, f"{self.name}: {param} is not contiguous"
                assert arg.dtype == NP_POINTEES[base], f"{self.name}: {param} got {arg.dtype}"
                values.append(arg.ctypes.data)
            else:
                assert type(arg) is NP_SCALARS[base], f"{self.name}: {param} got {type(arg).__name__}"
                values.append(arg.item())
        gx, gy = grid[0], grid[1] if len(grid) > 1 else 1
        self.fn(gx, gy, block[0], *values)


class Dev(np.ndarray):
    """A 'device array' of the stand-in CuPy: a numpy array that kernels.py must treat as cupy."""

    def get(self) -> np.ndarray:
        return np.array(self, copy=True).view(np.ndarray)


def fake_cupy():
    cp = types.ModuleType("cupy")
    dev = lambda a: a.view(Dev) if isinstance(a, np.ndarray) else np.asarray(a).view(Dev)  # noqa: E731
    cp.asarray = lambda a, dtype=None: dev(np.array(a, dtype=dtype, copy=True))
    cp.ascontiguousarray = lambda a, dtype=None: dev(np.ascontiguousarray(a, dtype=dtype))
    cp.empty = lambda shape, dtype=np.float32: dev(np.empty(shape, dtype))
    cp.zeros = lambda shape, dtype=np.float32: dev(np.zeros(shape, dtype))
    cp.empty_like = lambda a, dtype=None: dev(np.empty_like(np.asarray(a), dtype=dtype))
    cp.zeros_like = lambda a, dtype=None: dev(np.zeros_like(np.asarray(a), dtype=dtype))
    cp.argmax = lambda a, axis=None: dev(np.asarray(np.argmax(np.asarray(a), axis=axis)))
    cp.float32, cp.int32, cp.int64 = np.float32, np.int32, np.int64
    return cp


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """kernel name -> EmulatedKernel, every .cu compiled under the emulator."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed")
    build = tmp_path_factory.mktemp("cuda-emulated")
    (build / "emulator.h").write_text(EMULATOR)
    procs, sigs = {}, {}
    for cu in sorted(kernels.KERNEL_FILES.values()):       # compile all at once (one g++ per file)
        name, params = sigs[cu] = kernel_signature(cu)
        names = ", ".join(p.split()[-1] for p in params)
        launcher = (f'extern "C" void launch_{name}(unsigned gx, unsigned gy, unsigned bx, {", ".join(params)}) '
                    f'{{ launch(gx, gy, bx, [=] {{ {name}({names}); }}); }}')
        src = build / (cu + ".cpp")
        src.write_text(f'#include "emulator.h"\n#include "{CUDA_DIR / cu}"\n{launcher}\n')
        procs[cu] = subprocess.Popen([gxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w",
                                      str(src), "-o", str(build / (cu + ".so"))],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for cu, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{cu} does not compile as C++ under the emulator:\n{err}"
        name, params = sigs[cu]
        out[name] = EmulatedKernel(getattr(ctypes.CDLL(str(build / (cu + ".so"))), f"launch_{name}"), name, params)
    return out


@pytest.fixture
def gpu(emulated, monkeypatch):
    """kernels.py with the stand-in CuPy and the emulated kernels. -> dev(numpy) -> device array"""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(kernels, "_on_gpu", lambda x: isinstance(x, Dev))
    monkeypatch.setattr(kernels, "_kernel", lambda name: emulated[name])
    return lambda a: np.ascontiguousarray(a).copy().view(Dev)


def test_every_kernel_is_emulated(emulated):
    assert set(emulated) == set(kernels.KERNEL_FILES)


# kept small (the emulator runs one OS thread per CUDA thread); the GPU test runs them all
DECODE_CASES = [(H, Hkv, D, P, lens)
                for H, Hkv, D in [(1, 1, 32), (4, 1, 64), (16, 8, 128), (2, 1, 48)]
                for P, lens in [(16, [1]), (16, [1, 16, 17, 40]), (5, [3, 11]), (256, [7, 260])]
                if not (H >= 16 and max(lens) > 100)]
PREFILL_CASES = [(H, Hkv, D, P, chunks)
                 for H, Hkv, D in [(1, 1, 32), (4, 2, 64), (16, 8, 128), (2, 1, 48)]
                 for P, chunks in [(16, [(0, 1)]), (16, [(0, 17), (5, 3), (16, 6)]), (5, [(0, 7), (12, 1), (3, 9)])]
                 if not (H >= 16 and P == 5)]


@pytest.mark.parametrize("H,Hkv,D,P,lens", DECODE_CASES)
def test_emulated_decode_attention_equals_twin(gpu, H, Hkv, D, P, lens):
    rng = np.random.default_rng(H + P)
    k_cache, v_cache, tables, *_ = paged(rng, lens, Hkv, D, P)
    q = rng.standard_normal((len(lens), H, D)).astype(np.float32)
    ctx = np.array(lens, np.int32)
    out = kernels.paged_decode_attention(gpu(q), gpu(k_cache), gpu(v_cache), gpu(tables), gpu(ctx))
    assert isinstance(out, Dev)
    np.testing.assert_allclose(out.get(), ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx), **TOL)


@pytest.mark.parametrize("H,Hkv,D,P,chunks", PREFILL_CASES)
def test_emulated_prefill_attention_equals_twin(gpu, H, Hkv, D, P, chunks):
    rng = np.random.default_rng(H * 3 + P)
    lens = [b + n for b, n in chunks]
    k_cache, v_cache, tables, *_ = paged(rng, lens, Hkv, D, P)
    token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(chunks)]).astype(np.int32)
    positions = np.concatenate([np.arange(b, b + n) for b, n in chunks]).astype(np.int32)
    q = rng.standard_normal((len(positions), H, D)).astype(np.float32)
    out = kernels.prefill_attention(gpu(q), gpu(k_cache), gpu(v_cache), gpu(tables), gpu(token_seq),
                                    gpu(positions))
    expect = ops.prefill_attention(q, k_cache, v_cache, tables, token_seq, positions)
    np.testing.assert_allclose(out.get(), expect, **TOL)


def test_emulated_small_kernels_equal_twins(gpu):
    rng = np.random.default_rng(0)
    table = rng.standard_normal((50, 96)).astype(np.float32)
    ids = rng.integers(0, 50, size=7).astype(np.int32)
    np.testing.assert_array_equal(kernels.embedding(gpu(ids), gpu(table)).get(), ops.embedding(ids, table))
    # rmsnorm: residual rows (C = 300 > the block of 256) and per-head rows (D = 32)
    for shape in [(3, 300), (5, 4, 32), (1, 1, 128)]:
        x = rng.standard_normal(shape).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        np.testing.assert_allclose(kernels.rmsnorm(gpu(x), gpu(w), 1e-6).get(), ops.rmsnorm(x, w, 1e-6), **TOL)
    # rope, each token at its own position
    x = rng.standard_normal((6, 3, 64)).astype(np.float32)
    pos = rng.integers(0, 500, size=6)
    cos, sin = ops.rope_tables(500, 64, 1e6)
    np.testing.assert_allclose(kernels.rope(gpu(x), gpu(cos)[pos], gpu(sin)[pos]).get(),
                               ops.rope(x, cos[pos], sin[pos]), **TOL)
    # store_kvcache through a slot mapping, into one layer of a [L, NB, P, Hkv, D] pool, a skipped slot
    k = rng.standard_normal((9, 2, 32)).astype(np.float32)
    v = rng.standard_normal((9, 2, 32)).astype(np.float32)
    slots = rng.permutation(5 * 4)[:9].astype(np.int32)
    slots[3] = -1
    pool_k, pool_v = gpu(np.zeros((2, 5, 4, 2, 32), np.float32)), gpu(np.zeros((2, 5, 4, 2, 32), np.float32))
    expect_k, expect_v = np.zeros((5, 4, 2, 32), np.float32), np.zeros((5, 4, 2, 32), np.float32)
    kernels.store_kvcache(gpu(k), gpu(v), pool_k[1], pool_v[1], gpu(slots))
    ops.store_kvcache(k, v, expect_k, expect_v, slots)
    np.testing.assert_array_equal(pool_k.get()[1], expect_k)
    np.testing.assert_array_equal(pool_v.get()[1], expect_v)
    assert not pool_k.get()[0].any()                       # the other layer is untouched
    # elementwise, n not a multiple of the block
    g = rng.standard_normal((10, 100)).astype(np.float32)
    u = rng.standard_normal((10, 100)).astype(np.float32)
    np.testing.assert_allclose(kernels.silu_mul(gpu(g), gpu(u)).get(), ops.silu_mul(g, u), **TOL)
    np.testing.assert_array_equal(kernels.residual_add(gpu(g), gpu(u)).get(), ops.residual_add(g, u))


def test_engine_on_emulated_kernels_equals_engine_on_twins(gpu, monkeypatch):
    """The whole engine with device="cuda" (model.py's GPU branch, kernels.py's launches,
    the device-side greedy argmax) on the emulated kernels: the same tokens as device="cpu".
    Small pages and budget so that chunked prefill and page crossings happen; a Qwen3-MoE
    whose layer 1 is dense, so both MLP paths run."""
    from common.engine import Request
    from common.sampling import SamplingParams
    from models import make_model
    from stage2_batched import engine as engine_module

    folder = make_model("qwen3_moe", mlp_only_layers=[1])
    prompts = [[5, 9, 3], list(range(10, 16)), list(range(40, 53))]

    def run(device):
        eng = engine_module.LLMEngine(folder, max_ctx=64, slots=3, token_budget=8, page_size=4,
                                      num_pages=32, device=device, progress=False)
        for i, p in enumerate(prompts):
            eng.add_request(Request(str(i), p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
        out = {str(i): [] for i in range(len(prompts))}
        while eng.has_work():
            for ev in eng.step():
                out[ev.request_id].append(ev.token_id)
        assert eng.num_free_pages() == 32
        return out, eng

    expect, _ = run("cpu")
    monkeypatch.setattr(engine_module, "array_module", lambda device: sys.modules["cupy"])
    got, eng = run("cuda")
    assert isinstance(eng.model.cache.k_pool, Dev) and isinstance(eng.weights.embed.data, Dev)
    assert got == expect and all(len(t) == 2 for t in got.values())
