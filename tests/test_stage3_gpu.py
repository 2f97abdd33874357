"""Stage 3 on a GPU: the engine with device="cuda" gives transformers' greedy tokens (up to
the first near-tie, as in test_stage3_engine.py), and the CUDA-graph decode path gives the
eager path's tokens, with its graphs really captured and replayed.

Skipped as a whole where CuPy cannot see a GPU (the only skip allowed); bench/gpu_check.sh
runs these in its engine step (their names hold "engine") with QS_REQUIRE_GPU=1, which
turns that skip into a failure. The kernels themselves are checked against their twins on
the CPU under the emulator (test_stage3_cuda_emulated.py).
"""
from __future__ import annotations

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
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NO_GPU is not None, reason=str(WHY_NO_GPU))]

from common.engine import Request                          # noqa: E402
from common.sampling import SamplingParams                 # noqa: E402
from models import make_model                              # noqa: E402
from test_stage3_engine import GREEDY_PROMPTS, MARGIN, engine, hf_on_bf16_weights, run   # noqa: E402


# qwen3 (dense: its decode steps are graph replays) and qwen2_moe (biases, a shared expert, MoE
# routing: eager); the other families run the same kernels. Few, so the engine step keeps its cap.
@pytest.mark.parametrize("family", ["qwen3", "qwen2_moe"])
def test_engine_on_gpu_equals_transformers_until_a_near_tie(family):
    import torch
    folder = make_model(family)
    steps, prompt = 12, GREEDY_PROMPTS[family]
    hf = hf_on_bf16_weights(folder)
    ids, expect, margins = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([ids])).logits[0, -1].numpy()
            top2 = np.sort(logits)[-2:]
            margins.append(top2[1] - top2[0])
            expect.append(int(logits.argmax()))
            ids.append(expect[-1])
    clear = next((i for i, m in enumerate(margins) if m < MARGIN), steps)
    eng = engine(folder, device="cuda")
    got = run(eng, [prompt], steps)["0"]
    assert len(got) == steps and got[:clear] == expect[:clear], f"margins {np.round(margins, 3).tolist()}"
    if family == "qwen3":                                       # dense: its decode steps were graph replays
        assert eng.graphs is not None and eng.graphs.error is None and eng.graphs.num_replays > 0


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


def test_engine_padded_bucket_on_gpu_keeps_the_real_rows_logits():
    """Three sequences in the bucket of 4: one decode step through the graph path equals
    the eager step's logits within bf16 noise (cuBLAS may pick another kernel for 4 rows
    than for 3, so not bit for bit), and the padding row wrote no KV page."""
    import cupy
    from stage3_optimized.batch import build_batch
    folder = make_model("qwen3")
    eng = engine(folder, device="cuda", slots=4)
    for i, p in enumerate([list(range(40, 53)), [5, 9, 3, 17], list(range(100, 107))]):
        eng.add_request(Request(str(i), p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    eng.step()                                                  # the prefill: everybody's first token
    sched = eng.scheduler.schedule()
    seqs, tokens, batch = build_batch(sched.seqs, sched.num_tokens, eng.page_size)
    assert batch.num_decode == 3 and eng.graphs.can_run(batch)
    k_before = eng.model.cache.k_pool.copy()                    # [L, NB, P, Hkv, D]
    eager = eng.model.forward(cupy.asarray(tokens), batch.to(cupy)).get()
    k_eager = eng.model.cache.k_pool.copy()
    eng.graphs.run(tokens, batch)                               # bucket 4: warm-up, then capture
    graphed = eng.graphs.run(tokens, batch).get()               # the replay
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
    from stage3_optimized.ops import f32
    np.testing.assert_allclose(f32(after[:, real]), f32(ref[:, real]), rtol=2 ** -6, atol=1e-2)
