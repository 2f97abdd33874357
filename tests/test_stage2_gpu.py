"""Stage 2 on a GPU: each CUDA kernel equals its numpy twin at awkward shapes, and the
engine with device="cuda" produces transformers' greedy tokens.

Skipped as a whole where CuPy cannot see a GPU (the only skip allowed); on a GPU
machine bench/gpu_check.sh runs this file with QS_REQUIRE_GPU=1, which turns that skip
into a failure (tests/conftest.py). The script runs the tests without "engine" in their
name as its kernel step, those with it as its engine step, and the two marked
`sanitize` (small shapes) once more under compute-sanitizer. Tolerances: float32 kernel vs float32
twin, different summation order and expf: rtol 1e-4, atol 1e-5 (attention), exact
for copies (embedding, store_kvcache).
"""
from __future__ import annotations

import numpy as np
import pytest


def _why_no_gpu() -> str | None:
    """None where CuPy sees a GPU, else why not (the skip's reason)."""
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        return None if n > 0 else "CuPy sees 0 GPUs"
    except Exception as e:                               # ImportError, CUDARuntimeError, ...
        return f"CuPy cannot see a GPU ({type(e).__name__}: {e})"


WHY_NO_GPU = _why_no_gpu()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NO_GPU is not None, reason=str(WHY_NO_GPU))]

from stage2_batched import kernels, ops                    # noqa: E402
from test_stage2_kernels import HEADS, paged                # noqa: E402

ATT_TOL = dict(rtol=1e-4, atol=1e-5)
TOL = dict(rtol=1e-5, atol=1e-6)


def gpu(*arrays):
    import cupy
    return [cupy.asarray(a) for a in arrays]


def host(x):
    return kernels.to_host(x)


@pytest.mark.parametrize("H,Hkv,D", HEADS + [(8, 8, 256), (2, 1, 48)])
@pytest.mark.parametrize(
    "P,lens", [(16, [1]), (16, [1, 16, 17, 40, 3]), (5, [3, 11, 25]), (256, [7, 300, 1])]
)
def test_decode_attention_kernel_equals_twin(H, Hkv, D, P, lens):
    rng = np.random.default_rng(H + P + len(lens))
    k_cache, v_cache, tables, *_ = paged(rng, lens, Hkv, D, P)
    q = rng.standard_normal((len(lens), H, D)).astype(np.float32)
    ctx = np.array(lens, np.int32)
    expect = ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx)
    got = kernels.paged_decode_attention(*gpu(q, k_cache, v_cache, tables, ctx))
    np.testing.assert_allclose(host(got), expect, **ATT_TOL)


@pytest.mark.parametrize("H,Hkv,D", HEADS + [(8, 8, 256), (2, 1, 48)])
@pytest.mark.parametrize("P,chunks", [(16, [(0, 1)]), (16, [(0, 17), (5, 3), (16, 16), (31, 9)]),
                                      (5, [(0, 7), (12, 1), (3, 12)]),
                                      (256, [(0, 300), (250, 13)])])
def test_prefill_attention_kernel_equals_twin(H, Hkv, D, P, chunks):
    rng = np.random.default_rng(H + P + len(chunks))
    lens = [b + n for b, n in chunks]
    k_cache, v_cache, tables, *_ = paged(rng, lens, Hkv, D, P)
    token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(chunks)]).astype(np.int32)
    positions = np.concatenate([np.arange(b, b + n) for b, n in chunks]).astype(np.int32)
    q = rng.standard_normal((len(positions), H, D)).astype(np.float32)
    expect = ops.prefill_attention(q, k_cache, v_cache, tables, token_seq, positions)
    got = kernels.prefill_attention(*gpu(q, k_cache, v_cache, tables, token_seq, positions))
    np.testing.assert_allclose(host(got), expect, **ATT_TOL)


@pytest.mark.parametrize(
    "N,Hkv,D,P", [(1, 1, 32, 16), (37, 2, 32, 16), (20, 8, 128, 5), (300, 8, 128, 256)]
)
def test_store_kvcache_kernel_equals_twin(N, Hkv, D, P):
    rng = np.random.default_rng(N)
    NB = (N + P - 1) // P + 4
    k = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    slots = rng.permutation(NB * P)[:N].astype(np.int32)
    slots[0] = -1
    kc, vc = np.zeros((NB, P, Hkv, D), np.float32), np.zeros((NB, P, Hkv, D), np.float32)
    ops.store_kvcache(k, v, kc, vc, slots)
    kg, vg = gpu(np.zeros_like(kc), np.zeros_like(vc))
    kernels.store_kvcache(*gpu(k, v), kg, vg, *gpu(slots))
    np.testing.assert_array_equal(host(kg), kc)
    np.testing.assert_array_equal(host(vg), vc)


@pytest.mark.parametrize("shape", [(1, 96), (7, 1024), (5, 16, 128), (3, 1, 32), (2, 5000)])
def test_rmsnorm_kernel_equals_twin(shape):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    np.testing.assert_allclose(
        host(kernels.rmsnorm(*gpu(x, w), 1e-6)), ops.rmsnorm(x, w, 1e-6), **TOL
    )


@pytest.mark.parametrize("N,H,D", [(1, 1, 32), (9, 4, 64), (3, 16, 128), (5, 8, 256)])
def test_rope_kernel_equals_twin(N, H, D):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((N, H, D)).astype(np.float32)
    positions = rng.integers(0, 4000, size=N)
    cos, sin = ops.rope_tables(4000, D, 1e6)
    expect = ops.rope(x, cos[positions], sin[positions])
    np.testing.assert_allclose(
        host(kernels.rope(*gpu(x, cos[positions], sin[positions]))), expect, **TOL
    )


@pytest.mark.parametrize("n", [1, 33, 3000])
def test_elementwise_and_embedding_kernels_equal_twins(n):
    rng = np.random.default_rng(n)
    g = rng.standard_normal((n, 7)).astype(np.float32)
    u = rng.standard_normal((n, 7)).astype(np.float32)
    np.testing.assert_allclose(host(kernels.silu_mul(*gpu(g, u))), ops.silu_mul(g, u), **TOL)
    np.testing.assert_array_equal(host(kernels.residual_add(*gpu(g, u))), ops.residual_add(g, u))
    table = rng.standard_normal((100, 96)).astype(np.float32)
    ids = rng.integers(0, 100, size=n).astype(np.int32)
    np.testing.assert_array_equal(
        host(kernels.embedding(*gpu(ids, table))), ops.embedding(ids, table)
    )


# ---- small shapes, for compute-sanitizer (bench/gpu_check.sh runs these under memcheck,
# and the attention ones under racecheck: instrumented launches are slow, so one small
# case per kernel, with a ragged batch and a partial page)

@pytest.fixture(autouse=True)
def _no_memory_pool_for_the_sanitizer(request):
    """`sanitize` tests allocate every array with its own cudaMalloc: inside CuPy's pool an
    overrun lands in another array of the pool, which memcheck cannot tell from a good access."""
    if request.node.get_closest_marker("sanitize") is None:
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


@pytest.mark.sanitize
def test_attention_kernels_on_small_shapes_for_the_sanitizer():
    rng = np.random.default_rng(7)
    H, Hkv, D, P, lens = 4, 2, 64, 16, [1, 17, 5]
    k_cache, v_cache, tables, *_ = paged(rng, lens, Hkv, D, P)
    q = rng.standard_normal((len(lens), H, D)).astype(np.float32)
    ctx = np.array(lens, np.int32)
    got = kernels.paged_decode_attention(*gpu(q, k_cache, v_cache, tables, ctx))
    np.testing.assert_allclose(
        host(got), ops.paged_decode_attention(q, k_cache, v_cache, tables, ctx), **ATT_TOL
    )
    chunks = [(0, 5), (9, 3)]
    lens = [b + n for b, n in chunks]
    k_cache, v_cache, tables, *_ = paged(rng, lens, Hkv, D, P)
    token_seq = np.concatenate([np.full(n, s) for s, (_, n) in enumerate(chunks)]).astype(np.int32)
    positions = np.concatenate([np.arange(b, b + n) for b, n in chunks]).astype(np.int32)
    q = rng.standard_normal((len(positions), H, D)).astype(np.float32)
    got = kernels.prefill_attention(*gpu(q, k_cache, v_cache, tables, token_seq, positions))
    np.testing.assert_allclose(host(got),
                               ops.prefill_attention(q, k_cache, v_cache, tables, token_seq,
                                                     positions),
                               **ATT_TOL)


@pytest.mark.sanitize
def test_other_kernels_on_small_shapes_for_the_sanitizer():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 300)).astype(np.float32)
    w = rng.standard_normal(300).astype(np.float32)
    np.testing.assert_allclose(
        host(kernels.rmsnorm(*gpu(x, w), 1e-6)), ops.rmsnorm(x, w, 1e-6), **TOL
    )
    y = rng.standard_normal((3, 300)).astype(np.float32)
    np.testing.assert_allclose(host(kernels.silu_mul(*gpu(x, y))), ops.silu_mul(x, y), **TOL)
    np.testing.assert_array_equal(host(kernels.residual_add(*gpu(x, x))), ops.residual_add(x, x))
    r = rng.standard_normal((3, 2, 32)).astype(np.float32)
    cos, sin = ops.rope_tables(64, 32, 1e6)
    pos = np.array([0, 5, 63])
    np.testing.assert_allclose(
        host(kernels.rope(*gpu(r, cos[pos], sin[pos]))), ops.rope(r, cos[pos], sin[pos]), **TOL
    )
    table = rng.standard_normal((10, 96)).astype(np.float32)
    ids = np.array([3, 0, 9], np.int32)
    np.testing.assert_array_equal(
        host(kernels.embedding(*gpu(ids, table))), ops.embedding(ids, table)
    )
    slots = np.array([5, -1, 12], np.int32)
    kc, vc = np.zeros((4, 4, 2, 32), np.float32), np.zeros((4, 4, 2, 32), np.float32)
    kg, vg = gpu(kc, vc)
    kernels.store_kvcache(*gpu(r, r), kg, vg, *gpu(slots))
    ops.store_kvcache(r, r, kc, vc, slots)
    np.testing.assert_array_equal(host(kg), kc)


# ---- the whole engine on the GPU ----

@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
def test_engine_on_gpu_equals_transformers(family):
    from test_stage2_engine import LENGTHS, engine, reference, run
    lengths = tuple(LENGTHS) if family == "qwen3" else (1, 17, 40, 129)
    folder, prompts, ref = reference(family, lengths)
    eng = engine(family, device="cuda")
    tokens, _ = run(eng, prompts, arrive_every=2)
    for i in range(len(prompts)):
        assert tokens[str(i)] == ref[i], f"{family}: request {i} differs on the GPU"
    assert eng.num_free_pages() == eng.num_total_pages()


def test_engine_on_gpu_with_preemption_equals_transformers():
    from test_stage2_engine import engine, reference, run
    folder, prompts, ref = reference("qwen3")
    eng = engine(num_pages=40, max_ctx=512, device="cuda")
    tokens, _ = run(eng, prompts, arrive_every=0)
    assert eng.num_preemptions > 0
    for i in range(len(prompts)):
        assert tokens[str(i)] == ref[i]
    assert eng.num_free_pages() == eng.num_total_pages()


def test_second_engine_in_one_process_sizes_its_kv_pool():
    """The first engine's memory goes back to CuPy's pool, not to the driver: the second
    engine must still find room for its pages (stage2_batched/engine.py _free_gpu_bytes)."""
    import gc

    import cupy
    from bench.testbed.models import make_model
    from stage2_batched.engine import LLMEngine
    folder = make_model("qwen3")
    first = LLMEngine(folder, max_ctx=512, device="cuda", progress=False)
    pages_first = first.num_total_pages()
    del first
    gc.collect()
    assert cupy.get_default_memory_pool().total_bytes() > 0
    second = LLMEngine(folder, max_ctx=512, device="cuda", progress=False)
    assert second.num_total_pages() >= 0.9 * pages_first
