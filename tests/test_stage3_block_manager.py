"""Stage 3's prefix cache in pure Python (no model, no device).

The bookkeeping is checked against a shadow of the page pool: every time a sequence
"computes" position t it writes, into the shadow slot of that position, the exact
token prefix token_ids[:t+1] that the real K/V row would depend on. A hit is right
only if every cached position a sequence adopts holds its own prefix, so the shadow
catches a wrong hit whatever the hash did. The same drive runs with SHA-256, with a
hash that collides all the time, and with hypothesis-made workloads.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from common.engine import Request
from common.sampling import SamplingParams
from stage3_optimized.block_manager import BlockManager, sha256_key
from stage3_optimized.scheduler import Scheduler
from stage3_optimized.sequence import Sequence


def seq(i: int, prompt: list[int], max_tokens: int = 4) -> Sequence:
    req = Request(f"r{i}", list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens))
    return Sequence.from_request(req, arrival=i)


def compute(bm: BlockManager, s: Sequence, n: int, shadow: dict) -> None:
    """What a forward pass does for s's next n tokens: write their 'K/V' (the prefix they
    depend on) into their slots, then the engine registers the pages that became full."""
    P = bm.page_size
    for t in range(s.num_computed, s.num_computed + n):
        shadow[(s.block_table[t // P], t % P)] = tuple(s.token_ids[:t + 1])
    s.num_computed += n
    bm.register(s)


def check_cached_positions(bm: BlockManager, s: Sequence, shadow: dict) -> None:
    """Every position s counts as computed holds s's own prefix."""
    P = bm.page_size
    for t in range(s.num_computed):
        assert shadow.get((s.block_table[t // P], t % P)) == tuple(s.token_ids[:t + 1]), \
            f"{s.id}: position {t} in page {s.block_table[t // P]} holds another prefix"


def check_pool(bm: BlockManager, holders: list[Sequence]) -> None:
    """Reference counts equal the block tables holding each page; every page is held,
    empty-free or cached-free, exactly one of the three; the maps agree."""
    held = {}
    for s in holders:
        assert len(set(s.block_table)) == len(s.block_table)
        for p in s.block_table:
            held[p] = held.get(p, 0) + 1
    for p in range(bm.num_pages):
        assert bm.ref_count[p] == held.get(p, 0), (
            f"page {p}: count {bm.ref_count[p]}, held {held.get(p, 0)}"
        )
    free, cached = set(bm.free), set(bm.cached_free)
    assert len(free) == len(bm.free) and not free & cached and not (free | cached) & set(held)
    assert len(free) + len(cached) + len(held) == bm.num_pages, "a page leaked"
    assert cached <= set(bm.key_of), "a cached free page has no key"
    for h, p in bm.page_of.items():
        assert bm.key_of[p].hash == h


def drive(prompts, outputs, num_pages, page_size, slots=4, budget=16, hash_fn=sha256_key,
          enable=True, arrivals=None, max_steps=5000):
    """The engine's loop without a model. Sequence i has prompts[i] and produces outputs[i]
    (a token chosen from its prefix, so it does not depend on batching). -> (bm, sched, seqs)"""
    bm = BlockManager(num_pages, page_size, enable_prefix_caching=enable, hash_fn=hash_fn)
    sched = Scheduler(bm, slots, budget)
    seqs = [seq(i, p, max_tokens=o) for i, (p, o) in enumerate(zip(prompts, outputs))]
    arrivals = arrivals or [0] * len(seqs)
    shadow, done, step = {}, set(), 0
    while len(done) < len(seqs):
        for s, a in zip(seqs, arrivals):
            if a == step:
                sched.add(s)
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_tokens):
            check_cached_positions(bm, s, shadow)             # the hit (or earlier steps) are right
            assert s.num_computed + n <= len(s.block_table) * page_size
        check_pool(bm, sched.running)
        for s in sched.waiting:
            assert s.block_table == [] and s.num_computed == 0
        for s, n in zip(batch.seqs, batch.num_tokens):
            compute(bm, s, n, shadow)
            if s.num_computed == len(s.token_ids):
                s.token_ids.append(7 + sum(s.token_ids) % 5)  # 'sampled' from its own prefix
                if len(s.output_ids) >= s.req.params.max_tokens:
                    sched.finish(s)
                    done.add(s.id)
        step += 1
        assert step < max_steps, "the scheduler stopped making progress"
    check_pool(bm, [])
    assert bm.num_free_pages() == num_pages and not sched.has_work()
    return bm, sched, seqs


# ---- the basic moves ----

def test_second_request_takes_the_shared_full_pages_and_computes_the_rest():
    bm = BlockManager(num_pages=16, page_size=4)
    sched = Scheduler(bm, slots=4, token_budget=64)
    shadow = {}
    system = list(range(10, 20))                     # 10 tokens: 2 full pages + 2 tokens
    a = seq(0, system + [50, 51, 52])
    sched.add(a)
    b = sched.schedule()
    assert a.num_cached_tokens == 0 and b.num_tokens == [13]
    compute(bm, a, 13, shadow)
    assert len(a.page_keys) == 3                     # 13 tokens: 3 full pages registered
    c = seq(1, system + [60, 61])
    sched.add(c)
    b = sched.schedule()
    assert c.num_cached_tokens == 8 and c.num_computed == 8     # 2 pages of the system prompt
    assert c.block_table[:2] == a.block_table[:2] and c.block_table[2] not in a.block_table
    assert [n for s, n in zip(b.seqs, b.num_tokens) if s is c] == [4]  # positions 8..11 only
    assert bm.ref_count[a.block_table[0]] == 2 and bm.ref_count[a.block_table[2]] == 1
    check_cached_positions(bm, c, shadow)
    assert bm.num_hit_tokens == 8 and bm.num_lookup_tokens == 13 + 12


def test_full_hit_recomputes_the_last_page_so_logits_exist():
    bm = BlockManager(num_pages=16, page_size=4)
    sched = Scheduler(bm, slots=4, token_budget=64)
    shadow = {}
    prompt = list(range(30, 42))                     # exactly 3 full pages
    a = seq(0, prompt)
    sched.add(a)
    sched.schedule()
    compute(bm, a, 12, shadow)
    pa = list(a.block_table)
    sched.finish(a)                                  # all three pages wait in the LRU
    assert len(bm.cached_free) == 3 and bm.num_free_pages() == 16
    again = seq(1, prompt)
    sched.add(again)
    b = sched.schedule()
    # pages 0 and 1 hit; page 2 holds the last token, so it is computed again in a fresh page
    assert again.num_cached_tokens == 8 and b.num_tokens == [4]
    assert again.block_table[:2] == pa[:2] and again.block_table[2] != pa[2]
    assert pa[2] in bm.cached_free                   # the cached copy is not written into
    assert bm.ref_count[again.block_table[2]] == 1
    # one token more than the pages: all three pages hit, the extra token is computed
    longer = seq(2, prompt + [99])
    sched.add(longer)
    b = sched.schedule()
    assert longer.num_cached_tokens == 12 and b.num_tokens[-1] == 1


def test_cached_free_pages_are_evicted_least_recent_first_and_deepest_first():
    bm = BlockManager(num_pages=6, page_size=2)
    shadow = {}
    a, b = seq(0, [1, 2, 3, 4, 5]), seq(1, [9, 8, 7, 6, 5])
    for s in (a, b):
        bm.allocate(s, 5)
        compute(bm, s, 5, shadow)
    pa, pb = list(a.block_table), list(b.block_table)
    bm.free_pages(a)                                 # a first: its pages are the oldest in the LRU
    bm.free_pages(b)
    assert list(bm.cached_free) == [pa[1], pa[0], pb[1], pb[0]]   # deepest page of each first
    assert sorted(bm.free) == sorted([pa[2], pb[2]])  # partial pages hold nothing shareable
    c = seq(2, [40, 41, 42, 43, 44, 45, 46])           # 4 pages: 2 empty ones, then evict a's two
    bm.allocate(c, 7)
    assert sorted(c.block_table[2:]) == sorted(pa[:2])
    assert bm.find_cached(seq(3, [1, 2, 3, 4, 5]))[0] == []      # a's prefix is gone
    assert bm.find_cached(seq(4, [9, 8, 7, 6, 5]))[0] == pb[:2]  # b's is still there


def test_cache_off_never_shares_a_page():
    bm, sched, seqs = drive([list(range(20))] * 4, [3] * 4, num_pages=40, page_size=4, enable=False)
    assert bm.num_hit_tokens == 0 and not bm.key_of and all(s.num_cached_tokens == 0 for s in seqs)


def test_shared_prefix_workload_hits_and_leaks_nothing():
    rng = np.random.default_rng(0)
    system = rng.integers(3, 100, size=37).tolist()
    prompts = [
        system + rng.integers(3, 100, size=int(rng.integers(1, 12))).tolist() for _ in range(12)
    ]
    outputs = rng.integers(1, 9, size=12).tolist()
    arrivals = sorted(rng.integers(0, 30, size=12).tolist())
    bm, sched, seqs = drive(
        prompts, outputs, num_pages=64, page_size=4, slots=4, budget=24, arrivals=arrivals
    )
    later = [s for s in seqs[1:] if s.num_cached_tokens]
    # 9 full pages of the system prompt
    assert later and all(s.num_cached_tokens == 36 for s in later)
    assert bm.num_hit_tokens >= 36 * 6


def test_eviction_under_memory_pressure_keeps_the_cache_exact():
    """Few pages, shared prefixes, preemptions: pages are evicted from the LRU all the time;
    every hit is still exact (the shadow) and no page leaks (check_pool every step)."""
    rng = np.random.default_rng(1)
    heads = [rng.integers(3, 40, size=n).tolist() for n in (9, 14, 22)]
    prompts = [
        heads[i % 3] + rng.integers(3, 40, size=int(rng.integers(1, 9))).tolist() for i in range(30)
    ]
    outputs = rng.integers(1, 14, size=30).tolist()
    arrivals = sorted(rng.integers(0, 80, size=30).tolist())
    bm, sched, seqs = drive(
        prompts, outputs, num_pages=14, page_size=3, slots=5, budget=12, arrivals=arrivals
    )
    assert sched.num_preemptions > 0 and bm.num_hit_tokens > 0


# ---- the collision guard ----

def constant_hash(parent: bytes, ids) -> bytes:
    return b"every page hashes alike"


def test_forced_collision_is_caught_by_the_stored_ids():
    bm = BlockManager(num_pages=10, page_size=2, hash_fn=constant_hash)
    shadow = {}
    a = seq(0, [1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    compute(bm, a, 5, shadow)
    # page 1 of a collided with page 0: kept private
    assert len(bm.page_of) == 1
    other = seq(1, [7, 8, 3, 4, 5])                   # different first page, same hash
    assert bm.find_cached(other) == ([], [])


def test_same_ids_at_another_depth_are_not_a_hit():
    """Page [5, 5] after [5, 5] holds different K/V than page [5, 5] at the start. With a
    hash that cannot tell them apart, only the parent check stops the false hit."""
    bm = BlockManager(num_pages=10, page_size=2, hash_fn=constant_hash)
    shadow = {}
    a = seq(0, [5, 5, 9])
    bm.allocate(a, 3)
    compute(bm, a, 3, shadow)
    b = seq(1, [5, 5, 5, 5, 1])
    pages, _ = bm.find_cached(b)
    assert pages == [a.block_table[0]]                # page 0 is right; page 1 must not reuse it


@pytest.mark.parametrize("hash_fn", [constant_hash, lambda parent, ids: bytes([sum(ids) % 3])],
                         ids=["constant", "sum-mod-3"])
def test_colliding_hash_workload_stays_exact(hash_fn):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 6, size=int(rng.integers(4, 20))).tolist() for _ in range(20)]
    outputs = rng.integers(1, 6, size=20).tolist()
    drive(prompts, outputs, num_pages=16, page_size=2, slots=4, budget=10,
          arrivals=sorted(rng.integers(0, 40, size=20).tolist()), hash_fn=hash_fn)


# ---- properties of the hash chain ----

def chain(ids: list[int], P: int) -> list[bytes]:
    keys, parent = [], b""
    for i in range(len(ids) // P):
        parent = sha256_key(parent, tuple(ids[i * P:(i + 1) * P]))
        keys.append(parent)
    return keys


tokens = st.lists(st.integers(0, 3), min_size=0, max_size=24)


@settings(max_examples=200, deadline=None)
@given(tokens, tokens, st.integers(1, 5))
def test_chain_key_names_the_whole_prefix(a, b, P):
    """Key i of two sequences is equal exactly when their first (i+1)*P ids are."""
    ka, kb = chain(a, P), chain(b, P)
    for i in range(min(len(ka), len(kb))):
        assert (ka[i] == kb[i]) == (a[:(i + 1) * P] == b[:(i + 1) * P])


@settings(max_examples=200, deadline=None)
@given(tokens, st.integers(1, 5), st.integers(0, 3))
def test_chain_key_changes_with_any_earlier_id(a, P, flip):
    """Changing one id changes the key of its page and of every page after it, none before."""
    if len(a) < P:
        return
    pos = flip % len(a)
    b = list(a)
    b[pos] = b[pos] + 1
    ka, kb = chain(a, P), chain(b, P)
    for i in range(len(ka)):
        assert (ka[i] == kb[i]) == (i < pos // P)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(3, 5), min_size=1, max_size=14), st.integers(1, 5)),
                min_size=1, max_size=8),
       st.integers(1, 4), st.sampled_from(["sha256", "sum-mod-2"]))
def test_random_workloads_keep_every_hit_exact_and_free_every_page(work, P, hash_name):
    hash_fn = sha256_key if hash_name == "sha256" else (lambda parent, ids: bytes([sum(ids) % 2]))
    prompts = [p for p, _ in work]
    outputs = [o for _, o in work]
    need = max(len(p) + o for p, o in work)
    num_pages = (need + P - 1) // P + 2                # tight: evictions and preemptions happen
    drive(prompts, outputs, num_pages=num_pages, page_size=P, slots=3, budget=8, hash_fn=hash_fn,
          arrivals=list(range(len(work))))
