"""Quantization quality on a real pretrained model: the default SmolLM2-135M-Instruct.

Random-weight models cannot tell good quantization from bad (they have no
knowledge to lose); perplexity on real English text can.
"""
from pathlib import Path

import numpy as np
import pytest

from common.chat_template import ChatTemplate
from common.engine import Request
from common.models import resolve_model
from common.sampling import SamplingParams
from common.tokenizer import Tokenizer
from stage1_cpu.fast import cpu
from stage1_cpu.engine import LLMEngine
from stage1_cpu.model import Model
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
    for fmt in ("none", "int8", "int4"):
        # Group size 32, the engine's default (llama.cpp's Q8_0 / Q4_1 blocks are 32 wide too).
        # Caveat, measured here: the default model was published as Q4_1 (a 4-bit grid with an
        # fp16 scale and minimum per 32 weights; its embedding as Q8_0), so int4 at group 32
        # with a minimum, and an int8 embedding, land exactly back on that grid: perplexity
        # 20.156 for fp32 and int4 alike. At group 64 int4 must round a second time: 29.57
        # (+47 %). A model with full-precision weights would show int4's own loss.
        model = Model(load_weights(folder, fmt, 32, progress=False), 512)
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
    assert abs(perplexities["int4"] / perplexities["none"] - 1) < 0.10, perplexities


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_default_model_still_knows_the_capital_of_france(folder, fmt):
    tok = Tokenizer(folder)
    prompt = ChatTemplate.from_folder(folder).render(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    engine = LLMEngine(folder, quant=fmt, group_size=32, max_ctx=256, progress=False)
    engine.add_request(Request("q", tok.encode(prompt), SamplingParams(temperature=0, max_tokens=16)))
    out = []
    while engine.has_work():
        out += [e.token_id for e in engine.step() if e.finish_reason != "stop"]
    assert "Paris" in tok.decode(out)


def _decode_perplexity(folder, ids, fmt, activations):
    """Perplexity with every position fed one at a time: the decode path, where
    int8 / int4 weights meet int8 activations (fast/weight.py, fast/simd.py)."""
    model = Model(load_weights(folder, fmt, 32, progress=False, activations=activations), 512)
    nll = []
    for t in range(len(ids) - 1):
        logits = model.forward(np.array(ids[t:t + 1]), t).astype(np.float64)   # [V]
        logits -= logits.max()
        nll.append(np.log(np.exp(logits).sum()) - logits[ids[t + 1]])
    return float(np.exp(np.mean(nll)))


@pytest.mark.skipif(not cpu.INT8, reason="no int8 dot product here (AVX-512 VNNI / AVX-VNNI vpdpbusd, or AVX2 vpmaddubsw)")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_int8_activations_cost_under_one_percent_of_perplexity(folder, fmt):
    # Measured on the first 200 tokens: int8 weights 21.641 (fp32 activations) -> 21.753 with
    # int8 activations everywhere (+0.5 %); int4 21.500 -> 21.373 (-0.6 %): noise-sized either way.
    ids = Tokenizer(folder).encode(TEXT)[:200]
    exact = _decode_perplexity(folder, ids, fmt, "fp32")
    rounded = _decode_perplexity(folder, ids, fmt, "int8")
    assert exact != rounded                                    # the int8 path really ran
    assert abs(rounded / exact - 1) < 0.01, (exact, rounded)
