"""Stage 3's CUDA-graph decode path on the CPU: the buckets, the padding, and the replay logic.

A real capture needs a GPU. What can go wrong around it is checked here on the numpy
twins: a bucket too small, a padding row that writes into a real KV page or changes a
real row's logits, a static buffer that a step forgets to refill, a logits array that a
later replay overwrites. CallCapture stands in for CupyCapture: "capturing" keeps the
call, and a replay runs it again with the very same static buffers and the very same
capture-time BatchInfo (its host numbers fixed, as a graph fixes them), writing into the
model's buffers, as a graph does.
"""
from __future__ import annotations

import numpy as np
import pytest

from bench.testbed.models import make_model
from common.engine import Request
from common.sampling import SamplingParams
from stage3_optimized import options
from stage3_optimized.batch import build_batch
from stage3_optimized.cuda_graphs import DecodeGraphs, batch_buckets, pad_decode_batch, pick_bucket
from stage3_optimized.engine import LLMEngine
from stage3_optimized.sequence import Sequence


class CallCapture:
    """The stand-in capture: the "graph" is the step itself, not run at capture (as a capture
    runs nothing); a replay calls it again, and it writes into the model's buffers, where a
    graph writes. (tests/test_stage3_cuda_emulated.py captures for real, on the emulated CuPy.)"""

    def __init__(self):
        self.captured = 0

    def __call__(self, fn):
        self.captured += 1
        return fn

    def replay(self, graph) -> None:
        graph()


def engine(folder, graphs: bool, **kw):
    args = dict(max_ctx=64, slots=6, token_budget=32, page_size=4, num_pages=60, device="cpu",
                progress=False)
    args.update(kw)
    eng = LLMEngine(folder, **args)
    assert eng.graphs is None                   # device="cpu": eager unless a test puts graphs in
    if graphs:
        eng.graphs = DecodeGraphs(eng.model, eng.inputs, args["slots"], capture=CallCapture())
    return eng


def run(eng, prompts, steps, params=None):
    for i, p in enumerate(prompts):
        eng.add_request(Request(str(i), p, params or SamplingParams(temperature=0, max_tokens=steps,
                                                                    ignore_eos=True)))
    out = {str(i): [] for i in range(len(prompts))}
    while eng.has_work():
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
    return out


def test_buckets_hold_every_batch_with_at_most_15_padding_rows():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256] and len(batch_buckets(256)) == 4 + 16
    for top in (1, 3, 8, 17, 100, 256):
        buckets = batch_buckets(top)
        assert buckets == sorted(set(buckets)) and buckets[-1] == top
        for b in range(1, top + 1):
            size = pick_bucket(buckets, b)
            assert b <= size <= b + 15 and size in buckets
        assert pick_bucket(buckets, top + 1) is None           # larger than every graph: eager
    with pytest.raises(ValueError):
        batch_buckets(0)


def decode_batch(page_size=4):
    """Three sequences mid-decode (contexts 6, 9 and 2), as the scheduler hands them over."""
    seqs = []
    for i, (n, pages) in enumerate([(6, [7, 3]), (9, [1, 5, 9]), (2, [4])]):
        s = Sequence.from_request(Request(str(i), list(range(10, 10 + n)), SamplingParams()), i)
        s.block_table, s.num_computed = pages, n - 1
        seqs.append(s)
    return build_batch(seqs, [1, 1, 1], page_size)


def test_padding_rows_write_no_slot_and_read_one_position():
    seqs, tokens, batch = decode_batch()
    ptok, pb = pad_decode_batch(tokens, batch, 8, max_blocks=16, max_context=64)
    assert ptok.tolist() == tokens.tolist() + [0] * 5
    assert pb.num_decode == 8 and pb.max_context == 64 and pb.block_tables.shape == (8, 16)
    # the real rows are unchanged ...
    assert (
        pb.slot_mapping[:3].tolist()
        == [3 * 4 + 1, 9 * 4 + 0, 4 * 4 + 1]
        == batch.slot_mapping.tolist()
    )
    assert pb.positions[:3].tolist() == [5, 8, 1] and pb.context_lens[:3].tolist() == [6, 9, 2]
    np.testing.assert_array_equal(pb.block_tables[:3, :3], batch.block_tables)
    assert not pb.block_tables[:, 3:].any()
    # ... and the padding rows store nothing (slot -1), see one position of page 0, sample nothing
    # real
    assert pb.slot_mapping[3:].tolist() == [-1] * 5 and pb.context_lens[3:].tolist() == [1] * 5
    assert not pb.block_tables[3:].any() and pb.positions[3:].tolist() == [0] * 5
    assert pb.logits_rows.tolist() == list(range(8)) and pb.query_start.tolist() == list(range(9))
    assert len(pb.tile_start) == 0 and pb.token_seq.tolist() == list(range(8))


def test_padded_decode_step_writes_no_page_and_keeps_the_real_rows_logits():
    """One decode step of three sequences, once as it is and once padded to a bucket of 6 (the
    engine's slots) and run on the graph's layout: the KV pools come out bit-identical (the
    padding rows wrote nothing) and the real rows' logits agree."""
    folder = make_model("qwen3")
    seqs, tokens, batch = decode_batch()
    a, b = engine(folder, False), engine(folder, False)
    # the same, nonzero context in both pools
    for eng in (a, b):
        rng = np.random.default_rng(0)
        for pool in (eng.model.cache.k_pool, eng.model.cache.v_pool):
            # bf16 in [2^-7, 1)
            pool[...] = rng.integers(0x3c00, 0x3f80, size=pool.shape, dtype=np.uint16)
    plain = a.model.forward(tokens, batch).copy()              # [3, V]
    ptok, pb = pad_decode_batch(tokens, batch, 6, max_blocks=16, max_context=64)
    padded = b.model.forward(ptok, pb).copy()                  # [6, V]
    assert np.isfinite(padded).all() and np.abs(plain).max() > 1
    np.testing.assert_allclose(padded[:3], plain, rtol=0, atol=1e-3 * np.abs(plain).max())
    assert (padded[:3].argmax(-1) == plain.argmax(-1)).all()
    for name in ("k_pool", "v_pool"):
        np.testing.assert_array_equal(getattr(b.model.cache, name), getattr(a.model.cache, name))


def test_graph_replays_give_the_eager_engines_tokens():
    """Requests arriving and finishing at different steps: the batch size moves between
    buckets, each bucket is captured once and replayed after; every token is the eager
    engine's, and no page leaks."""
    folder = make_model("qwen3")
    prompts = [list(range(40, 53)), [5, 9, 3], list(range(100, 107)), [300, 301], [77] * 5]
    lengths = [9, 4, 12, 6, 2]

    def go(graphs):
        eng = engine(folder, graphs)
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            eng.add_request(
                Request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            )
        out = {str(i): [] for i in range(len(prompts))}
        while eng.has_work():
            for ev in eng.step():
                out[ev.request_id].append(ev.token_id)
        assert eng.num_free_pages() == eng.num_total_pages()
        return out, eng

    expect, _ = go(False)
    got, eng = go(True)
    assert got == expect and [len(got[str(i)]) for i in range(5)] == lengths
    g = eng.graphs
    assert g.capture.captured == len(g.graphs) >= 2             # several buckets, one capture each
    assert g.num_replays > g.num_eager > 0                     # most decode steps were replays


def test_moe_models_and_eager_flag_run_without_graphs():
    assert not DecodeGraphs.capturable(LLMEngine(make_model("qwen3_moe"), max_ctx=32, slots=2,
                                                 page_size=4, num_pages=20, device="cpu",
                                                 progress=False).model)
    assert DecodeGraphs.capturable(engine(make_model("qwen3"), False).model)
    ap = __import__("argparse").ArgumentParser()
    ap.add_argument("--max-ctx", type=int, default=64)
    options.add_args(ap)
    on, off = ap.parse_args([]), ap.parse_args(["--no-cuda-graphs"])
    assert options.engine_kwargs(on)["enforce_eager"] is False
    assert options.engine_kwargs(off)["enforce_eager"] is True
    assert "cuda graphs" in options.describe(on) and "cuda graphs" not in options.describe(off)


class FailingCapture(CallCapture):
    def __call__(self, fn):
        raise RuntimeError("cudaErrorStreamCaptureUnsupported (planted)")


class FailingReplay(CallCapture):
    def replay(self, graph):
        raise RuntimeError("cudaErrorInvalidValue at the first launch (planted)")


@pytest.mark.parametrize("capture,eager_steps", [(FailingCapture, 1), (FailingReplay, 2)])
def test_a_failed_capture_or_replay_leaves_the_engine_eager_with_the_reason(capture, eager_steps):
    """A capture (or a graph's first launch) that raises, as CUDA does on an illegal call:
    that step still answers (eagerly, on the static buffers), every later step runs eagerly,
    and the tokens are the eager engine's."""
    folder = make_model("qwen3")
    prompts = [list(range(40, 53)), [5, 9, 3]]
    expect = run(engine(folder, False), prompts, 6)
    eng = engine(folder, False)
    eng.graphs = DecodeGraphs(eng.model, eng.inputs, 6, capture=capture())
    with pytest.warns(UserWarning, match="CUDA graph capture or replay failed"):
        got = run(eng, prompts, 6)
    assert got == expect and all(len(t) == 6 for t in got.values())
    assert "planted" in eng.graphs.error and not eng.graphs.graphs
    assert eng.graphs.num_eager == eager_steps and eng.graphs.num_replays == 0
