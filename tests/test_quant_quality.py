"""Quantization quality on a real pretrained model: the default SmolLM2-135M-Instruct.

Random-weight models cannot tell good quantization from bad (they have no
knowledge to lose); perplexity on real English text can.
"""
from pathlib import Path

import numpy as np
import pytest

from common.chat_template import ChatTemplate
from common.config import ModelConfig
from common.engine import Request
from common.models import resolve_model
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from stage1_cpu.fast import cpu
from stage1_cpu.engine import LLMEngine
from stage1_cpu.model import build_model
from stage1_cpu.weights import load_weights

TEXT = (Path(__file__).parent / "data" / "english.txt").read_text()


@pytest.fixture(scope="module")
def folder():
    return resolve_model("smollm2-135m", progress=False)


@pytest.fixture(scope="module")
def perplexities(folder):
    ids = Tokenizer(folder).encode(TEXT)
    assert 250 < len(ids) < 512
    result = {}
    for fmt, group in (("none", 32), ("int8", 32), ("int4", 32), ("int4_g64", 64)):
        # Group size 32, the engine's default (llama.cpp's Q8_0 / Q4_1 blocks are 32 wide too).
        # Caveat, measured here: the default model was published as Q4_1 (a 4-bit grid with an
        # fp16 scale and minimum per 32 weights; its embedding as Q8_0), so int4 at group 32
        # with a minimum, and an int8 embedding, land exactly back on that grid: perplexity
        # 20.156 for fp32 and int4 alike. At group 64 int4 must round a second time: 29.57
        # (+47 %). A model with full-precision weights would show int4's own loss.
        w = load_weights(folder, ModelConfig.from_folder(folder), fmt.split("_")[0], group,
                         progress=False)
        model = build_model(w, 512)
        logits = model.forward(np.array(ids), 0, all_logits=True)          # [T, V]
        logits = logits - logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        nll = -logp[np.arange(len(ids) - 1), ids[1:]]                     # predict token t+1 from t
        result[fmt] = float(np.exp(nll.mean()))
    return result


def test_fp32_perplexity_is_that_of_a_real_language_model(perplexities):
    # a random model scores ~ vocab size (49152); SmolLM2 on plain English is in the tens
    assert 2 < perplexities["none"] < 60, perplexities


def test_int8_perplexity_within_1_percent_of_fp32(perplexities):
    assert abs(perplexities["int8"] / perplexities["none"] - 1) < 0.01, perplexities


def test_int4_perplexity_within_10_percent_of_fp32(perplexities):
    # group 32 lands on the model's own Q4_1 grid (see above): measured 20.156 against 20.156,
    # so this bound holds with no loss at all; the next test is the one where int4 loses
    assert abs(perplexities["int4"] / perplexities["none"] - 1) < 0.10, perplexities


def test_int4_group_64_loses_perplexity_within_a_bound(perplexities):
    # Group 64 rounds the Q4_1 weights a second time: measured 29.57 against 20.156 for fp32
    # (x1.467). The bound allows x1.6; and a loss under x1.2 would mean the group-64 path did
    # not quantize what it says (it would be the group-32 result again).
    ratio = perplexities["int4_g64"] / perplexities["none"]
    assert 1.2 < ratio < 1.6, perplexities


@pytest.fixture(scope="module")
def random_model_logits():
    """A tiny random Qwen3 (bench/testbed/models.py) with full-precision weights, where int4 has no
    grid to land back on: logits [64, V] of a random prompt for fp32, int8 and int4."""
    from bench.testbed.models import make_model
    folder = make_model("qwen3")
    ids = np.random.default_rng(0).integers(3, 500, size=64)
    out = {}
    for fmt, group in (("none", 32), ("int8", 32), ("int4", 32), ("int4_g64", 64)):
        w = load_weights(folder, ModelConfig.from_folder(folder), fmt.split("_")[0], group,
                         progress=False)
        model = build_model(w, 128)
        out[fmt] = model.forward(ids, 0, all_logits=True)
    return out


def _agreement_and_error(logits, fmt):
    ref, q = logits["none"], logits[fmt]
    # top-1 agreement over 64 positions
    agree = float(np.mean(q.argmax(-1) == ref.argmax(-1)))
    rel_rms = float(np.sqrt(np.mean((q - ref) ** 2) / np.mean(ref ** 2)))
    max_err = float(np.abs(q - ref).max() / np.abs(ref).max())
    return agree, rel_rms, max_err


def test_int8_on_a_random_model_keeps_the_top_token_and_the_logits(random_model_logits):
    # measured: top-1 agreement 0.953, relative RMS error 0.023, max error 0.033 of the scale
    agree, rel_rms, max_err = _agreement_and_error(random_model_logits, "int8")
    assert agree >= 0.9 and rel_rms < 0.04 and max_err < 0.06, (agree, rel_rms, max_err)


def test_int4_on_a_random_model_against_fp32_by_top1_agreement_and_a_logit_bound(
        random_model_logits):
    # measured (group 32): top-1 agreement 0.594 (chance: 1/512), relative RMS error 0.258, max
    # error 0.267 of the scale; group 64: 0.594, 0.287, 0.336. Bounds: agreement >= 0.45, RMS
    # < 0.35, max < 0.45; and group 64 must lose more than group 32 (it rounds coarser)
    agree, rel_rms, max_err = _agreement_and_error(random_model_logits, "int4")
    assert agree >= 0.45 and rel_rms < 0.35 and max_err < 0.45, (agree, rel_rms, max_err)
    agree64, rel_rms64, max_err64 = _agreement_and_error(random_model_logits, "int4_g64")
    assert agree64 >= 0.45 and rel_rms64 < 0.35 and max_err64 < 0.45, (agree64, rel_rms64,
                                                                        max_err64)
    assert rel_rms64 > rel_rms


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_default_model_still_knows_the_capital_of_france(folder, fmt):
    tok = Tokenizer(folder)
    prompt = ChatTemplate.from_folder(folder).render(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    engine = LLMEngine(folder, quant=fmt, group_size=32, max_ctx=256, progress=False)
    engine.add_request(Request("q", tok.encode(prompt),
                               SamplingParams(temperature=0, max_tokens=16)))
    out = []
    while engine.has_work():
        out += [e.token_id for e in engine.step() if e.finish_reason != "stop"]
    assert "Paris" in tok.decode(out)


def _decode_perplexity(folder, ids, fmt, activations):
    """Perplexity with every position fed one at a time: the decode path, where
    int8 / int4 weights meet int8 activations (fast/weight.py, fast/simd.py)."""
    w = load_weights(folder, ModelConfig.from_folder(folder), fmt, 32, progress=False,
                     activations=activations)
    model = build_model(w, 512)
    nll = []
    for t in range(len(ids) - 1):
        logits = model.forward(np.array(ids[t:t + 1]), t).astype(np.float64)   # [V]
        logits -= logits.max()
        nll.append(np.log(np.exp(logits).sum()) - logits[ids[t + 1]])
    return float(np.exp(np.mean(nll)))


@pytest.mark.skipif(not cpu.INT8, reason="no int8 dot product here (VNNI, AVX2 or ARM dotprod)")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int8_activations_cost_under_one_percent_of_perplexity(folder, fmt):
    # Measured on the first 200 tokens: int8 weights 21.641 (fp32 activations) -> 21.753 with
    # int8 activations everywhere (+0.5 %); int4 21.500 -> 21.373 (-0.6 %): noise-sized either way.
    ids = Tokenizer(folder).encode(TEXT)[:200]
    exact = _decode_perplexity(folder, ids, fmt, "fp32")
    rounded = _decode_perplexity(folder, ids, fmt, "int8")
    assert exact != rounded                                    # the int8 path really ran
    assert abs(rounded / exact - 1) < 0.01, (exact, rounded)
