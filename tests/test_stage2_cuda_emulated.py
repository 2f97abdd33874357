"""The CUDA sources themselves, launched by kernels.py, run on the CPU under the
emulator of bench/testbed/cuda_emulator.py (one OS thread per CUDA thread; blocks in a seeded,
shuffled order, 2-4 live at once; per-block shared memory poisoned at the block's start;
shared-memory, launch and shuffle-mask limits checked; a watchdog for deadlocks).

Without a GPU, nvcc only proves that a kernel compiles. Here each .cu file runs: the
index arithmetic, the online softmax, the warp reductions and the shared-memory merges
execute as written, so a wrong offset or a missed rescale fails here instead of on the
GPU. The kernels are launched through stage2_batched/kernels.py itself, with a stand-in
for CuPy (arrays are numpy arrays of a marker type; RawModule functions become the
emulated kernels, and every argument is checked against the kernel's C signature: a
float* must get a contiguous float32 array, an int an np.int32 ...). So the wrappers'
argument order, dtypes and launch grids are checked too, and finally the whole engine
(model.py's GPU branch) runs on the emulated kernels.

The second half plants one bug of each kind the emulator claims to catch in a copy of a
real kernel, and checks that it is caught. A failure prints the emulator's seed
(QS_EMU_SEED replays it). Every .cu file of every stage (stage*/cuda) is compiled under
the emulator; a file that uses what it cannot model says `// Emulator: unsupported (why)`.

Skipped only where no C++20 compiler (g++) is installed.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from bench import lessons
from bench.testbed import cuda_emulator as emu
from bench.testbed.cuda_emulator import Dev, EmulatorError, dev, fake_cupy
from bench.testbed.cuda_sources import cu_files, cu_id
from bench.testbed.models import make_model
from stage2_batched import kernels, ops
from test_stage2_kernels import paged

CUDA_DIR = Path(kernels.__file__).parent / "cuda"
TOL = dict(rtol=1e-5, atol=1e-5)
ALL_CU = cu_files()


@pytest.fixture(autouse=True)
def _emulator_seed_in_the_report(request):
    """A failing test shows the seed its launches used (QS_EMU_SEED=... replays them)."""
    yield
    request.node.add_report_section("call", "emulator", f"QS_EMU_SEED={emu.SEED}")


def _need_gxx():
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")


@pytest.fixture(scope="module")
def emulated_stages(tmp_path_factory):
    """stage folder -> (kernel name -> EmulatedKernel): every .cu file of every stage that
    the emulator supports (one g++ per file). Per stage: stages reuse kernel names
    (stage 3's paged_decode_attention takes other arguments than stage 2's)."""
    _need_gxx()
    sources = [cu for cu in ALL_CU if emu.unsupported(cu.read_text()) is None]
    root = tmp_path_factory.mktemp("cuda-emulated")
    stages = sorted({cu.parent.parent.name for cu in sources})
    return {
        st: emu.build([cu for cu in sources if cu.parent.parent.name == st], root / st)
        for st in stages
    }


@pytest.fixture(scope="module")
def emulated(emulated_stages):
    """kernel name -> EmulatedKernel for stage 2, whose kernels.py these tests drive."""
    return emulated_stages["stage2_batched"]


@pytest.fixture
def gpu(emulated, monkeypatch):
    """kernels.py with the stand-in CuPy and the emulated kernels. -> dev(numpy) -> device array"""
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy())
    monkeypatch.setattr(kernels, "_on_gpu", lambda x: isinstance(x, Dev))
    monkeypatch.setattr(kernels, "_kernel", lambda name: emulated[name])
    return dev


@pytest.mark.parametrize("cu", ALL_CU, ids=cu_id)
def test_every_cu_file_runs_under_the_emulator(emulated_stages, cu):
    why = emu.unsupported(cu.read_text())
    if why is not None:
        pytest.skip(f"{cu_id(cu)} says the emulator cannot run it: {why}")
    names = [name for name, _ in emu.kernel_signatures(cu.read_text())]
    built = emulated_stages[cu.parent.parent.name]
    assert names and all(n in built and built[n].source == cu for n in names)


def test_every_stage2_kernel_is_emulated(emulated):
    assert set(kernels.KERNEL_FILES) <= set(emulated)


# kept small (the emulator runs one OS thread per CUDA thread); the GPU test runs them all
DECODE_CASES = [(H, Hkv, D, P, lens)
                for H, Hkv, D in [(1, 1, 32), (4, 1, 64), (16, 8, 128), (2, 1, 48)]
                for P, lens in [(16, [1]), (16, [1, 16, 17, 40]), (5, [3, 11]), (256, [7, 260])]
                if not (H >= 16 and max(lens) > 100)]
PREFILL_CASES = [(H, Hkv, D, P, chunks)
                 for H, Hkv, D in [(1, 1, 32), (4, 2, 64), (16, 8, 128), (2, 1, 48)]
                 for P, chunks in [(16, [(0, 1)]), (16, [(0, 17), (5, 3), (16, 6)]),
                                   (5, [(0, 7), (12, 1), (3, 9)])]
                 if not (H >= 16 and P == 5)]


@pytest.mark.parametrize("H,Hkv,D,P,lens", DECODE_CASES)
def test_emulated_decode_attention_equals_twin(gpu, H, Hkv, D, P, lens):
    rng = np.random.default_rng(H + P)
    k_cache, v_cache, tables, *_ = paged(rng, lens, Hkv, D, P)
    q = rng.standard_normal((len(lens), H, D)).astype(np.float32)
    ctx = np.array(lens, np.int32)
    out = kernels.paged_decode_attention(gpu(q), gpu(k_cache), gpu(v_cache), gpu(tables), gpu(ctx))
    assert isinstance(out, Dev)
    np.testing.assert_allclose(
        out.get(), ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx), **TOL
    )


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
    np.testing.assert_array_equal(
        kernels.embedding(gpu(ids), gpu(table)).get(), ops.embedding(ids, table)
    )
    # rmsnorm: residual rows (C = 300 > the block of 256) and per-head rows (D = 32)
    for shape in [(3, 300), (5, 4, 32), (1, 1, 128)]:
        x = rng.standard_normal(shape).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        np.testing.assert_allclose(
            kernels.rmsnorm(gpu(x), gpu(w), 1e-6).get(), ops.rmsnorm(x, w, 1e-6), **TOL
        )
    # rope, each token at its own position
    x = rng.standard_normal((6, 3, 64)).astype(np.float32)
    pos = rng.integers(0, 500, size=6)
    cos, sin = ops.rope_tables(500, 64, 1e6)
    np.testing.assert_allclose(kernels.rope(gpu(x), gpu(cos)[pos], gpu(sin)[pos]).get(),
                               ops.rope(x, cos[pos], sin[pos]), **TOL)
    # store_kvcache through a slot mapping, into one layer of a [L, NB, P, Hkv, D] pool, a skipped
    # slot
    k = rng.standard_normal((9, 2, 32)).astype(np.float32)
    v = rng.standard_normal((9, 2, 32)).astype(np.float32)
    slots = rng.permutation(5 * 4)[:9].astype(np.int32)
    slots[3] = -1
    pool_k, pool_v = (
        gpu(np.zeros((2, 5, 4, 2, 32), np.float32)),
        gpu(np.zeros((2, 5, 4, 2, 32), np.float32)),
    )
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
    np.testing.assert_array_equal(
        kernels.residual_add(gpu(g), gpu(u)).get(), ops.residual_add(g, u)
    )


def test_engine_on_emulated_kernels_equals_engine_on_twins(gpu, monkeypatch):
    """The whole engine with device="cuda" (model.py's GPU branch, kernels.py's launches,
    the device-side greedy argmax) on the emulated kernels: the same tokens as device="cpu".
    Small pages and budget so that chunked prefill and page crossings happen; a Qwen3-MoE
    whose layer 1 is dense, so both MLP paths run."""
    from common.engine import Request
    from common.sampling import SamplingParams
    from bench.testbed.models import make_model
    from stage2_batched import engine as engine_module

    folder = make_model("qwen3_moe", mlp_only_layers=[1])
    prompts = [[5, 9, 3], list(range(10, 16)), list(range(40, 53))]

    def run(device):
        eng = engine_module.LLMEngine(folder, max_ctx=64, slots=3, token_budget=8, page_size=4,
                                      num_pages=32, device=device, progress=False)
        for i, p in enumerate(prompts):
            eng.add_request(
                Request(str(i), p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            )
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


def test_a_decode_step_allocates_once_per_step_not_once_per_op():
    """The host's calls in one decode step of four sequences (bench lessons' workload and
    model shape, counted on the stand-in CuPy, kernels not run), at 1 and 3 layers. Every
    kernel and GEMM of a layer writes into the model's Scratch, so a layer adds 11 launches
    and 7 GEMMs and no allocation. The step's 14 are its own: 8 uploads (token ids and 7
    BatchInfo arrays), the context check's max, the two RoPE gathers, the logits, and the
    sampled rows' index and gather."""
    one, three = (lessons.host_counts("stage2_batched", make_model("qwen3", **dict(lessons.WORKLOAD,
                                                                                   num_hidden_layers=L)),
                                      graphs=False) for L in (1, 3))
    assert one["allocations"] == three["allocations"] == 14
    assert three["launches"] - one["launches"] == 2 * 11 and three["blas"] - one["blas"] == 2 * 7
    # the max, the two gathers, the rows' gather
    assert three["elementwise"] == one["elementwise"] == 4


def test_engine_sizes_its_kv_pool_from_what_cupys_pool_holds():
    """stage2_batched/engine.py: a second engine in one process counts the bytes CuPy's pool
    caches (the first engine's, given back to the pool but not to the driver) as free, after
    handing the unreferenced ones back."""
    from stage2_batched.engine import LLMEngine

    class Pool:
        freed = False

        def free_all_blocks(self):
            self.freed = True

        def free_bytes(self):
            return 3 * 2**30

    pool = Pool()
    device = SimpleNamespace(mem_info=(2 * 2**30, 141 * 2**30))
    eng = LLMEngine.__new__(LLMEngine)
    eng.xp = SimpleNamespace(
        get_default_memory_pool=lambda: pool, cuda=SimpleNamespace(Device=lambda: device)
    )
    assert eng._free_gpu_bytes() == 5 * 2**30 and pool.freed


# ---------------------------------------------------------------------------
# planted bugs: each kind the emulator claims to catch, in a copy of a real kernel
# ---------------------------------------------------------------------------

def plant(file: str, kernel: str, new_name: str, *edits: tuple[str, str]) -> str:
    """The source of CUDA_DIR/file with the kernel renamed and each (old, new) edit applied
    (each must apply exactly once, so a changed kernel cannot silently void the test)."""
    src = (CUDA_DIR / file).read_text()
    for old, new in ((f"void {kernel}(", f"void {new_name}("), *edits):
        assert src.count(old) == 1, f"{file}: the planted edit {old!r} no longer applies"
        src = src.replace(old, new)
    return src


PLANTED = {
    # block b reads what block b-1 wrote: right only if the blocks run in order
    "residual_add_chain": ("residual_add.cu", "residual_add", [
        ("out[i] = x[i] + y[i];",
         "out[i] = x[i] + (blockIdx.x > 0 && threadIdx.x == 0 ? out[i - 1] : y[i]);")]),
    # threads past the row's end never write their partial sum: right only on zeroed memory
    "rmsnorm_unwritten": ("rmsnorm.cu", "rmsnorm", [
        ("partial[threadIdx.x] = ss;", "if (threadIdx.x < C) partial[threadIdx.x] = ss;")]),
    # 64 KB of static shared memory
    "decode_big_smem": ("decode_attention.cu", "paged_decode_attention", [
        ("__shared__ float sm_acc[WARPS][MAX_D];", "__shared__ float sm_acc[WARPS][MAX_D * 16];")]),
    # dynamic shared memory (a correct kernel: the launch decides whether it is valid)
    "rmsnorm_dynamic": ("rmsnorm.cu", "rmsnorm", [
        ("__shared__ float partial[BLOCK];", "extern __shared__ float partial[];")]),
    # half a warp in the reduction's mask
    "decode_half_mask": ("decode_attention.cu", "paged_decode_attention", [
        ("__shfl_xor_sync(0xffffffffu, x, offset)", "__shfl_xor_sync(0x0000ffffu, x, offset)")]),
    # threads that have no element return before the block's barrier
    "rmsnorm_early_exit": ("rmsnorm.cu", "rmsnorm", [
        ("    partial[threadIdx.x] = ss;",
         "    if (threadIdx.x >= C) return;\n    partial[threadIdx.x] = ss;")]),
    # every block writes the first blockDim outputs (an index without blockIdx): a write/write race
    "silu_mul_overlap": ("silu_mul.cu", "silu_mul", [
        ("out[i] = g / (1.0f + expf(-g)) * up[i];",
         "out[threadIdx.x] = g / (1.0f + expf(-g)) * up[i];")]),
    # lane 0 waits in a shuffle for lanes that wait at the barrier for lane 0
    "rmsnorm_deadlock": ("rmsnorm.cu", "rmsnorm", [
        ("    partial[threadIdx.x] = ss;",
         "    if (threadIdx.x == 0) ss += __shfl_xor_sync(0xffffffffu, ss, 1);\n"
         "    partial[threadIdx.x] = ss;")]),
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """name -> EmulatedKernel of every planted copy, compiled at once."""
    _need_gxx()
    folder = tmp_path_factory.mktemp("planted")
    sources = []
    for name, (file, kernel, edits) in PLANTED.items():
        path = folder / "stage2_batched" / "cuda" / f"{name}.cu"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(plant(file, kernel, name, *edits))
        sources.append(path)
    return emu.build(sources, folder / "build")


def test_planted_dependency_between_blocks_is_revealed_by_the_shuffled_order(planted, monkeypatch):
    """In order, each block's first element adds its predecessor's last output (1 + 2 = 3);
    blocks in a shuffled order, several at once, read it before it is written (1 + 0).
    (The race detector, off here, reports the launch itself: the next test.)"""
    monkeypatch.setattr(emu, "RACE", False)
    n, threads = 32 * 24, 32
    x, y = dev(np.ones(n, np.float32)), dev(np.ones(n, np.float32))
    out = dev(np.zeros(n, np.float32))
    planted["residual_add_chain"]((n // threads,), (threads,), (x, y, out, np.int64(n)))
    firsts = out.get()[threads::threads]                  # the first element of blocks 1..23
    assert not np.array_equal(firsts, np.full_like(firsts, 3.0)), (
        "every block ran after its predecessor"
    )
    assert set(np.unique(firsts).tolist()) <= {1.0, 3.0}


@pytest.mark.skipif(not emu.RACE, reason="QS_EMU_RACE=0: built without the race detector")
def test_planted_read_of_another_blocks_output_is_a_race(planted):
    """The same kernel under the race detector: block b reads out[b * 32 - 1], which block
    b - 1 writes; the launch fails whatever order the blocks ran in, and names the element."""
    n, threads = 32 * 24, 32
    x, y = dev(np.ones(n, np.float32)), dev(np.ones(n, np.float32))
    with pytest.raises(EmulatorError,
                       match=r"race: block \(\d+,0,0\) thread \(\d+,0,0\) (reads|writes) "
                             r"out\[(\d+)\], which block \(\d+,0,0\) (wrote|read)"):
        planted["residual_add_chain"](
            (n // threads,), (threads,), (x, y, dev(np.zeros(n, np.float32)), np.int64(n))
        )


@pytest.mark.skipif(not emu.RACE, reason="QS_EMU_RACE=0: built without the race detector")
def test_planted_write_write_race_between_blocks_is_reported(planted, emulated):
    """Every block writes out[0..31] (the index lost blockIdx): a write/write race on out[...];
    the real kernel, each block on its own slice, passes the same detector."""
    n = 32 * 5
    g, u = dev(np.ones(n, np.float32)), dev(np.ones(n, np.float32))
    with pytest.raises(
        EmulatorError, match=r"race: .* writes out\[\d+\], which block \(\d,0,0\) (wrote|read)"
    ):
        planted["silu_mul_overlap"]((5,), (32,), (g, u, dev(np.zeros(n, np.float32)), np.int64(n)))
    out = dev(np.zeros(n, np.float32))
    emulated["silu_mul"]((5,), (32,), (g, u, out, np.int64(n)))
    np.testing.assert_allclose(
        out.get(), ops.silu_mul(np.ones(n, np.float32), np.ones(n, np.float32)), **TOL
    )


@pytest.mark.skipif(not emu.RACE, reason="QS_EMU_RACE=0: built without the race detector")
def test_atomics_of_many_blocks_on_one_address_are_not_a_race(tmp_path):
    """atomicAdd from every block into one counter is ordered by the hardware: no race; the same
    sum with a plain += is one."""
    _need_gxx()
    src = tmp_path / "count.cu"
    src.write_text('extern "C" __global__ void count_atomic(float* total) '
                   '{ atomicAdd(total, 1.0f); }\n'
                   'extern "C" __global__ void count_plain(float* total) '
                   '{ if (threadIdx.x == 0) *total += 1.0f; }\n')
    k = emu.build([src], tmp_path / "build")
    total = dev(np.zeros(1, np.float32))
    k["count_atomic"]((6,), (32,), (total,))
    assert total.get()[0] == 6 * 32
    with pytest.raises(EmulatorError, match=r"race: .*total\[0\]"):
        k["count_plain"]((6,), (32,), (total,))


def test_planted_read_of_unwritten_shared_memory_is_poisoned(planted, emulated):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 100)).astype(np.float32)       # C = 100 < 256 threads
    w = rng.standard_normal(100).astype(np.float32)
    out = dev(np.zeros_like(x))
    planted["rmsnorm_unwritten"](
        (5,), (256,), (dev(x), dev(w), out, np.int32(100), np.float32(1e-6))
    )
    assert np.isnan(out.get()).all(), (
        "threads 100..255 never wrote partial[]: poison must reach the sum"
    )
    out = dev(np.zeros_like(x))                                 # the real kernel at the same shape
    emulated["rmsnorm"]((5,), (256,), (dev(x), dev(w), out, np.int32(100), np.float32(1e-6)))
    np.testing.assert_allclose(out.get(), ops.rmsnorm(x, w, 1e-6), **TOL)


def test_planted_static_shared_memory_over_48_kb_is_refused(planted, gpu, monkeypatch):
    monkeypatch.setattr(kernels, "_kernel", lambda name: planted["decode_big_smem"])
    rng = np.random.default_rng(1)
    k_cache, v_cache, tables, *_ = paged(rng, [3], 1, 32, 16)
    q = rng.standard_normal((1, 2, 32)).astype(np.float32)
    with pytest.raises(
        EmulatorError, match=r"static __shared__ memory reaches 65568 bytes .* over the 49152"
    ):
        kernels.paged_decode_attention(
            gpu(q), gpu(k_cache), gpu(v_cache), gpu(tables), gpu(np.array([3], np.int32))
        )


def test_planted_dynamic_shared_memory_is_checked_against_the_attribute_and_the_opt_in_limit(
    planted,
):
    kernel = planted["rmsnorm_dynamic"]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 300)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    args = lambda out: (dev(x), dev(w), out, np.int32(300), np.float32(1e-6))  # noqa: E731
    out = dev(np.zeros_like(x))
    kernel((3,), (256,), args(out), shared_mem=256 * 4)        # what it needs: runs, and is right
    np.testing.assert_allclose(out.get(), ops.rmsnorm(x, w, 1e-6), **TOL)
    with pytest.raises(EmulatorError, match="launch gave 0 bytes"):
        kernel((3,), (256,), args(dev(np.zeros_like(x))))
    with pytest.raises(
        EmulatorError, match=r"over the kernel's max_dynamic_shared_size_bytes \(49152\)"
    ):
        kernel((3,), (256,), args(dev(np.zeros_like(x))), shared_mem=64 * 1024)
    # raised, as a FlashAttention kernel does
    kernel.max_dynamic_shared_size_bytes = 100 * 1024
    kernel((3,), (256,), args(dev(np.zeros_like(x))), shared_mem=64 * 1024)
    with pytest.raises(EmulatorError, match=r"opt-in limit of sm_90 \(232448 bytes"):
        kernel.max_dynamic_shared_size_bytes = 240 * 1024


@pytest.mark.parametrize("grid,block,match", [
    ((2,), (2048,), "2048 threads; at most 1024"),
    ((2,), (32, 32, 2), "2048 threads; at most 1024"),
    ((2,), (1, 1, 128), "at most 1024"),
    ((2, 70000), (256,), "over the limits"),
    ((0,), (256,), "at least 1"),
])
def test_planted_launch_outside_the_limits_is_refused(emulated, grid, block, match):
    x = dev(np.ones((2, 64), np.float32))
    with pytest.raises(EmulatorError, match=match):
        emulated["rmsnorm"](grid, block, (x, dev(np.ones(64, np.float32)),
                                          dev(np.zeros((2, 64), np.float32)),
                                          np.int32(64), np.float32(1e-6)))


def test_planted_shuffle_outside_its_mask_is_an_error(planted, gpu, monkeypatch):
    monkeypatch.setattr(kernels, "_kernel", lambda name: planted["decode_half_mask"])
    rng = np.random.default_rng(3)
    k_cache, v_cache, tables, *_ = paged(rng, [5], 1, 32, 16)
    q = rng.standard_normal((1, 1, 32)).astype(np.float32)
    with pytest.raises(
        EmulatorError, match=r"(leaves out the calling lane|outside the mask 0x0000ffff).*\n.*seed"
    ):
        kernels.paged_decode_attention(
            gpu(q), gpu(k_cache), gpu(v_cache), gpu(tables), gpu(np.array([5], np.int32))
        )


def test_planted_barrier_after_an_early_return_is_an_error(planted):
    x = dev(np.ones((2, 100), np.float32))
    with pytest.raises(
        EmulatorError,
        match=r"100 of 256 threads reached __syncthreads\(\) at line \d+ and 156 exited",
    ):
        planted["rmsnorm_early_exit"]((2,), (256,), (x, dev(np.ones(100, np.float32)),
                                                     dev(np.zeros((2, 100), np.float32)),
                                                     np.int32(100), np.float32(1e-6)))


def test_planted_deadlock_is_ended_by_the_watchdog(planted, monkeypatch):
    monkeypatch.setattr(emu, "WATCHDOG_S", 2.0)
    x = dev(np.ones((1, 64), np.float32))
    with pytest.raises(
        EmulatorError, match=r"watchdog: no progress for 2 s, a deadlock: block \(0,0,0\) thread"
    ):
        planted["rmsnorm_deadlock"]((1,), (256,), (x, dev(np.ones(64, np.float32)),
                                                   dev(np.zeros((1, 64), np.float32)),
                                                   np.int32(64), np.float32(1e-6)))
