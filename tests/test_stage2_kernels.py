"""Stage 2's kernels without a GPU (tests/test_cuda_compile.py compiles every .cu file
with nvcc and NVRTC): every numpy twin (what device="cpu" runs, and what the CUDA kernel is
checked against on a GPU in test_stage2_gpu.py) equals a straightforward reference
at awkward shapes: T=1, ragged batches, lengths that are not a multiple of the page,
one KV head, Qwen3's 16/8 and 32/8 head ratios, pages scattered in the pool."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stage2_batched import kernels, ops

CUDA_DIR = Path(kernels.__file__).parent / "cuda"
CU_FILES = sorted(p.name for p in CUDA_DIR.glob("*.cu"))
TOL = dict(rtol=1e-5, atol=1e-5)          # float32 twin vs float64 reference


def test_every_kernel_has_a_cu_file_with_a_header():
    assert set(kernels.KERNEL_FILES.values()) == set(CU_FILES)
    for name, file in kernels.KERNEL_FILES.items():
        text = (CUDA_DIR / file).read_text()
        assert f'extern "C" __global__ void {name}(' in text
        for part in ("Computes:", "Numpy twin:", "Launch:", "Version history"):
            assert part in text, f"{file}: header lacks {part!r}"


# ---------------------------------------------------------------------------
# paged cache fixtures: contiguous per-sequence K/V scattered over shuffled pages
# ---------------------------------------------------------------------------

def paged(rng, lens: list[int], Hkv: int, D: int, P: int, spare_pages: int = 3):
    """-> (k_cache, v_cache [NB, P, Hkv, D], block_tables [S, max_blocks], dense K, V per
    sequence)"""
    need = [(n + P - 1) // P for n in lens]
    NB = sum(need) + spare_pages
    pages = rng.permutation(NB)                       # sequences get scattered pages
    k_cache = rng.standard_normal((NB, P, Hkv, D)).astype(np.float32)   # garbage outside the tables
    v_cache = rng.standard_normal((NB, P, Hkv, D)).astype(np.float32)
    tables = np.zeros((len(lens), max(need)), dtype=np.int32)
    dense_k, dense_v, at = [], [], 0
    for s, n in enumerate(lens):
        tables[s, :need[s]] = pages[at:at + need[s]]
        at += need[s]
        k = rng.standard_normal((n, Hkv, D)).astype(np.float32)
        v = rng.standard_normal((n, Hkv, D)).astype(np.float32)
        for t in range(n):
            k_cache[tables[s, t // P], t % P] = k[t]
            v_cache[tables[s, t // P], t % P] = v[t]
        dense_k.append(k)
        dense_v.append(v)
    return k_cache, v_cache, tables, dense_k, dense_v


def reference_attention(q, k, v, visible: int):
    """One query token q [H, D] over k, v [>= visible, Hkv, D]: softmax(q.k / sqrt(D)) v,
    float64."""
    H, D = q.shape
    group = H // k.shape[1]
    out = np.zeros((H, D))
    for h in range(H):
        kk = k[:visible, h // group].astype(np.float64)
        scores = kk @ q[h].astype(np.float64) / np.sqrt(D)
        p = np.exp(scores - scores.max())
        out[h] = (p / p.sum()) @ v[:visible, h // group]
    return out


HEADS = [(1, 1, 32), (4, 1, 64), (4, 2, 32), (16, 8, 128), (32, 8, 128)]   # (H, Hkv, D)


@pytest.mark.parametrize("H,Hkv,D", HEADS)
@pytest.mark.parametrize(
    "P,lens", [(16, [1]), (16, [1, 16, 17, 40]), (5, [3, 11, 25]), (256, [7, 300])]
)
def test_paged_decode_attention_twin_equals_dense_attention(H, Hkv, D, P, lens):
    rng = np.random.default_rng(len(lens) * 100 + H + P)
    k_cache, v_cache, tables, K, V = paged(rng, lens, Hkv, D, P)
    q = rng.standard_normal((len(lens), H, D)).astype(np.float32)
    out = ops.paged_decode_attention(q, k_cache, v_cache, tables, np.array(lens, dtype=np.int32))
    for s, n in enumerate(lens):
        np.testing.assert_allclose(out[s], reference_attention(q[s], K[s], V[s], n), **TOL)


@pytest.mark.parametrize("H,Hkv,D", HEADS)
@pytest.mark.parametrize("P,chunks", [
    (16, [(0, 1)]),                                   # T=1 prompt
    (16, [(0, 17), (5, 3), (16, 16), (31, 9)]),       # (cached before, new tokens): chunked prefill
    (5, [(0, 7), (12, 1), (3, 12)]),                  # a page size that divides nothing
])
def test_prefill_attention_twin_equals_causal_dense_attention(H, Hkv, D, P, chunks):
    rng = np.random.default_rng(H * 7 + P + len(chunks))
    lens = [before + new for before, new in chunks]
    k_cache, v_cache, tables, K, V = paged(rng, lens, Hkv, D, P)
    token_seq = np.concatenate([np.full(new, s) for s, (_, new) in enumerate(chunks)])
    token_seq = token_seq.astype(np.int32)
    positions = np.concatenate([np.arange(b, b + n) for b, n in chunks]).astype(np.int32)
    q = rng.standard_normal((len(positions), H, D)).astype(np.float32)
    out = ops.prefill_attention(q, k_cache, v_cache, tables, token_seq, positions)
    for i, (s, p) in enumerate(zip(token_seq, positions)):
        np.testing.assert_allclose(out[i], reference_attention(q[i], K[s], V[s], p + 1), **TOL)


def test_prefill_of_the_whole_prompt_equals_decode_of_its_last_token():
    """The two attention twins agree where they overlap: the last prompt token."""
    rng = np.random.default_rng(5)
    k_cache, v_cache, tables, *_ = paged(rng, [37], 2, 64, 16)
    q = rng.standard_normal((37, 8, 64)).astype(np.float32)
    pre = ops.prefill_attention(
        q, k_cache, v_cache, tables, np.zeros(37, np.int32), np.arange(37, dtype=np.int32)
    )
    dec = ops.paged_decode_attention(q[-1:], k_cache, v_cache, tables, np.array([37], np.int32))
    np.testing.assert_allclose(pre[-1:], dec, **TOL)


@pytest.mark.parametrize("N,Hkv,D,P", [(1, 1, 32, 16), (37, 2, 32, 16), (20, 8, 128, 5)])
def test_store_kvcache_twin_writes_only_the_mapped_slots(N, Hkv, D, P):
    rng = np.random.default_rng(N)
    NB = (N + P - 1) // P + 4
    k_cache = np.zeros((NB, P, Hkv, D), np.float32)
    v_cache = np.zeros((NB, P, Hkv, D), np.float32)
    k = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((N, Hkv, D)).astype(np.float32)
    slots = rng.permutation(NB * P)[:N].astype(np.int32)
    slots[0] = -1                                             # a token with no slot is skipped
    ops.store_kvcache(k, v, k_cache, v_cache, slots)
    expect_k = np.zeros_like(k_cache)
    expect_v = np.zeros_like(v_cache)
    for n, slot in enumerate(slots):
        if slot >= 0:
            expect_k[slot // P, slot % P] = k[n]
            expect_v[slot // P, slot % P] = v[n]
    np.testing.assert_array_equal(k_cache, expect_k)
    np.testing.assert_array_equal(v_cache, expect_v)


@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (5, 16, 128), (3, 1, 32)])
def test_rmsnorm_twin_equals_formula(shape):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    x64 = x.astype(np.float64)
    expect = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(ops.rmsnorm(x, w, 1e-6), expect, **TOL)


@pytest.mark.parametrize("N,H,D", [(1, 1, 32), (9, 4, 64), (3, 16, 128)])
def test_rope_twin_rotates_each_token_by_its_own_position(N, H, D):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((N, H, D)).astype(np.float32)
    positions = rng.integers(0, 1000, size=N)
    cos, sin = ops.rope_tables(1000, D, 1e6)
    out = ops.rope(x, cos[positions], sin[positions])
    half = D // 2
    for n, p in enumerate(positions):
        ang = p * (1e6 ** (-np.arange(half) * 2.0 / D))
        for h in range(H):
            a, b = x[n, h, :half], x[n, h, half:]
            expect = np.concatenate(
                [a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)]
            )
            np.testing.assert_allclose(out[n, h], expect, rtol=1e-4, atol=1e-4)


def test_small_twins_equal_their_formulas():
    rng = np.random.default_rng(3)
    table = rng.standard_normal((50, 24)).astype(np.float32)
    ids = np.array([3, 0, 49, 3], dtype=np.int32)
    np.testing.assert_array_equal(ops.embedding(ids, table), np.stack([table[i] for i in ids]))
    g = rng.standard_normal((5, 33)).astype(np.float32)
    u = rng.standard_normal((5, 33)).astype(np.float32)
    np.testing.assert_allclose(
        ops.silu_mul(g, u), g / (1 + np.exp(-g.astype(np.float64))) * u, **TOL
    )
    np.testing.assert_array_equal(ops.residual_add(g, u), g + u)


def test_kernels_dispatch_numpy_arrays_to_the_twins():
    """device="cpu": kernels.f(numpy arrays) is exactly ops.f."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 4, 32)).astype(np.float32)
    w = rng.standard_normal(32).astype(np.float32)
    np.testing.assert_array_equal(kernels.rmsnorm(x, w, 1e-6), ops.rmsnorm(x, w, 1e-6))
    k_cache, v_cache, tables, *_ = paged(rng, [9, 20], 2, 32, 16)
    lens = np.array([9, 20], np.int32)
    np.testing.assert_array_equal(
        kernels.paged_decode_attention(x[:2], k_cache, v_cache, tables, lens),
        ops.paged_decode_attention(x[:2], k_cache, v_cache, tables, lens),
    )


def test_twins_stage2_does_not_change_are_stage1_ops_as_parsed_code():
    """STYLE 1: what stage 2 does not claim to change stays stage 1's, line for line
    (compared as parsed code, so comments may differ); attention is what changes."""
    import ast

    root = Path(kernels.__file__).resolve().parent.parent

    def functions(path: Path) -> dict[str, str]:
        tree = ast.parse(path.read_text())
        return {n.name: ast.dump(n) for n in tree.body if isinstance(n, ast.FunctionDef)}

    one = functions(root / "stage1_cpu" / "ops.py")
    two = functions(root / "stage2_batched" / "ops.py")
    for name in ("rmsnorm", "rope_tables", "rope", "softmax", "route"):   # route: K.route's twin
        assert two[name] == one[name], f"ops.{name} differs from stage 1's"
    # stage 1 multiplies gate and up as one fused matrix, so its silu_mul takes [T, 2F];
    # stage 2 keeps them apart (its silu_mul.cu takes gate and up)
    assert "gate_up" in one["silu_mul"] and "gate_up" not in two["silu_mul"]
    assert "attention" in one and "attention" not in two
    assert {"paged_decode_attention", "prefill_attention", "store_kvcache"} <= set(two)
