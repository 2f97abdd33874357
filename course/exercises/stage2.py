"""Stage-2 exercises, in course order: docs/exercises.md.

The Python checks import the student's copy (ws.module) and compare it with the
installed package's own code: the scheduler is run side by side with the reference
one, step by step. The .cu checks compile the workspace's kernel under the g++ CUDA
emulator of bench/testbed/cuda_emulator.py (one OS thread per CUDA thread, blocks in a shuffled
order, poisoned shared memory, checked barriers and shuffles, a race detector between
blocks), launch it with the grid its header documents, and compare it with its numpy
twin in stage2_batched/ops.py, as tests/test_stage2_cuda_emulated.py does.

The emulator is the tests' and the benchmarks' (bench/testbed/), and the course imports nothing
of bench/: it is loaded by path from the copy the exercises come from (`emulator()`), and a
check run from a copy without it fails with a message that says so.
"""
from __future__ import annotations

import contextlib
import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from common.engine import Request
from common.sampling import SamplingParams
from stage2_batched import ops, scheduler

from .base import REPO, CheckFailed, Exercise, Workspace, assert_close, assert_equal, require


# ---------------------------------------------------------------------------
# the emulator, from the checkout
# ---------------------------------------------------------------------------

def emulator():
    """bench/testbed/cuda_emulator.py of the checkout, loaded under the name the tests import it by
    (with its helper cuda_sources); the same module when they already did, so one process
    compiles each source once (it also keeps a cache of built kernels on disk)."""
    package, testbed = "bench.testbed", REPO / "bench" / "testbed"
    if f"{package}.cuda_emulator" in sys.modules:
        return sys.modules[f"{package}.cuda_emulator"]
    if not (testbed / "cuda_emulator.py").is_file() or not (testbed / "cuda_sources.py").is_file():
        raise CheckFailed(f"this check runs the .cu file in the CUDA emulator, "
                          f"bench/testbed/cuda_emulator.py, and {testbed} has none: run it from a "
                          f"checkout (git clone the project; pip install -e '.[test]')")
    if shutil.which("g++") is None:
        raise CheckFailed("this check compiles the .cu file with g++ (C++20) under the CUDA emulator, and g++ "
                          "is not installed: install it (Debian/Ubuntu: apt install g++), then check again")
    for short in ("cuda_sources", "cuda_emulator"):      # the helper first: the emulator imports it
        name = f"{package}.{short}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, testbed / f"{short}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[name]
                raise
    return sys.modules[f"{package}.cuda_emulator"]


def build(ws: Workspace, rel: str, prefix: str = "") -> dict:
    """Compile the workspace's copy of the .cu file rel under the emulator (with `prefix`, C++
    code put in front of it, e.g. the tensor-core fragment shim) -> kernel name -> kernel.
    A compile error is a CheckFailed with g++'s first lines."""
    emu = emulator()
    src = ws.path(rel)
    if not src.is_file():
        raise CheckFailed(f"{src} is missing: make the workspace with `python -m course.exercises start`")
    # a new folder per build: a library loaded once stays loaded under its path (dlopen), so a
    # second build of an edited file in one process must not reuse the first one's path
    builds = ws.root / ".emulator-build"
    builds.mkdir(exist_ok=True)
    for old in builds.iterdir():                       # earlier checks' builds (loaded ones stay mapped)
        shutil.rmtree(old, ignore_errors=True)
    build_dir = Path(tempfile.mkdtemp(dir=builds))
    if prefix:
        shimmed = build_dir / "shimmed" / src.name
        shimmed.parent.mkdir(exist_ok=True)
        shimmed.write_text(prefix + src.read_text())
        src = shimmed
    try:
        return emu.build([src], build_dir)
    except emu.EmulatorError as e:
        lines = str(e).strip().split("\n")
        raise CheckFailed(f"{rel} does not compile (g++ under the CUDA emulator; the first lines):\n"
                          + "\n".join(lines[:25])) from None


@contextlib.contextmanager
def launches(what: str):
    """A launch the emulator refuses (a race, a barrier not every thread reaches, a shuffle
    outside its mask, a deadlock, a launch over the limits) is a CheckFailed that says which."""
    emu = emulator()
    try:
        yield
    except emu.EmulatorError as e:
        raise CheckFailed(f"{what}: the emulator stopped the kernel: {e}") from None


def dev(a):
    return emulator().dev(a)


def paged(rng, lens, Hkv: int, D: int, P: int, spare: int = 3):
    """A paged cache holding sequences of lens positions on scattered pages, random values
    elsewhere (a kernel that reads a page outside its table reads garbage):
    -> k_cache, v_cache [NB, P, Hkv, D] float32, block_tables [S, max_blocks] int32."""
    need = [(n + P - 1) // P for n in lens]
    NB = sum(need) + spare
    pages = rng.permutation(NB)
    k_cache = rng.standard_normal((NB, P, Hkv, D)).astype(np.float32)
    v_cache = rng.standard_normal((NB, P, Hkv, D)).astype(np.float32)
    tables = np.zeros((len(lens), max(need)), np.int32)
    at = 0
    for s, n in enumerate(need):
        tables[s, :n] = pages[at:at + n]
        at += n
    return k_cache, v_cache, tables


# ---------------------------------------------------------------------------
# 2.1 the KV store through the slot mapping (store_kvcache.cu)
# ---------------------------------------------------------------------------

def check_store_kvcache(ws: Workspace) -> None:
    kernel = build(ws, "stage2_batched/cuda/store_kvcache.cu")["store_kvcache"]
    rng = np.random.default_rng(21)
    # (N tokens, Hkv, D, NB, P): a row shorter than the block of 128 threads, and one longer (300)
    for N, Hkv, D, NB, P in [(9, 2, 24, 5, 4), (4, 3, 100, 3, 2)]:
        k = rng.standard_normal((N, Hkv, D)).astype(np.float32)
        v = rng.standard_normal((N, Hkv, D)).astype(np.float32)
        slots = rng.permutation(NB * P)[:N].astype(np.int32)
        slots[N // 2] = -1                                   # a padding token: no slot
        fill = np.float32(7.0)                               # what the pool held before
        pool_k = dev(np.full((2, NB, P, Hkv, D), fill, np.float32))   # [L, NB, P, Hkv, D], layer 1 is stored
        pool_v = dev(np.full((2, NB, P, Hkv, D), fill, np.float32))
        with launches("store_kvcache"):
            kernel((N,), (128,), (dev(k), dev(v), pool_k[1], pool_v[1], dev(slots), np.int32(Hkv * D)))
        want_k, want_v = np.full((2, NB, P, Hkv, D), fill, np.float32)
        ops.store_kvcache(k, v, want_k, want_v, slots)                # the twin
        for name, pool, want in (("k_cache", pool_k.get(), want_k), ("v_cache", pool_v.get(), want_v)):
            got = pool[1]
            bad = np.argwhere(got != want)
            flat, ok = got.reshape(NB * P, -1), slots >= 0      # [NB P, Hkv D]; tokens with a slot
            where = f"store_kvcache (N = {N}, Hkv = {Hkv}, D = {D}, P = {P}): {name}"
            k_rows = k.reshape(N, -1)
            if len(bad) and name == "v_cache" and np.array_equal(flat[slots[ok]], k_rows[ok]):
                raise CheckFailed(f"{where}: v_cache holds k's rows at the tokens' slots: "
                                  "write v[n] there")
            own = (k if name == "k_cache" else v).reshape(N, -1)
            if len(bad) and np.array_equal(flat[np.flatnonzero(ok)], own[ok]):
                raise CheckFailed(f"{where}: token n's row went to row n of the pool, its index "
                                  f"in the batch: it goes to slot slot_mapping[n] (slot_mapping "
                                  f"= {slots.tolist()})")
            if len(bad):
                page, off, g, d = (int(i) for i in bad[0])
                slot = page * P + off
                owner = np.flatnonzero(slots == slot)
                who = (f"token {int(owner[0])}'s row ({name[0]}[{int(owner[0])}, {g}, {d}])" if len(owner)
                       else "nothing: no token's slot is this one, so it keeps its old value")
                raise CheckFailed(
                    f"store_kvcache (N = {N}, Hkv = {Hkv}, D = {D}, P = {P}): {name} page {page}, offset {off} "
                    f"(slot {slot} = page * P + offset), kv head {g}, dim {d}: expected {want[page, off, g, d]:.6g}, "
                    f"got {got[page, off, g, d]:.6g}; that slot should hold {who} "
                    f"({len(bad)} of {got.size} values differ; slot_mapping = {slots.tolist()})")
            if (pool[0] != fill).any():
                page, off, g, d = (int(i) for i in np.argwhere(pool[0] != fill)[0])
                raise CheckFailed(
                    f"store_kvcache: the kernel wrote outside its layer: layer 0 of the pool, page {page}, "
                    f"offset {off}, kv head {g}, dim {d} changed (only layer 1 was passed). Token {N // 2} has "
                    f"slot -1: a padding token owns no slot and must be skipped, not written at slot -1")


# ---------------------------------------------------------------------------
# 2.2 / 2.3 the block manager: allocate and free
# ---------------------------------------------------------------------------

def _seq(mod, name: str, n: int, arrival: int = 0):
    return mod.Sequence.from_request(Request(name, list(range(10, 10 + n)), SamplingParams(max_tokens=4)), arrival)


def _allocate(bm, seq, n: int, what: str) -> None:
    try:
        bm.allocate(seq, n)
    except AssertionError as e:
        raise CheckFailed(f"{what}: allocate raised AssertionError: {e}") from None


def check_allocate(ws: Workspace) -> None:
    mod = ws.module("stage2_batched/block_manager.py")
    NB, P = 6, 4
    bm = mod.BlockManager(NB, P)
    a, b, c = _seq(mod, "a", 9), _seq(mod, "b", 1), _seq(mod, "c", 9)
    steps = [(a, 5, 2, "positions 0..4 need ceil(5 / 4) = 2 pages"),
             (a, 8, 2, "positions 0..7 still fit in 2 pages: no new page"),
             (a, 9, 3, "position 8 is the first of a third page"),
             (b, 1, 1, "one position, one page"),
             (b, 1, 1, "b already holds its page")]
    held: dict[str, list[int]] = {"a": [], "b": []}
    for seq, n, pages, why in steps:
        free_before = list(bm.free)
        _allocate(bm, seq, n, f"allocate({seq.id}, {n})")
        what = f"allocate({seq.id}, {n}) with P = {P}"
        table = list(seq.block_table)
        took_all = len(table) != pages and len(table) == len(held[seq.id]) + bm.pages_for(n)
        extra = (f"; a sequence that holds pages needs pages_for({n}) minus the pages it holds"
                 if took_all else "")
        require(len(table) == pages, f"{what}: {seq.id}'s block table holds {len(table)} pages {table}, "
                                     f"expected {pages} ({why}{extra})")
        require(table[:len(held[seq.id])] == held[seq.id],
                f"{what}: the pages {seq.id} held before, {held[seq.id]}, must stay first in its block table "
                f"(position t lives in block_table[t // P]), got {table}")
        new = table[len(held[seq.id]):]
        require(all(p in free_before for p in new),
                f"{what}: the new pages {new} must come from the free list {free_before}")
        require(len(set(new)) == len(new), f"{what}: a page taken twice: {new}")
        require(len(bm.free) == len(free_before) - len(new) and not set(new) & set(bm.free),
                f"{what}: the pages taken must leave the free list: free is now {list(bm.free)}")
        for p in new:
            require(bm.owner.get(p) == seq.id, f"{what}: owner[{p}] is {bm.owner.get(p)!r}, expected {seq.id!r} "
                                               f"(the block manager records who holds each page)")
        require(bm.num_free_pages() == len(bm.free), f"{what}: num_free_pages() disagrees with the free list")
        held[seq.id] = table
    require(not set(held["a"]) & set(held["b"]), f"a and b share a page: {held['a']} and {held['b']}")
    # out of pages: 2 free, c needs 3 -> RuntimeError, and nothing taken
    free_before = list(bm.free)
    try:
        bm.allocate(c, 9)
    except RuntimeError:
        pass
    except Exception as e:
        raise CheckFailed(f"allocate(c, 9) with {len(free_before)} free pages: raised {type(e).__name__}: {e}, "
                          f"expected a RuntimeError (out of KV pages)") from None
    else:
        raise CheckFailed(f"allocate(c, 9) needs 3 pages and {len(free_before)} are free: it must raise "
                          f"RuntimeError (the scheduler should have preempted), got block table {c.block_table}")
    require(c.block_table == [] and list(bm.free) == free_before,
            f"allocate(c, 9) failed but still took pages: c holds {c.block_table}, free is {list(bm.free)} "
            f"(check that they fit before taking any)")
    _allocate(bm, c, 8, "allocate(c, 8)")
    require(len(c.block_table) == 2 and bm.num_free_pages() == 0,
            f"allocate(c, 8) with 2 free pages: c holds {c.block_table}, {bm.num_free_pages()} free (expected "
            f"2 pages, 0 free)")


def check_free_pages(ws: Workspace) -> None:
    mod = ws.module("stage2_batched/block_manager.py")
    NB, P = 6, 4
    bm = mod.BlockManager(NB, P)
    a, b, d = _seq(mod, "a", 9), _seq(mod, "b", 5), _seq(mod, "d", 16)
    bm.allocate(a, 9)
    bm.allocate(b, 5)
    pages_a, pages_b = list(a.block_table), list(b.block_table)
    bm.free_pages(a)
    require(a.block_table == [], f"after free_pages(a), a's block table is {a.block_table}, expected [] "
                                 f"(a preempted sequence starts again with no pages)")
    require(sorted(bm.free) == sorted(set(range(NB)) - set(pages_b)),
            f"after free_pages(a): the free list is {sorted(bm.free)}, expected every page but b's {pages_b} "
            f"(a held {pages_a}; each page goes back once)")
    for p in pages_a:
        require(p not in bm.owner, f"after free_pages(a): page {p} still has the owner {bm.owner.get(p)!r}")
    require(b.block_table == pages_b and all(bm.owner.get(p) == "b" for p in pages_b),
            f"free_pages(a) changed b: b holds {b.block_table}, owners {[bm.owner.get(p) for p in pages_b]}")
    bm.free_pages(mod.Sequence.from_request(a.req, 5))     # a sequence with no pages: nothing to do
    require(bm.num_free_pages() == NB - len(pages_b), "free_pages of a sequence without pages changed the free list")
    _allocate(bm, d, 16, "allocate(d, 16) after free_pages(a)")     # 4 pages: a's 3 and one more
    require(len(d.block_table) == 4, f"allocate(d, 16) after free_pages(a): d holds {d.block_table}")
    bm.free_pages(b)
    bm.free_pages(d)
    require(bm.num_free_pages() == NB and sorted(bm.free) == list(range(NB)) and not bm.owner,
            f"after freeing every sequence: free list {sorted(bm.free)}, owners {bm.owner} (expected all "
            f"{NB} pages free once, no owners)")


# ---------------------------------------------------------------------------
# 2.4 the scheduler: the token budget and preemption
# ---------------------------------------------------------------------------

# (arrival step, id, prompt length, tokens to generate)
BUDGET_CASE = dict(num_pages=40, page_size=4, slots=3, token_budget=8,
                   arrivals=[(0, "a", 20, 3), (0, "b", 3, 4), (1, "c", 5, 3), (2, "d", 2, 2)])
PREEMPT_CASE = dict(num_pages=6, page_size=4, slots=3, token_budget=16,
                    arrivals=[(0, "a", 9, 8), (0, "b", 6, 8), (1, "c", 4, 6)])
# b's second chunk (14 tokens, 4 pages) does not fit even once b's own page is freed: b is
# preempted and the loop stops there; a, scheduled before b in the same step, keeps running
SELF_CASE = dict(num_pages=6, page_size=4, slots=3, token_budget=16, arrivals=[(0, "a", 12, 2), (0, "b", 18, 2)])


def _simulate(sched_mod, case: dict, max_steps: int = 80) -> list[dict]:
    """Run a scheduler as the engine does (feed the scheduled tokens, sample one token once a
    sequence is all in, finish it after its tokens) -> one record per step."""
    bm = sched_mod.BlockManager(case["num_pages"], case["page_size"])
    sch = sched_mod.Scheduler(bm, case["slots"], case["token_budget"])
    want_tokens, log, arrival = {}, [], 0
    for step in range(max_steps):
        for at, name, n, out in case["arrivals"]:
            if at == step:
                seq = sched_mod.Sequence.from_request(
                    Request(name, list(range(10 + arrival, 10 + arrival + n)), SamplingParams(max_tokens=out)),
                    arrival)
                arrival += 1
                want_tokens[name] = out
                sch.add(seq)
        if not sch.has_work():
            break
        batch = sch.schedule()
        log.append(dict(batch=[(s.id, n) for s, n in zip(batch.seqs, batch.num_tokens)],
                        preempted=[s.id for s in batch.preempted],
                        free=bm.num_free_pages(),
                        pages={s.id: len(s.block_table) for s in (*sch.running, *sch.waiting)},
                        running=[s.id for s in sch.running]))
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
            if seq.num_computed == len(seq.token_ids):        # all in: its next token is sampled
                seq.token_ids.append(900 + len(seq.token_ids))
                if len(seq.output_ids) >= want_tokens[seq.id]:
                    sch.finish(seq)
    return log


def _describe(rec: dict) -> str:
    b = ", ".join(f"{i}: {n} token{'s' if n != 1 else ''}" for i, n in rec["batch"]) or "nothing"
    p = f"; preempted {rec['preempted']}" if rec["preempted"] else ""
    return f"[{b}]{p}"


def check_scheduler(ws: Workspace) -> None:
    mine = ws.module("stage2_batched/scheduler.py")
    for name, case, what in (("the token budget", BUDGET_CASE, "a 20-token prompt is prefilled in chunks of "
                              "what the budget leaves after the decodes"),
                             ("preemption", PREEMPT_CASE, "6 pages of 4 for three sequences that grow: the newest "
                              "running one is preempted (pages freed, recomputed later), possibly the sequence "
                              "that needs the page itself"),
                             ("preempting itself", SELF_CASE, "once the sequence that needs the pages has "
                              "preempted itself, nothing more is preempted for it: the older sequences are already "
                              "in this step's batch")):
        want, got = _simulate(scheduler, case), _simulate(mine, case)
        setting = (f"{case['num_pages']} pages of {case['page_size']}, slots {case['slots']}, token budget "
                   f"{case['token_budget']}, arrivals (step, id, prompt, tokens) {case['arrivals']}")
        for step, (w, g) in enumerate(zip(want, got)):
            tokens, why = sum(n for _, n in g["batch"]), what
            if tokens > case["token_budget"]:
                why = (f"{tokens} tokens is over the token budget of {case['token_budget']}: a "
                       "sequence gets min(its uncomputed tokens, what the budget leaves)")
            if w["batch"] != g["batch"] or w["preempted"] != g["preempted"]:
                raise CheckFailed(f"scheduler, {name} ({setting}): step {step}: expected {_describe(w)}, got "
                                  f"{_describe(g)}; running before the step: {want[step - 1]['running'] if step else []}"
                                  f" ({why})")
            if w["pages"] != g["pages"] or w["free"] != g["free"]:
                raise CheckFailed(f"scheduler, {name} ({setting}): step {step} schedules {_describe(g)} as expected, "
                                  f"but the pages held after it are {g['pages']} with {g['free']} free, expected "
                                  f"{w['pages']} with {w['free']} free (allocate for num_computed + n; a preempted "
                                  f"sequence frees all of its pages)")
        require(len(got) == len(want), f"scheduler, {name} ({setting}): the work ends after {len(got)} steps, "
                                       f"expected {len(want)} (every request runs to its last token)")


# ---------------------------------------------------------------------------
# 2.5 paged decode attention (decode_attention.cu)
# ---------------------------------------------------------------------------

def _paged_attention_np(q, k_cache, v_cache, tables, ctx, scaled: bool = True,
                        kv_head=lambda h, H, Hkv: h // (H // Hkv),
                        row_of=lambda table, t, P: table[t // P] * P + t % P) -> np.ndarray:
    """Paged decode attention in float64 as a mistake computes it: query head h reads kv head
    kv_head(h, H, Hkv); position t is row row_of(table, t, P) of the pool's [NB P] rows."""
    S, H, D = q.shape
    NB, P, Hkv, _ = k_cache.shape
    ks, vs = k_cache.reshape(NB * P, Hkv, D), v_cache.reshape(NB * P, Hkv, D)
    out = np.empty(q.shape)
    for s in range(S):
        rows = [int(row_of(tables[s], t, P)) for t in range(int(ctx[s]))]
        for h in range(H):
            g = kv_head(h, H, Hkv)
            score = ks[rows, g].astype(np.float64) @ q[s, h] * (1 / np.sqrt(D) if scaled else 1.0)
            e = np.exp(score - score.max())
            out[s, h] = e @ vs[rows, g] / e.sum()
    return out


def check_decode_attention(ws: Workspace) -> None:
    kernel = build(ws, "stage2_batched/cuda/decode_attention.cu")["paged_decode_attention"]
    rng = np.random.default_rng(25)
    # (H, Hkv, D, P, context lengths): GQA 2 -> 1 with contexts shorter than the 4 warps, on a
    # page boundary and across pages; 3 query heads on one kv head, D not a multiple of 32
    for H, Hkv, D, P, lens in [(4, 2, 32, 4, [1, 3, 8, 13]), (3, 1, 40, 16, [18])]:
        k_cache, v_cache, tables = paged(rng, lens, Hkv, D, P)
        q = (rng.standard_normal((len(lens), H, D)) * 2).astype(np.float32)
        ctx = np.array(lens, np.int32)
        out = dev(np.full(q.shape, np.nan, np.float32))
        with launches("paged_decode_attention"):
            kernel((len(lens), H), (128,),
                   (dev(q), dev(k_cache), dev(v_cache), dev(tables), dev(ctx), out, np.int32(H), np.int32(Hkv),
                    np.int32(D), np.int32(P), np.int32(tables.shape[1]), np.float32(1 / np.sqrt(D))))
        args = (q, k_cache, v_cache, tables, ctx)
        mistakes = [("query head h reads kv head h / (H / Hkv): a group of H / Hkv neighbours "
                     "shares one", _paged_attention_np(*args, kv_head=lambda h, H, Hkv: h % Hkv)),
                    ("the scores are q . k without the 1/sqrt(D) scale",
                     _paged_attention_np(*args, scaled=False)),
                    ("position t was read as pool row t: its page is block_tables[s, t / P], "
                     "offset t % P", _paged_attention_np(*args, row_of=lambda table, t, P: t))]
        assert_close(f"paged_decode_attention (H = {H}, Hkv = {Hkv}, D = {D}, P = {P}, context lengths {lens}, "
                     f"block tables {tables.tolist()})", out.get(), ops.paged_decode_attention(q, k_cache, v_cache,
                                                                                              tables, ctx),
                     atol=1e-5, rtol=1e-4, axes_names=("sequence", "head", "dim"),
                     mistakes=mistakes,
                     hint="query head h reads kv head h / (H / Hkv); position t is at page block_tables[s, t / P], "
                          "offset t % P; softmax over all ctx positions, scaled by 1/sqrt(D)")


EXERCISES: list[Exercise] = [
    Exercise(id="2.1", title="the KV store through the slot mapping", section="docs/stage2.md#the-kernels",
             difficulty="easy", file="stage2_batched/cuda/store_kvcache.cu", check=check_store_kvcache),
    Exercise(id="2.2", title="the block manager's allocate", section="docs/stage2.md#one-step-end-to-end",
             difficulty="easy", file="stage2_batched/block_manager.py", check=check_allocate),
    Exercise(id="2.3", title="the block manager's free", section="docs/stage2.md#one-step-end-to-end",
             difficulty="easy", file="stage2_batched/block_manager.py", check=check_free_pages),
    Exercise(id="2.4", title="the scheduler's token budget and preemption",
             section="docs/stage2.md#one-step-end-to-end", difficulty="hard", file="stage2_batched/scheduler.py",
             check=check_scheduler),
    Exercise(id="2.5", title="the paged decode-attention kernel", section="docs/stage2.md#the-kernels",
             difficulty="hard", file="stage2_batched/cuda/decode_attention.cu", check=check_decode_attention),
]
