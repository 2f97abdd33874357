"""Stage-3 exercises, in course order: docs/exercises.md.

As in stage2.py: the Python checks compare the student's copy with the installed
package's code and with what the docstrings promise; the .cu checks run the workspace's
kernel in the g++ CUDA emulator (stage2.emulator(), from the checkout) and compare it with
its numpy twin in stage3_optimized/ops.py. bf16 outputs are compared as
tests/test_stage3_cuda_emulated.py compares them: within 2 bf16 steps, and mostly
bit-identical.

The tensor-core kernel runs in the emulator through the fragment shim of
tests/test_stage3_cuda_emulated.py (FRAGMENT_SHIM, read from that file, not copied): CPU
versions of the five fragment operations the kernel defines in PTX, and only those —
fill_zero(FragC&), load_a_row(FragA&, p, ld), load_b<COL>(FragB&, p, ld),
mma<COL>(FragC&, FragA, FragB) and store_c_row(float*, FragC, ld).
"""
from __future__ import annotations

import ast

import numpy as np

from common.engine import Request
from common.sampling import SamplingParams
from stage3_optimized import cuda_graphs, ops

from .base import REPO, CheckFailed, Exercise, Workspace, assert_close, assert_equal, require
from .stage2 import build, dev, emulator, launches, paged


def _bf16_close(name: str, got, want, axes_names, hint: str = "", min_exact: float = 0.9,
                rtol: float = 2 ** -7, atol_of_scale: float = 1e-3, mistakes=(),
                nan_hint: str = "") -> None:
    """Two bf16 bit arrays: within rtol (2 bf16 steps) + atol_of_scale x max |want|, and at least
    min_exact of them bit-identical (a kernel that computes something merely similar is not).
    mistakes: (words, float result) as assert_close's; nan_hint replaces the hint when the
    kernel wrote NaN where the twin has none."""
    got, want = np.asarray(got).view(np.ndarray), np.asarray(want).view(np.ndarray)
    scale = float(np.abs(ops.f32(want)).max())
    if nan_hint and np.isnan(ops.f32(got)).any() and not np.isnan(ops.f32(want)).any():
        hint = nan_hint
    assert_close(name, ops.f32(got), ops.f32(want), atol=atol_of_scale * scale, rtol=rtol,
                 axes_names=axes_names, hint=hint, mistakes=mistakes)
    exact = float(np.mean(got == want))
    require(exact >= min_exact, f"{name}: every value is close, but only {exact:.0%} are the same "
                                f"bf16 bits as the twin's (expected at least {min_exact:.0%}): "
                                "compute in fp32 and round once at the end"
                                f"{'; ' + hint if hint else ''}")


class _Bf16Pointers:
    """The emulator's stand-in CuPy takes `unsigned short*` arguments as uint16 arrays while
    this is active (tests/test_stage3_cuda_emulated.py does the same with monkeypatch)."""

    def __enter__(self):
        self.table = emulator().NP_POINTEES
        self.added = "unsigned short" not in self.table
        self.table.setdefault("unsigned short", np.uint16)

    def __exit__(self, *exc):
        if self.added:
            self.table.pop("unsigned short", None)


def fragment_shim() -> str:
    """FRAGMENT_SHIM of tests/test_stage3_cuda_emulated.py, read from the checkout."""
    path = REPO / "tests" / "test_stage3_cuda_emulated.py"
    if not path.is_file():
        raise CheckFailed("this check runs the tensor-core kernel through the fragment shim of "
                          f"{path}, which is part of the repository, not of an installed package: "
                          "run it from a checkout")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FRAGMENT_SHIM"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise CheckFailed(f"{path} defines no FRAGMENT_SHIM")


# ---------------------------------------------------------------------------
# 3.1 the chained prefix-cache key with its collision guard (find_cached)
# ---------------------------------------------------------------------------

def _filled(mod, bm, name: str, ids: list[int], arrival: int):
    """A sequence with ids, its pages allocated, computed and registered in the prefix cache."""
    seq = mod.Sequence.from_request(Request(name, list(ids), SamplingParams(max_tokens=4)), arrival)
    bm.allocate(seq, len(ids))
    seq.num_computed = len(ids)
    bm.register(seq)
    return seq


def _probe(mod, name: str, ids: list[int]):
    return mod.Sequence.from_request(Request(name, list(ids), SamplingParams(max_tokens=4)), 9)


def _expect_found(bm, seq, want_pages: list[int], want_keys: list, why: str) -> None:
    state = (list(bm.free), list(bm.cached_free), list(bm.ref_count), dict(bm.page_of))
    pages, keys = bm.find_cached(seq)
    what = f"find_cached({seq.id}, ids {seq.token_ids}) with P = {bm.page_size}"
    require(list(pages) == want_pages,
            f"{what}: expected the pages {want_pages}, got {list(pages)} ({why})")
    require(len(keys) == len(want_keys) and all(k is w for k, w in zip(keys, want_keys)),
            f"{what}: the pages are right, but the keys must be the registered PageKey objects of "
            "those pages (bm.key_of[page]), the same objects, in order")
    require(state == (list(bm.free), list(bm.cached_free), list(bm.ref_count), dict(bm.page_of)),
            f"{what}: find_cached changed the block manager; it only looks (admit takes the pages)")


def check_prefix_key(ws: Workspace) -> None:
    mod = ws.module("stage3_optimized/block_manager.py")
    P = 4
    bm = mod.BlockManager(16, P)
    # 13 tokens: 3 full pages, one token after
    a_ids = list(range(100, 113))
    a = _filled(mod, bm, "a", a_ids, 0)
    pa, ka = list(a.block_table), list(a.page_keys)
    _expect_found(bm, _probe(mod, "b", a_ids[:8] + [7, 8, 9, 10, 11]), pa[:2], ka[:2],
                  "b shares a's first two pages; the key of page i is hash(key of page i - 1, its "
                  "ids): a key that ignores the parent finds page 0 only")
    _expect_found(bm, _probe(mod, "c", a_ids), pa[:3], ka[:3],
                  "all three of a's full pages; the 13th token is computed again")
    _expect_found(bm, _probe(mod, "d", a_ids[:12]), pa[:2], ka[:2],
                  "12 tokens are 3 full pages, but the page of the last token is never taken: at "
                  "least one token must be computed for its logits")
    _expect_found(bm, _probe(mod, "e", [1, 2, 3, 4] + a_ids[4:13]), [], [],
                  "page 0 differs, so page 1 (the same ids as a's page 1, after another prefix) "
                  "is not a's page 1: the walk stops at the first miss")
    _expect_found(bm, _probe(mod, "f", a_ids[:3]), [], [],
                  "fewer tokens than a page: nothing to share")

    # the collision guard: every key hashes alike
    bm = mod.BlockManager(16, P, hash_fn=lambda parent, ids: b"one hash for every page")
    # page 1 collides with page 0: unregistered
    g = _filled(mod, bm, "g", [5, 6, 7, 8, 5, 6, 7, 8, 1, 2], 0)
    pg, kg = list(g.block_table), list(g.page_keys)
    _expect_found(bm, _probe(mod, "h", [9, 9, 9, 9, 3]), [], [],
                  "with a colliding hash, the page found under h's key holds other ids: a found "
                  "page must hold the same P ids (key.ids == chunk), or it is a collision")
    _expect_found(bm, _probe(mod, "i", [5, 6, 7, 8, 5, 6, 7, 8, 3]), pg[:1], kg[:1],
                  "page 1 of i has the same ids as the registered page 0, but after another "
                  "prefix: a found page must also have the very same parent (key.parent is "
                  "parent, the object itself)")


# ---------------------------------------------------------------------------
# 3.2 the split-KV merge (merge_attention in decode_attention.cu)
# ---------------------------------------------------------------------------

def check_split_merge(ws: Workspace) -> None:
    kernels = build(ws, "stage3_optimized/cuda/decode_attention.cu")
    merge = kernels["merge_attention"]
    rng = np.random.default_rng(32)
    # context lengths in one split, across several, and one split past some sequences' ends
    for H, Hkv, D, P, lens, split in [(4, 2, 32, 4, [3, 17, 40], 8), (2, 1, 48, 16, [1, 70], 16)]:
        k32, v32, tables = paged(rng, lens, Hkv, D, P)
        kc, vc = ops.bf16_bits(k32), ops.bf16_bits(v32 * 2)
        # peaked: m differs by split
        q = ops.bf16_bits(rng.standard_normal((len(lens), H, D)).astype(np.float32) * 3)
        ctx = np.array(lens, np.int32)
        S, splits = len(lens), (max(lens) + split - 1) // split
        part_out, part_ml = ops.decode_attention_splits(q, kc, vc, tables, ctx, split, splits)
        used = np.arange(splits)[None, :] < ((ctx + split - 1) // split)[:, None]     # [S, splits]
        # the splits past a context are never written by kernel 1 (cupy.empty): garbage here, an m
        # far above the real ones (exp(m_j - M) underflows to 0 if M takes it) and NaN sums
        po, pm = part_out.copy(), part_ml.copy()
        for s, j in np.argwhere(~used):
            po[s, :, j] = np.nan
            pm[s, :, j] = (1e4, np.nan)
        out = dev(np.zeros((S, H, D), np.uint16))
        with _Bf16Pointers(), launches("merge_attention"):
            merge((S * H,), (32,),
                  (dev(po), dev(pm), dev(ctx), out, np.int32(H), np.int32(D), np.int32(split),
                                    np.int32(splits)))
        # the merge in float64 over the used splits, as two mistakes do it
        on = used[:, None, :]                                                   # [S, 1, splits]
        m = np.where(on, part_ml[..., 0], -np.inf).astype(np.float64)         # [S, H, splits]
        l = np.where(on, part_ml[..., 1], 0.0).astype(np.float64)
        e = np.exp(m - m.max(-1, keepdims=True))                                # exp(m_j - M)
        acc = np.einsum("shj,shjd->shd", e, part_out.astype(np.float64))      # sum_j acc_j e_j
        mistakes = [("the sum of l must be rescaled like the outputs: l_all = sum_j l_j "
                     "exp(m_j - M)", acc / l.sum(-1, keepdims=True)),
                    ("the merged output is not divided by l_all, the rescaled sum of the l_j", acc)]
        _bf16_close(f"merge_attention (H = {H}, D = {D}, context lengths {lens}, splits of "
                    f"{split}: {[(int(n) + split - 1) // split for n in lens]} used of {splits})",
                    out.get(), ops.merge_attention(part_out, part_ml), ("sequence", "head", "dim"),
                    mistakes=mistakes, nan_hint="NaN: M or the sums took splits past the context, "
                                                "which hold garbage: only the splits j < "
                                                "ceil(ctx / split_len) count",
                    hint="M = max of the used splits' m; out = sum_j acc_j exp(m_j - M) / sum_j "
                         "l_j exp(m_j - M), over the splits j < ceil(ctx / split_len) only (the "
                         "others hold garbage)")


# ---------------------------------------------------------------------------
# 3.3 the online-softmax tile of the tensor-core prefill (prefill_attention_tc.cu)
# ---------------------------------------------------------------------------

def _prefill_np(q, kc, vc, tables, token_seq, seen_until, scaled: bool = True,
                tile: int = 1) -> np.ndarray:
    """Prefill attention in float64 as a mistake computes it: token n sees positions
    0 .. seen_until[n] of its sequence, and keys of zeros after them up to a multiple of
    `tile` keys (what an unmasked tile holds past its last position), its scores scaled by
    1/sqrt(D) or not."""
    N, H, D = q.shape
    P, Hkv = kc.shape[1], kc.shape[2]
    out = np.empty(q.shape)
    for n in range(N):
        t = np.arange(int(seen_until[n]) + 1)
        pages, zeros = tables[token_seq[n], t // P], np.zeros(((-t.size) % tile, Hkv, D))
        k = np.concatenate([ops.f32(kc[pages, t % P]).astype(np.float64), zeros])
        v = np.concatenate([ops.f32(vc[pages, t % P]).astype(np.float64), zeros])
        for h in range(H):
            score = k[:, h // (H // Hkv)] @ ops.f32(q[n, h]) * (1 / np.sqrt(D) if scaled else 1.0)
            e = np.exp(score - score.max())
            out[n, h] = e @ v[:, h // (H // Hkv)] / e.sum()
    return out


def check_tc_tile(ws: Workspace) -> None:
    kernel = build(ws, "stage3_optimized/cuda/prefill_attention_tc.cu",
                   prefix=fragment_shim())["prefill_attention_tc"]
    rng = np.random.default_rng(33)
    WARPS = 4
    # (H, Hkv, D, P, chunks (start position, tokens) per sequence): 17 + 4 tokens of two
    # sequences (the second after 20 cached positions: two key tiles, the rescale matters),
    # then a GQA group of 6 (two blocks of up to 4 heads, the second short) with D = 16
    for H, Hkv, D, P, chunks in [(4, 2, 32, 4, [(0, 17), (20, 4)]), (6, 1, 16, 16, [(0, 5)])]:
        lens = [b + n for b, n in chunks]
        k32, v32, tables = paged(rng, lens, Hkv, D, P)
        kc, vc = ops.bf16_bits(k32), ops.bf16_bits(v32)
        token_seq = np.concatenate([np.full(n, s)
                                    for s, (_, n) in enumerate(chunks)]).astype(np.int32)
        positions = np.concatenate([np.arange(b, b + n) for b, n in chunks]).astype(np.int32)
        N = len(positions)
        q = ops.bf16_bits(rng.standard_normal((N, H, D)).astype(np.float32) * 2)
        # tiles of at most 16 consecutive tokens of one sequence (what batch.py makes)
        starts, counts, at = [], [], 0
        for _, n in chunks:
            for t in range(0, n, 16):
                starts.append(at + t)
                counts.append(min(16, n - t))
            at += n
        G = H // Hkv
        tile_end = np.empty(N, np.int32)                    # the last position of token n's tile
        for a, c in zip(starts, counts):
            tile_end[a:a + c] = positions[a + c - 1]
        args = (q, kc, vc, tables, token_seq)
        mistakes = [("the scores were not scaled by 1/sqrt(D)",
                     _prefill_np(*args, positions, scaled=False)),
                    ("a row sees keys after its own position: mask every key t > my_pos to -inf",
                     _prefill_np(*args, tile_end, tile=16))]
        out = dev(np.zeros((N, H, D), np.uint16))
        with _Bf16Pointers(), launches("prefill_attention_tc"):
            kernel((len(starts), Hkv * ((G + WARPS - 1) // WARPS)), (32 * min(G, WARPS),),
                   (dev(q), dev(kc), dev(vc), dev(tables), dev(token_seq), dev(positions),
                    dev(np.array(starts, np.int32)), dev(np.array(counts, np.int32)), out,
                    np.int32(H), np.int32(Hkv), np.int32(D), np.int32(P),
                    np.int32(tables.shape[1]), np.float32(1 / np.sqrt(D))))
        # the twin keeps the probabilities in fp32, the kernel rounds P to bf16 for the tensor
        # cores: as in tests/test_stage3_lessons.py, 2^-6 relative, and a third bit-identical
        want = ops.prefill_attention(q, kc, vc, tables, token_seq, positions)
        hint = ("per key tile: S = Q K^T, mask keys after the row's position (t <= my_pos), "
                "m_new = max(m, tile max), rescale l and every o[kk][j] by exp(m - m_new), add P V")
        # which tokens are wrong: only those whose keys span several tiles of 16 is the rescale
        err = np.abs(ops.f32(out.get()) - ops.f32(want)).max(axis=(1, 2))        # [N]
        wrong = err > 2 ** -6 * np.abs(ops.f32(want)).max()
        if wrong.any() and (positions[wrong] >= 16).all() and not wrong[positions < 16].any():
            hint = ("the rows whose keys span several key tiles are wrong, the others right: when "
                    "a tile raises the max, rescale l and every o[kk][j] by exp(m - m_new)")
        _bf16_close(f"prefill_attention_tc (H = {H}, Hkv = {Hkv}, D = {D}, chunks (start, tokens) "
                    f"{chunks}; token n is at position {positions.tolist()}[n])", out.get(), want,
                    ("token", "head", "dim"), hint=hint, mistakes=mistakes, min_exact=0.33,
                    rtol=2 ** -6, atol_of_scale=1e-2)


# ---------------------------------------------------------------------------
# 3.4 RMSNorm of the residual stream (rmsnorm.cu)
# ---------------------------------------------------------------------------

def check_rmsnorm(ws: Workspace) -> None:
    kernel = build(ws, "stage3_optimized/cuda/rmsnorm.cu")["rmsnorm"]
    rng = np.random.default_rng(34)
    # C over the block of 256 threads, and under it
    for N, C in [(3, 300), (2, 96)]:
        w = ops.bf16_bits(rng.standard_normal(C).astype(np.float32))
        residual = (rng.standard_normal((N, C)) * 5).astype(np.float32)
        what = f"rmsnorm (N = {N}, C = {C})"
        res = dev(residual.copy())
        h = dev(np.zeros((N, C), np.uint16))
        with _Bf16Pointers(), launches("rmsnorm"):
            kernel((N,), (256,), (res, dev(w), h, np.int32(C), np.float32(1e-6)))
        assert_equal(f"{what}: the residual stream (read, never written)", res.get(), residual,
                     ("row", "channel"),
                     hint="the kernel reads the residual and writes only h")
        r64, w64 = residual.astype(np.float64), ops.f32(w).astype(np.float64)
        ss = (r64 * r64).sum(-1, keepdims=True)
        first = (r64[:, :256] ** 2).sum(-1, keepdims=True)        # a block's first stride only
        mistakes = [("divided by sqrt(sum of r^2): divide the sum of squares by C, the row's "
                     "length, for the mean", r64 / np.sqrt(ss + 1e-6) * w64),
                    ("the normalised row is not scaled: multiply channel c by its weight w[c]",
                     r64 / np.sqrt(ss / C + 1e-6)),
                    ("the sum of squares skipped channels 256 and up: a block of 256 threads "
                     "strides over every channel of the row (c += BLOCK)",
                     r64 / np.sqrt(first / C + 1e-6) * w64)]
        _bf16_close(f"{what}: h", h.get(), ops.rmsnorm_bf16(residual, w, 1e-6), ("row", "channel"),
                    hint="h = bf16(r / sqrt(mean(r^2) + eps) * w), the mean over all C values of "
                         "the row", mistakes=mistakes)


# ---------------------------------------------------------------------------
# 3.5 CUDA-graph batch padding (pad_decode_batch)
# ---------------------------------------------------------------------------

PAD_HINTS = {
    "tokens": "padding rows feed token 0",
    "num_decode": "every row of the bucket is a decode row",
    "positions": "a padding row sits at position 0",
    "slot_mapping": "a padding row has slot -1: the KV store skips it, it writes no page",
    "token_seq": "row i reads its own block table row: 0 .. size - 1",
    "block_tables": "the tables are max_blocks wide (the graph's shape); "
                    "padding rows and columns are page 0",
    "context_lens": "a padding row reads one position (context length 1), "
                    "so its numbers stay finite",
    "query_start": "one token per row: 0, 1, .., size",
    "logits_rows": "every row gets logits: 0 .. size - 1 (the caller keeps the first b)",
    "tile_start": "a decode batch has no prefill tiles: empty int32",
    "tile_count": "a decode batch has no prefill tiles: empty int32",
    "max_context": "the model's max_ctx: the decode grid the graph was captured with",
}


def _decode_batch(BatchInfo, rng, b: int, P: int):
    lens = rng.integers(1, 30, size=b)
    width = int(max((lens + P - 1) // P))
    tables = np.zeros((b, width), np.int32)
    for s, n in enumerate(lens):
        tables[s, :(n + P - 1) // P] = rng.choice(np.arange(1, 60), size=(n + P - 1) // P,
                                                  replace=False)
    pos = (lens - 1).astype(np.int32)
    slots = (tables[np.arange(b), pos // P] * P + pos % P).astype(np.int32)
    batch = BatchInfo(num_decode=b, positions=pos, slot_mapping=slots,
                      token_seq=np.arange(b, dtype=np.int32),
                      block_tables=tables, context_lens=lens.astype(np.int32),
                      query_start=np.arange(b + 1, dtype=np.int32),
                      logits_rows=np.arange(b, dtype=np.int32),
                      tile_start=np.zeros(0, np.int32), tile_count=np.zeros(0, np.int32),
                      max_context=int(lens.max()))
    return rng.integers(3, 200, size=b).astype(np.int32), batch


def check_graph_padding(ws: Workspace) -> None:
    mod = ws.module("stage3_optimized/cuda_graphs.py")
    P, max_blocks, max_ctx = 4, 9, 36
    for b, size in [(3, 4), (5, 8), (1, 1), (16, 16)]:
        seed = 35 + b
        tokens, batch = _decode_batch(mod.BatchInfo, np.random.default_rng(seed), b, P)
        tokens_r, batch_r = _decode_batch(cuda_graphs.BatchInfo, np.random.default_rng(seed), b, P)
        what = (f"pad_decode_batch({b} sequences -> the bucket of {size}, "
                f"max_blocks {max_blocks}, max_context {max_ctx})")
        got = mod.pad_decode_batch(tokens, batch, size, max_blocks, max_ctx)
        want = cuda_graphs.pad_decode_batch(tokens_r, batch_r, size, max_blocks, max_ctx)
        require(isinstance(got, tuple) and len(got) == 2,
                f"{what}: returns (tokens [size], BatchInfo), got {type(got)}")
        gt, gb = got
        assert_equal(f"{what}: tokens", gt, want[0], ("row",), hint=PAD_HINTS["tokens"])
        require(np.asarray(gt).dtype == np.int32,
                f"{what}: tokens are {np.asarray(gt).dtype}, expected int32")
        for name, hint in PAD_HINTS.items():
            if name == "tokens":
                continue
            g, w = getattr(gb, name), getattr(want[1], name)
            if isinstance(w, np.ndarray):
                axes = ("row", "column") if name == "block_tables" else ("row",)
                assert_equal(f"{what}: {name}", g, w, axes, hint=hint)
                require(np.asarray(g).dtype == np.int32,
                        f"{what}: {name} is {np.asarray(g).dtype}, expected int32 "
                        "(the kernels take int*)")
            else:
                require(g == w, f"{what}: {name} is {g!r}, expected {w!r} ({hint})")


EXERCISES: list[Exercise] = [
    Exercise(id="3.1", title="the chained prefix-cache key and its collision guard",
             section="docs/stage3.md#2-automatic-prefix-caching", difficulty="medium",
             file="stage3_optimized/block_manager.py", check=check_prefix_key),
    Exercise(id="3.2", title="the split-KV merge of flash-decoding",
             section="docs/stage3.md"
                     "#10-decode-attention-shared-across-the-gqa-group-split-over-the-context",
             difficulty="medium", file="stage3_optimized/cuda/decode_attention.cu",
             check=check_split_merge),
    Exercise(id="3.3", title="the online-softmax tile of the tensor-core prefill",
             section="docs/stage3.md#11-prefill-attention-on-tensor-cores-flashattention-2-style",
             difficulty="hard", file="stage3_optimized/cuda/prefill_attention_tc.cu",
             check=check_tc_tile),
    Exercise(id="3.4", title="RMSNorm of the residual stream",
             section="docs/stage3.md#16-one-kernel-per-projection-for-a-decode-batch-gemvcu",
             difficulty="medium", file="stage3_optimized/cuda/rmsnorm.cu", check=check_rmsnorm),
    Exercise(id="3.5", title="CUDA-graph batch padding",
             section="docs/stage3.md#17-decode-steps-as-cuda-graphs",
             difficulty="easy", file="stage3_optimized/cuda_graphs.py", check=check_graph_padding),
]
