"""Stage 2's bookkeeping in pure Python (no model, no device): the block manager never
gives a page to two sequences and gets every page back; the scheduler keeps to its
token budget and slot count, preempts the newest sequence when pages run out, and
lets no sequence starve."""
from __future__ import annotations

import numpy as np
import pytest

from common.engine import Request
from common.sampling import SamplingParams
from stage2_batched.batch import build_batch
from stage2_batched.block_manager import BlockManager
from stage2_batched.scheduler import Scheduler
from stage2_batched.sequence import Sequence, Status


def seq(i: int, prompt_len: int, max_tokens: int = 4) -> Sequence:
    req = Request(f"r{i}", list(range(3, 3 + prompt_len)),
                  SamplingParams(temperature=0, max_tokens=max_tokens))
    return Sequence.from_request(req, arrival=i)


def check_ownership(bm: BlockManager, seqs: list[Sequence]) -> None:
    """No page owned twice; owned + free = all pages; owners match block tables."""
    owned = [p for s in seqs for p in s.block_table]
    assert len(owned) == len(set(owned)), "a page is in two block tables"
    assert not set(owned) & set(bm.free), "a page is both owned and free"
    assert len(owned) + len(bm.free) == bm.num_pages
    for s in seqs:
        for p in s.block_table:
            assert bm.owner[p] == s.id


def test_block_manager_allocates_on_demand_and_frees_everything():
    bm = BlockManager(num_pages=10, page_size=4)
    a, b = seq(0, 5), seq(1, 9)
    bm.allocate(a, 5)                       # positions 0..4 -> 2 pages
    bm.allocate(b, 9)                       # 3 pages
    assert len(a.block_table) == 2 and len(b.block_table) == 3
    bm.allocate(a, 8)                       # still 2 pages: no new page until position 8
    assert len(a.block_table) == 2
    bm.allocate(a, 9)
    assert len(a.block_table) == 3
    check_ownership(bm, [a, b])
    # 3 own + 4 free pages
    assert bm.can_allocate(b, 12 + 4 * 4) and not bm.can_allocate(b, 12 + 4 * 4 + 1)
    with pytest.raises(RuntimeError, match="out of KV pages"):
        bm.allocate(b, 100)
    bm.free_pages(a)
    bm.free_pages(b)
    assert bm.num_free_pages() == 10 and not bm.owner and a.block_table == []


def simulate(num_seqs=40, num_pages=24, page_size=4, slots=6, budget=16, seed=0, max_steps=3000):
    """Drive the scheduler like the engine does (without a model): each scheduled sequence
    computes its tokens; one that is fully computed 'samples' a token and finishes after
    max_tokens. New sequences arrive over time. Checks the invariants every step."""
    rng = np.random.default_rng(seed)
    bm = BlockManager(num_pages, page_size)
    sched = Scheduler(bm, slots, budget)
    seqs = [seq(i, int(rng.integers(1, 30)), int(rng.integers(1, 12))) for i in range(num_seqs)]
    arrive = sorted(rng.integers(0, 60, size=num_seqs).tolist())
    finished_at, first_scheduled = {}, {}
    sched.max_seen = (0, 0)               # (most tokens in one step, most running at once)
    step = 0
    while len(finished_at) < num_seqs:
        for s, t in zip(seqs, arrive):
            if t == step:
                sched.add(s)
        batch = sched.schedule()
        # budgets and slots
        assert sum(batch.num_tokens) <= budget
        assert len(sched.running) <= slots
        assert all(n >= 1 for n in batch.num_tokens)
        sched.max_seen = (max(sched.max_seen[0], sum(batch.num_tokens)),
                          max(sched.max_seen[1], len(sched.running)))
        assert len({s.id for s in batch.seqs}) == len(batch.seqs)
        check_ownership(bm, sched.running + list(sched.waiting))
        for s in sched.waiting:
            assert s.block_table == [] and s.num_computed == 0
        # the oldest running sequence always makes progress (no starvation)
        if sched.running:
            assert batch.seqs and batch.seqs[0] is sched.running[0]
        # every scheduled token has a page
        for s, n in zip(batch.seqs, batch.num_tokens):
            assert len(s.block_table) * page_size >= s.num_computed + n
            first_scheduled.setdefault(s.id, step)
        if batch.seqs:
            build_batch(batch.seqs, batch.num_tokens, page_size)   # well-formed BatchInfo
        for s, n in zip(batch.seqs, batch.num_tokens):
            s.num_computed += n
            if s.num_computed == len(s.token_ids):
                s.token_ids.append(7)
                if len(s.output_ids) >= s.req.params.max_tokens:
                    sched.finish(s)
                    finished_at[s.id] = step
        step += 1
        assert step < max_steps, "some sequence starved"
    assert bm.num_free_pages() == num_pages and not sched.has_work()
    return sched, finished_at, first_scheduled, arrive


def test_scheduler_keeps_budgets_and_never_double_books_pages():
    sched, *_ = simulate(num_pages=200)      # invariants are checked every step inside
    # the budget and the slots were both reached, never passed
    assert sched.max_seen == (16, 6)
    assert sched.num_preemptions == 0        # plenty of pages: nobody is preempted


def test_scheduler_preempts_the_newest_when_pages_run_out_and_everyone_finishes():
    # 11 pages of 4 = 44 positions shared by up to 6 sequences of up to 41 tokens
    sched, finished_at, first, arrive = simulate(num_pages=11, slots=6, budget=16, seed=1)
    assert sched.num_preemptions > 0


def test_requests_finish_roughly_in_arrival_order():
    """FIFO admission + oldest-first budget: nobody is overtaken forever. A sequence is
    first scheduled no later than any sequence that arrived after it."""
    for seed in range(3):
        sched, finished_at, first, arrive = simulate(seed=seed, num_pages=14)
        order = [f"r{i}" for i in range(len(arrive))]
        firsts = [first[r] for r in order]
        assert firsts == sorted(firsts), "a later request was admitted before an earlier one"


def test_preempted_sequence_is_recomputed_from_scratch():
    bm = BlockManager(num_pages=4, page_size=4)           # 16 positions
    sched = Scheduler(bm, slots=4, token_budget=16)
    old, new = seq(0, 6), seq(1, 6)
    sched.add(old)
    sched.add(new)
    b = sched.schedule()                                  # both prefill: 2 + 2 pages
    assert [s.id for s in b.seqs] == ["r0", "r1"] and bm.num_free_pages() == 0
    for s, n in zip(b.seqs, b.num_tokens):
        s.num_computed += n
        s.token_ids.append(9)
    # decode step: both sit at 7 tokens in 2 pages, still room; grow old to need a 3rd page
    old.token_ids += [9, 9]                               # 9 tokens: position 8 needs page 3
    b = sched.schedule()
    assert b.preempted == [new] and new.status is Status.WAITING
    assert new.num_computed == 0 and new.block_table == [] and new.num_uncomputed == 7
    assert [s.id for s in b.seqs] == ["r0"] and list(sched.waiting) == [new]


def test_token_budget_splits_a_long_prompt_into_chunks():
    bm = BlockManager(num_pages=64, page_size=16)
    sched = Scheduler(bm, slots=4, token_budget=50)
    long = seq(0, 120)
    sched.add(long)
    chunks = []
    while long.num_computed < 120:
        b = sched.schedule()
        chunks.append(b.num_tokens[0])
        long.num_computed += b.num_tokens[0]
    assert chunks == [50, 50, 20]


def test_decode_tokens_come_first_in_the_batch():
    bm = BlockManager(num_pages=64, page_size=16)
    a, b, c = seq(0, 10), seq(1, 40), seq(2, 1)
    for s in (a, b, c):
        bm.allocate(s, len(s.token_ids) + 1)
    a.num_computed = 10
    a.token_ids.append(5)                                 # a decodes its 11th token
    ordered, tokens, info = build_batch([a, b, c], [1, 40, 1], 16)
    assert [s.id for s in ordered] == ["r0", "r2", "r1"] and info.num_decode == 2
    assert info.positions.tolist() == [10, 0] + list(range(40))
    assert info.context_lens.tolist() == [11, 1, 40]
    assert info.query_start.tolist() == [0, 1, 2, 42]
    assert info.logits_rows.tolist() == [0, 1, 41]
    page = a.block_table[0]
    assert info.slot_mapping[0] == page * 16 + 10
    assert tokens[0] == 5 and len(tokens) == 42


def test_scheduler_rejects_a_budget_below_the_slots():
    with pytest.raises(ValueError, match="token-budget"):
        Scheduler(BlockManager(4, 4), slots=8, token_budget=4)
