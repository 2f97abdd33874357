"""Stage 3 on a GPU: every CUDA kernel against its numpy twin at awkward shapes, and the
engine with device="cuda" against transformers' greedy tokens (up to the first near-tie,
as in test_stage3_engine.py), with its CUDA graphs really captured and replayed.

bench/gpu_check.sh runs the tests without "engine" in their names as its kernel step and
those with it as its engine step, with QS_REQUIRE_GPU=1, which turns a skip into a failure
(tests/conftest.py); the tests marked `sanitize` (small shapes, every kernel once) run once
more under compute-sanitizer, with CuPy's memory pool off so that memcheck sees each array's
own bounds. With QS_REQUIRE_GPU=1 a tensor-core prefill that falls back to the plain kernel
is a failure too (kernels._tc_available).

Without a GPU the kernel tests run on the emulated kernels (bench/testbed/cuda_emulator.py, the
stand-in CuPy of test_stage3_cuda_emulated.py) where QS_GPU_DRY_RUN=1 (gpu_check.sh
--dry-run), on a subset of the shapes that the emulator's thread per CUDA thread can carry;
elsewhere they skip (test_stage3_cuda_emulated.py runs the kernels on CPU in CI). The engine
tests need the GPU.

Tolerances (bf16 outputs, fp32 arithmetic in another order than the twin's): within 2 bf16
steps and mostly bit-identical (assert_bf16_close); the tensor-core prefill rounds P to bf16
before P V: within 2^-6 relative plus 1 % of the scale, a third bit for bit; cuBLAS's bf16
GEMM sums in its own order: within 2 bf16 steps, half bit for bit; sampling: the same token
on the same uniform numbers, drawn away from the boundaries.
"""
from __future__ import annotations

import os

import numpy as np
import pytest


def _why_no_gpu() -> str | None:
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        return None if n > 0 else "CuPy sees 0 GPUs"
    except Exception as e:                               # ImportError, CUDARuntimeError, ...
        return f"CuPy cannot see a GPU ({type(e).__name__}: {e})"


WHY_NO_GPU = _why_no_gpu()
ON_GPU = WHY_NO_GPU is None
EMULATED = not ON_GPU and os.environ.get("QS_GPU_DRY_RUN") == "1"    # gpu_check.sh --dry-run
pytestmark = [pytest.mark.gpu]
needs_gpu = pytest.mark.skipif(not ON_GPU, reason=str(WHY_NO_GPU))
kernel_test = pytest.mark.skipif(not (ON_GPU or EMULATED),
                                 reason=f"{WHY_NO_GPU} (the emulator runs these kernels in "
                                 "test_stage3_cuda_emulated.py; QS_GPU_DRY_RUN=1 runs them here)")

from bench.testbed.models import BF16_MARGIN, hf_on_bf16_weights, make_model  # noqa: E402
from common.engine import Request                          # noqa: E402
from common.sampling import SamplingParams                 # noqa: E402
from stage3_optimized import kernels, ops                  # noqa: E402
from stage3_optimized.batch import PREFILL_TILE            # noqa: E402
from stage3_optimized.ops import bf16_bits, f32            # noqa: E402
from test_stage2_kernels import paged                      # noqa: E402
from test_stage3_cuda_emulated import (                    # noqa: E402, F401  (emulated, gpu: fixtures)
    assert_bf16_close, bf16_random, check_gemv, check_gemv_prologues, emulated, gpu,
    test_embedding_starts_the_fp32_residual_stream as check_embedding,
    test_rmsnorm_equals_twin as check_rmsnorm,
    test_qk_norm_rope_store_equals_twin as check_qk_norm_rope_store,
    test_sample_degenerate_rows_give_minus_one_not_a_token as check_sample_degenerate,
    test_sample_kernel_equals_twin_on_the_same_uniform_numbers as check_sample,
    test_sample_owner_finds_its_token_where_chunk_start_plus_each_weight_rounds_away
        as check_sample_owner,
    test_swiglu_equals_twin as check_swiglu)
from test_stage3_engine import GREEDY_PROMPTS, engine, run   # noqa: E402


@pytest.fixture
def dev(request):
    """numpy -> a device array: CuPy's on a GPU, the stand-in CuPy of the emulator otherwise
    (which also points kernels.py at the emulated kernels, for this test only)."""
    if ON_GPU:
        import cupy
        return cupy.asarray
    return request.getfixturevalue("gpu")


@pytest.fixture(autouse=True)
def _no_memory_pool_for_the_sanitizer(request):
    """`sanitize` tests allocate every array with its own cudaMalloc: inside CuPy's pool an
    overrun lands in another array of the pool, which memcheck cannot tell from a good access."""
    if not ON_GPU or request.node.get_closest_marker("sanitize") is None:
        yield
        return
    import cupy
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    cupy.cuda.set_allocator(None)
    try:
        yield
    finally:
        cupy.cuda.set_allocator(pool.malloc)


def launched(monkeypatch) -> list[str]:
    """The names of the kernels that kernels.py launches from now on (to prove which one ran)."""
    names, real = [], kernels._kernel
    monkeypatch.setattr(kernels, "_kernel", lambda name: (names.append(name), real(name))[1])
    return names


# ---- prefill: tensor cores against the plain kernel and the twin ----------------------------

# Qwen3-0.6B (16/8, D 128), 8B (32/8), a group of 7 at D 64 (two blocks of 4 heads, the second
# short), one KV head for 6 query heads at D 32. Chunks (cached prefix, count) start mid-page
# (P = 16), most counts are below the 16-token tile, one crosses it.
PREFILL_HEADS = [(16, 8, 128), (32, 8, 128), (14, 2, 64), (6, 1, 32)]
PREFILL_CHUNKS = [(5, 3), (13, 11), (0, 1), (21, 20), (40, 15)]
# the emulator's share: a group of 6 (a short second block of heads), four chunks
if EMULATED:
    PREFILL_HEADS, PREFILL_CHUNKS = [(6, 1, 32)], PREFILL_CHUNKS[:4]


def prefill_case(rng, H, Hkv, D, P, chunks):
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
    return q, k_cache, v_cache, tables, token_seq, positions, tile_start, tile_count


def check_prefill(dev, monkeypatch, H, Hkv, D, chunks, P=16):
    rng = np.random.default_rng(H * 31 + D)
    q, k_cache, v_cache, tables, token_seq, positions, tile_start, tile_count = prefill_case(
        rng, H, Hkv, D, P, chunks
    )
    args = [dev(a) for a in (q, k_cache, v_cache, tables, token_seq, positions)]
    names = launched(monkeypatch)
    tc = kernels.prefill_attention(*args, dev(tile_start), dev(tile_count)).get()
    # (_tc_available's first call compiles it too: the name may come twice)
    assert set(names) == {"prefill_attention_tc"}, f"the tensor-core kernel did not run: {names}"
    plain = kernels.prefill_attention(
        *args, dev(tile_start), dev(tile_count), tensor_cores=False
    ).get()
    assert names[-1] == "prefill_attention"
    expect = ops.prefill_attention(q, k_cache, v_cache, tables, token_seq, positions)
    assert_bf16_close(plain, expect)
    scale = float(np.abs(f32(expect)).max())
    # the tensor cores against the twin, and against the plain kernel they replace
    np.testing.assert_allclose(f32(tc), f32(expect), rtol=2 ** -6, atol=1e-2 * scale)
    np.testing.assert_allclose(f32(tc), f32(plain), rtol=2 ** -6, atol=1e-2 * scale)
    assert float(np.mean(tc == expect)) >= 0.33


@kernel_test
@pytest.mark.parametrize("H,Hkv,D", PREFILL_HEADS)
def test_prefill_tensor_cores_equal_the_plain_kernel_and_the_twin(dev, monkeypatch, H, Hkv, D):
    check_prefill(dev, monkeypatch, H, Hkv, D, PREFILL_CHUNKS)


@kernel_test
def test_tensor_core_prefill_is_available(dev):
    """On a GPU the tensor-core kernel compiles (with QS_REQUIRE_GPU=1 a fallback raises)."""
    assert kernels._tc_available()


# ---- decode: splits of 8 positions and their merge --------------------------------------------

DECODE_HEADS = PREFILL_HEADS if not EMULATED else [(14, 2, 64)]
# one position, one split exactly, one more, 38 splits
DECODE_CTX = [1, 8, 9, 300]


@kernel_test
@pytest.mark.parametrize("H,Hkv,D", DECODE_HEADS)
def test_decode_attention_with_splits_of_8_equals_twin(dev, H, Hkv, D):
    rng = np.random.default_rng(H + D)
    lens = DECODE_CTX if not EMULATED else [1, 8, 9, 40]           # the emulator: 5 splits, not 38
    k32, v32, tables, *_ = paged(rng, lens, Hkv, D, 16)
    k_cache, v_cache = bf16_bits(k32), bf16_bits(v32)
    q = bf16_random(rng, (len(lens), H, D))
    ctx = np.array(lens, np.int32)
    out = kernels.paged_decode_attention(dev(q), dev(k_cache), dev(v_cache), dev(tables), dev(ctx),
                                         split_len=8,
                                         # a grid with empty splits at the end
                                         max_len=max(lens) + 17)
    assert_bf16_close(out.get(), ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx))


# ---- sampling, the fused kernels, the GEMM ----------------------------------------------------

@kernel_test
@pytest.mark.parametrize("V", [50, 4099, 151936] if not EMULATED else [4099])
def test_sample_equals_twin_with_temperature_top_k_and_top_p(dev, V):
    check_sample(dev, V)


@kernel_test
def test_sample_owner_walk_and_degenerate_rows(dev):
    check_sample_owner(dev)
    for t, k, p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9), (1.0, 0, 0.5)]:
        check_sample_degenerate(dev, t, k, p)


@kernel_test
@pytest.mark.parametrize("N,C", [(1, 96), (3, 300), (5, 1024)])
def test_rmsnorm_equals_twin(dev, N, C):
    check_rmsnorm(dev, N, C)


# gemv.cu at Qwen3-0.6B's decode shapes (the fused QKV, the output projection, gate/up, down
# with SwiGLU in front, the lm_head: more rows than the grid's warps), 8B's MLP input (K 12,288,
# two rows: its 48 KB of shared memory), and the emulator's small share
GEMV_SHAPES = ([(1, 1024, 4096), (4, 2048, 1024), (2, 1024, 6144), (3, 3072, 1024),
                (1, 1024, 151936), (2, 12288, 64)] if not EMULATED else [(2, 264, 13)])


@kernel_test
@pytest.mark.parametrize("N,K,M", GEMV_SHAPES)
def test_gemv_projections_equal_twins(dev, N, K, M):
    check_gemv(dev, N, K, M)


@kernel_test
def test_gemv_prologues_give_the_unfused_kernels_bits(dev):
    check_gemv_prologues(dev)


@kernel_test
@pytest.mark.parametrize("H,Hkv,D,norm", [(4, 2, 32, True), (2, 1, 48, True), (16, 8, 128, True),
                                          (14, 2, 64, True), (4, 2, 32, False)])
def test_qk_norm_rope_store_equals_twin(dev, H, Hkv, D, norm):
    check_qk_norm_rope_store(dev, H, Hkv, D, norm)


@kernel_test
def test_swiglu_and_embedding_equal_twins(dev):
    check_swiglu(dev)
    check_embedding(dev)


@needs_gpu
def test_swiglu_with_more_rows_than_grid_y_equals_twin(dev):
    """70,000 tokens: more than grid.y's 65,535 (the rows stride over it). On a GPU only (a dry
    run does not collect it): the emulator checks the grid (test_stage3_cuda_emulated.py)
    without running 70,000 blocks of OS threads."""
    gu = bf16_random(np.random.default_rng(8), (70_000, 2 * 24), 2.0)
    assert_bf16_close(kernels.swiglu(dev(gu)).get(), ops.swiglu(gu))


if EMULATED:
    del test_swiglu_with_more_rows_than_grid_y_equals_twin


@kernel_test
@pytest.mark.parametrize("N,K,M", [(1, 96, 40), (7, 200, 1000), (300, 64, 33)])
def test_bf16_linear_equals_twin(dev, N, K, M):
    rng = np.random.default_rng(N + K)
    x, w = bf16_random(rng, (N, K)), bf16_random(rng, (M, K))
    assert_bf16_close(kernels.linear(dev(x), dev(w)).get(), ops.linear(x, w), min_exact=0.5)
    y = ops.linear(x, w, True)
    np.testing.assert_allclose(kernels.linear(dev(x), dev(w), out_f32=True).get(), y, rtol=1e-4,
                               atol=1e-4 * float(np.abs(y).max()))


# ---- small shapes, for compute-sanitizer (every kernel once) -----------------------------------

@kernel_test
@pytest.mark.sanitize
def test_stage3_attention_kernels_on_small_shapes_for_the_sanitizer(dev, monkeypatch):
    check_prefill(dev, monkeypatch, 6, 2, 32, [(5, 3), (0, 1)])
    rng = np.random.default_rng(9)
    lens = [1, 9, 17]
    k32, v32, tables, *_ = paged(rng, lens, 2, 32, 16)
    q = bf16_random(rng, (3, 6, 32))
    ctx = np.array(lens, np.int32)
    out = kernels.paged_decode_attention(
        dev(q), dev(bf16_bits(k32)), dev(bf16_bits(v32)), dev(tables), dev(ctx), split_len=8
    )
    assert_bf16_close(
        out.get(), ops.paged_decode_attention(q, bf16_bits(k32), bf16_bits(v32), tables, ctx)
    )


@kernel_test
@pytest.mark.sanitize
def test_stage3_other_kernels_on_small_shapes_for_the_sanitizer(dev):
    check_embedding(dev)
    check_rmsnorm(dev, 3, 300)
    check_gemv(dev, 2, 264, 13)
    check_qk_norm_rope_store(dev, 4, 2, 32, True)
    check_swiglu(dev)
    check_sample(dev, 50)
    rng = np.random.default_rng(10)
    x, w = bf16_random(rng, (3, 48)), bf16_random(rng, (20, 48))
    assert_bf16_close(kernels.linear(dev(x), dev(w)).get(), ops.linear(x, w), min_exact=0.5)


# ---- the engine --------------------------------------------------------------------------------

# qwen3 (dense: its decode steps are graph replays), the same with a GQA group of 3 at head
# dim 128 (Qwen3's real head dim; the tensor-core prefill at D 128), and qwen2_moe (biases,
# a shared expert, MoE routing: eager). Few, so the engine step keeps its cap. (Seed 2: the
# first of seeds 0-3 whose greedy tokens stay clear of a near-tie for 5 steps at that shape.)
ENGINE_MODELS = {"qwen3": ("qwen3", {}),
                 "qwen3_g3_d128": ("qwen3", dict(num_attention_heads=6, num_key_value_heads=2,
                                                 head_dim=128, seed=2)),
                 "qwen2_moe": ("qwen2_moe", {})}
# steps before the first near-tie that must agree
MIN_CLEAR = 5


def greedy_reference(folder, prompt, steps):
    """transformers' greedy tokens on the bf16-rounded weights, and how many come before the
    first near-tie (top-2 margin < BF16_MARGIN), where bf16 noise may pick the other token."""
    import torch
    hf = hf_on_bf16_weights(folder)
    ids, expect, margins = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
            expect.append(int(logits.argmax()))
            ids.append(expect[-1])
    clear = next((i for i, m in enumerate(margins) if m < BF16_MARGIN), steps)
    return expect, clear, margins


@needs_gpu
@pytest.mark.parametrize("name", list(ENGINE_MODELS))
def test_engine_on_gpu_equals_transformers_until_a_near_tie(name):
    family, overrides = ENGINE_MODELS[name]
    folder = make_model(family, **overrides)
    steps, prompt = 12, GREEDY_PROMPTS[family]
    expect, clear, margins = greedy_reference(folder, prompt, steps)
    assert clear >= MIN_CLEAR, (
        f"a near-tie after {clear} steps: this case compares too little ({margins})"
    )
    eng = engine(folder, device="cuda")
    got = run(eng, [prompt], steps)["0"]
    assert len(got) == steps and got[:clear] == expect[:clear], (
        f"margins {np.round(margins, 3).tolist()}"
    )
    # dense: its decode steps were graph replays
    if family == "qwen3":
        assert eng.graphs is not None and eng.graphs.error is None and eng.graphs.num_replays > 0


def test_engine_reference_cases_are_clear_of_near_ties_for_five_steps():
    """The same reference on the CPU (transformers alone): each engine case above compares at
    least MIN_CLEAR tokens, so the GPU test cannot pass on a comparison of nothing."""
    for name, (family, overrides) in ENGINE_MODELS.items():
        _, clear, margins = greedy_reference(
            make_model(family, **overrides), GREEDY_PROMPTS[family], MIN_CLEAR
        )
        assert clear >= MIN_CLEAR, (name, margins)


@needs_gpu
def test_engine_cuda_graph_replays_give_the_eager_tokens_on_gpu():
    """Four requests that stay together (bucket 4, no padding), then one alone (bucket 1):
    the same shapes on both paths, so the same tokens; the graphs were captured once per
    bucket and replayed."""
    folder = make_model("qwen3")
    prompts = [list(range(40, 53)), [5, 9, 3, 17], list(range(100, 107)), [300, 301, 302]]

    def go(enforce_eager):
        eng = engine(folder, device="cuda", enforce_eager=enforce_eager, slots=4)
        out = run(eng, prompts, 10)
        out.update(run(eng, [[77, 78, 79]], 10, tag="b"))
        return out, eng

    expect, eager = go(True)
    got, eng = go(False)
    assert eager.graphs is None and eng.graphs is not None
    assert eng.graphs.error is None, eng.graphs.error
    assert sorted(eng.graphs.graphs) == [1, 4] and eng.graphs.num_replays >= 2 * 8
    assert got == expect and all(len(t) == 10 for t in got.values())


@needs_gpu
def test_engine_padded_bucket_on_gpu_keeps_the_real_rows_logits():
    """Three sequences in the bucket of 4: one decode step through the graph path equals
    the eager step's logits within bf16 noise (kept as a tolerance: another bucket size may
    choose another GEMM), and the padding row wrote no KV page."""
    from stage3_optimized.batch import build_batch
    folder = make_model("qwen3")
    eng = engine(folder, device="cuda", slots=4)
    for i, p in enumerate([list(range(40, 53)), [5, 9, 3, 17], list(range(100, 107))]):
        eng.add_request(
            Request(str(i), p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        )
    # the prefill: everybody's first token
    eng.step()
    sched = eng.scheduler.schedule()
    seqs, tokens, batch = build_batch(sched.seqs, sched.num_tokens, eng.page_size)
    assert batch.num_decode == 3 and eng.graphs.can_run(batch)
    k_before = eng.model.cache.k_pool.copy()                    # [L, NB, P, Hkv, D]
    eager = eng.model.forward(*eng.inputs.upload(tokens, batch)[:2]).get()
    k_eager = eng.model.cache.k_pool.copy()
    params = eng._sampling_inputs(seqs)
    eng.graphs.run(tokens, batch, params)                       # bucket 4: warm-up, then capture
    graphed = eng.graphs.run(tokens, batch, params)[0].get()    # the replay
    assert eng.graphs.num_replays == 1 and eng.graphs.error is None
    scale = np.abs(eager).max()
    assert scale > 1
    np.testing.assert_allclose(graphed, eager, rtol=0, atol=0.02 * scale)
    # the three real slots hold this step's K (as the eager step wrote them, up to bf16 noise);
    # every other slot of every layer is as it was before the step: the padding row wrote nothing
    L, NB, P = k_before.shape[:3]
    flat = lambda a: a.reshape(L, NB * P, -1).get()             # noqa: E731  [L, slots, Hkv * D]
    before, after, ref = flat(k_before), flat(eng.model.cache.k_pool), flat(k_eager)
    real = np.zeros(NB * P, bool)
    real[batch.slot_mapping] = True
    np.testing.assert_array_equal(after[:, ~real], before[:, ~real])
    assert (ref[:, real] != before[:, real]).any()              # the step did write its slots
    np.testing.assert_allclose(f32(after[:, real]), f32(ref[:, real]), rtol=2 ** -6, atol=1e-2)


@needs_gpu
def test_engine_graph_replay_makes_one_host_to_device_copy_on_gpu(monkeypatch):
    """Every step stages its inputs with one copy from page-locked memory (StepInputs)."""
    from stage3_optimized.buffers import StepInputs
    uploads = []
    real = StepInputs._copy
    monkeypatch.setattr(StepInputs, "_copy", lambda self, n: (uploads.append(n), real(self, n))[1])
    eng = engine(make_model("qwen3"), device="cuda", slots=2)
    assert eng.inputs.pinned is not None
    got = run(eng, [[5, 9, 3], [40, 41]], 6)
    assert eng.graphs.num_replays > 0 and len(uploads) == eng.num_steps
    assert got == run(engine(make_model("qwen3"), device="cuda", slots=2, enforce_eager=True),
                      [[5, 9, 3], [40, 41]], 6)
