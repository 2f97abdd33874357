"""Tokenizer: text <-> token ids, read from a Hugging Face model folder or a GGUF file.

The folder's `tokenizer.json` holds the whole pipeline (normalizer, pre-tokenizer
regex, BPE vocab and merges, added tokens, decoder); the `tokenizers` library runs
it, so ids are identical to transformers'. A GGUF file keeps the vocabulary, merges
and special tokens in its metadata and names the pre-tokenizer; common/gguf.py
builds the same pipeline from them. Around it this file adds what the chat
and the server need:

  * the end-of-turn ids a model may stop on (generation_config.json, config.json
    and tokenizer_config.json each name some; Qwen3 uses <|im_end|> and <|endoftext|>),
  * the BOS rule (only when tokenizer_config.json says add_bos_token),
  * IncrementalDetokenizer, which turns a stream of ids into a stream of text
    without ever printing half a UTF-8 character.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from common.config import gguf_path, id_list, is_int, read_json


class TokenizerError(ValueError):
    """A model folder whose tokenizer cannot be loaded; the message says what to do."""


def token_text(value) -> str | None:
    """tokenizer_config.json writes a token as "text" or as {"content": "text", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class Tokenizer:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        g = gguf_path(folder)
        if g is not None:
            # a GGUF file: vocabulary, merges, pre-tokenizer and special tokens from its metadata
            from common.gguf import open_gguf    # GGUF code loads only for a GGUF model
            self._tok, tok_cfg, model_cfg = open_gguf(g).tokenizer_parts()
        else:
            self._tok = self._load_json(self.folder / "tokenizer.json")
            tok_cfg = read_json(self.folder / "tokenizer_config.json", TokenizerError)
            model_cfg = read_json(self.folder / "config.json", TokenizerError)
        gen_cfg = read_json(self.folder / "generation_config.json", TokenizerError)  # {} by a .gguf

        # --- token strings, for chat templates ({{ bos_token }}, {{ eos_token }}) ---
        self.bos_token: str | None = token_text(tok_cfg.get("bos_token"))
        self.eos_token: str | None = token_text(tok_cfg.get("eos_token"))

        # --- BOS: prepended by encode() only when the tokenizer config asks for it ---
        self.add_bos_token = bool(tok_cfg.get("add_bos_token", False))
        bos_id = self.token_to_id(self.bos_token) if self.bos_token else None
        if bos_id is None:
            bos_id = gen_cfg.get("bos_token_id", model_cfg.get("bos_token_id"))
        self.bos_token_id: int | None = bos_id
        if self.add_bos_token and not is_int(self.bos_token_id):
            raise TokenizerError(f"{self.folder / 'tokenizer_config.json'} sets add_bos_token but "
                                 "names no bos_token that the tokenizer knows; fix bos_token or "
                                 "set add_bos_token false")

        # --- end-of-turn ids: the union of what each file says, first mention first ---
        eos = id_list(gen_cfg.get("eos_token_id")) + id_list(model_cfg.get("eos_token_id"))
        eos = [i for i in eos if is_int(i)]            # ModelConfig names a bad one
        if self.eos_token and self.token_to_id(self.eos_token) is not None:
            eos.append(self.token_to_id(self.eos_token))
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))

    @staticmethod
    def _load_json(path: Path) -> HFTokenizer:
        if not path.is_file():
            from common.model_help import NO_TOKENIZER    # loads only for a folder without one
            raise TokenizerError(f"{path} not found: {NO_TOKENIZER}")
        try:
            return HFTokenizer.from_file(str(path))
        except BaseException as e:  # a plain Exception with its parse error, or a Rust panic
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise
            raise TokenizerError(
                f"{path} could not be loaded by the `tokenizers` library: {e}") from None

    # --- text <-> ids ---
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Added tokens written in the text (<|im_start|>,
        <think>, ...) become their single ids. A BOS is added only if the model's
        tokenizer_config.json says add_bos_token and the text does not already start
        with one (a chat template that writes {{ bos_token }} must not get two)."""
        # add_special_tokens=False: the tokenizer.json post-processor must not add
        # anything behind our back; the BOS rule is the one above, stated once.
        if len(text) < 8192:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        else:
            # the same ids, but encode_batch releases the GIL while it works (encode
            # holds it): the server tokenizes on a worker thread, and a long prompt
            # must not stop its event loop for seconds. A short text stays on encode:
            # it takes microseconds, and encode_batch would wait for a free thread
            # of the tokenizer's own pool, which long prompts may be holding.
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Bytes that are not valid UTF-8 (half a character) become U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included. The model's
        embedding table may be larger (Qwen3: 151,669 here, 151,936 rows there)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocab entry of an id (byte-level BPE writes a space as 'Ġ')."""
        return self._tok.id_to_token(token_id)

    def detokenizer(self, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Streams text for a stream of generated ids.

    Decoding one token at a time is wrong in two ways: a byte-level token can end
    in the middle of a multi-byte UTF-8 character (an emoji is often 2-4 tokens),
    and some decoders change a token's text depending on what precedes it (a
    SentencePiece "▁" is a space except at the start). So, like text-generation
    servers, keep a small window of ids: `prefix` is text already returned, and each
    add() decodes window + new ids; the part past the prefix is new text, returned
    only when it does not end in U+FFFD (the sign of a character still incomplete).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        # window start: ids[prefix_offset:read_offset] decode to text already returned
        self.prefix_offset = 0
        self.read_offset = 0     # ids before this have been returned as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feed one id; return the newly completed text ("" while a character is incomplete)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            # complete up to here: return the new part, slide the window forward
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full_text[len(prefix_text):]
        return ""    # nothing new yet, or a character still waits for its last bytes

    def flush(self) -> str:
        """The text still held back (at the end of generation); invalid bytes become U+FFFD."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]
