"""Read a GGUF file directly: config, tokenizer, chat template and weights from one file.

A GGUF file (llama.cpp's format; what ollama, LM Studio and llama.cpp users have) is
a header, key/value metadata (hyper-parameters, the tokenizer, the chat template),
a table of tensors (name, shape, GGML type, offset), then the tensors' bytes. This
module reads the header itself (a few dozen lines; the `gguf` package's reader takes
~25 s over a 150k-token vocabulary, this one a fraction of a second) and maps each
tensor's bytes when it is read; the `gguf` package dequantizes. It turns the file into what a
Hugging Face folder gives the engine:

  ModelConfig        from `{arch}.*` keys (GGUFFile.config_fields)
  tokenizer          byte-level BPE from tokenizer.ggml.* with the pre-tokenizer
                     that tokenizer.ggml.pre names
  chat template      tokenizer.chat_template
  weights            GGUFWeightLoader: WeightLoader's interface (layer / glob / fused
                     under the engine's short names), dequantized to float32, or kept
                     in stage 1's int8 / int4 layout (keep_quantized, gguf_quant.py)

A "GGUF model" is a .gguf file, or a folder that holds one .gguf file and no
config.json (the default demo's cache folder: the file plus generation_config.json
with its sampling defaults).

Two things are not a plain copy: names (blk.3.attn_q.weight is layer 3's "wq") and,
for llama-architecture files only, the rows of attn_q / attn_k, which llama.cpp's
converter reorders per head for its interleaved RoPE (gguf_convert.unpermute_rotary_rows
undoes it: a reorder of whole rows, exact for quantized rows too).
"""
from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from common import gguf_quant
from common.gguf_convert import (END_OF_TURN_TOKENS, TOKEN_CONTROL, TOKEN_NORMAL,
                                 TOKEN_USER_DEFINED, unpermute_rotary_rows)

if TYPE_CHECKING:
    from common.config import ModelConfig

# GGUF general.architecture -> our family
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen2moe": "qwen2_moe", "qwen3": "qwen3",
                 "qwen3moe": "qwen3_moe"}
SUPPORTED_VERSIONS = (2, 3)

# the engine's short name -> GGUF tensor name ({i} = layer); experts are one 3-D tensor [E, rows, C]
LAYER_NAMES = {
    "attn_norm": "blk.{i}.attn_norm.weight", "mlp_norm": "blk.{i}.ffn_norm.weight",
    "wq": "blk.{i}.attn_q.weight", "wk": "blk.{i}.attn_k.weight", "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "bq": "blk.{i}.attn_q.bias", "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias",
    "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight", "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
    "router": "blk.{i}.ffn_gate_inp.weight",
    "e_gate": "blk.{i}.ffn_gate_exps.weight", "e_up": "blk.{i}.ffn_up_exps.weight",
    "e_down": "blk.{i}.ffn_down_exps.weight",
    "s_gate": "blk.{i}.ffn_gate_shexp.weight", "s_up": "blk.{i}.ffn_up_shexp.weight",
    "s_down": "blk.{i}.ffn_down_shexp.weight",
    "shared_gate": "blk.{i}.ffn_gate_inp_shexp.weight",    # [C] in GGUF, [1, C] for us
}
GLOBAL_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                "lm_head": "output.weight"}
EXPERT_KEYS = ("e_gate", "e_up", "e_down")

# tokenizer.ggml.pre -> the regex that splits text before BPE (llama.cpp's llama-vocab.cpp
# names them; the Hugging Face tokenizer.json of each model has the same split)
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {
    "llama-bpe": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _REST,   # Llama 3
    "qwen2": _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _REST,            # Qwen2 / Qwen3
    "gpt2": None,           # GPT-2's own split (ByteLevel's regex)
    "smollm": None,         # GPT-2's split after every digit on its own
}
PRE_TOKENIZERS["deepseek-r1-qwen"] = PRE_TOKENIZERS["qwen2"]
PRE_TOKENIZERS["starcoder"] = PRE_TOKENIZERS["refact"] = None
DIGITS_FIRST = ("smollm", "starcoder", "refact")
NFC_FIRST = ("qwen2", "deepseek-r1-qwen")   # Qwen's tokenizer.json normalizes to NFC first


class GGUFError(ValueError):
    """A GGUF file this engine cannot run; the message names the file and what is wrong."""


_OPEN: dict = {}


def open_gguf(path: str | Path) -> "GGUFFile":
    """The parsed file, once per process (parsing a 150k-token vocabulary takes a moment)."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if key not in _OPEN:
        _OPEN[key] = GGUFFile(p)
    return _OPEN[key]


# GGUF value types (the metadata's type tags) -> struct format; 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


class _Cursor:
    """Reads the header's little-endian fields one after another. A length that runs past the
    bytes read so far raises struct.error (the caller reads a larger piece); one that runs past
    the end of the file, GGUFError."""

    def __init__(self, buf, path: Path, size: int):
        self.buf, self.at, self.path, self.size = buf, 0, path, size

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return v

    def need(self, n: int, what: str) -> None:
        """n more bytes of `what` must exist."""
        if self.at + n > self.size:
            raise GGUFError(f"{self.path}: {what} at byte {self.at} needs {n} bytes, past the end "
                            f"of the file ({self.size} bytes): the file is truncated or corrupt, "
                            "download it again")
        if self.at + n > len(self.buf):
            raise struct.error("past the bytes read")

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n, "a string")
        s = self.buf[self.at:self.at + n].decode("utf-8", errors="replace")
        self.at += n
        return s

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            item, n = self.scalar("<I"), self.scalar("<Q")
            self.need(n * (np.dtype(_NUMPY[item]).itemsize if item in _NUMPY else 8), "an array")
            if item in _NUMPY:      # numbers: one read for the whole array (token types, scores)
                dt = np.dtype(_NUMPY[item])
                a = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.at)
                self.at += n * dt.itemsize
                return a.tolist()
            return [self.value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise struct.error(f"unknown metadata value type {kind}")
        return self.scalar(_SCALARS[kind])


class Tensor:
    """One entry of the tensor table; `data` maps its bytes when asked (and only then)."""

    def __init__(self, path: Path, name: str, dims: list[int], ttype, offset: int):
        import gguf

        (self.path, self.name, self.shape,
         self.tensor_type, self.data_offset) = path, name, dims, ttype, offset
        block, size = gguf.GGML_QUANT_SIZES[ttype]
        if min(dims) < 1 or dims[0] % block:
            raise GGUFError(f"{path}: tensor {name!r} has dims {dims}; each must be >= 1 and the "
                            f"first a multiple of {block} for {ttype.name}")
        self.n_bytes = math.prod(dims) * size // block     # Python ints: no overflow for any dims
        rows = tuple(reversed(dims))                       # numpy order: slowest first
        self._np = {"F32": (np.float32, rows), "F16": (np.float16, rows),
                    "BF16": (np.uint16, rows)}.get(
            ttype.name, (np.uint8, rows[:-1] + (rows[-1] // block * size,)))

    @property
    def data(self) -> np.ndarray:
        """The tensor's bytes, memory-mapped: float types as their values, blocks as uint8
        rows [..., row_bytes]. A mapping per tensor, dropped by the caller once converted,
        so the file's pages leave the process again."""
        dtype, shape = self._np
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_offset, shape=shape)


class GGUFFile:
    """The header of a GGUF file: magic "GGUF", version, tensor and key counts, the
    key/value metadata, the tensor table, then (aligned) the tensors' bytes."""

    def __init__(self, path: Path):
        import gguf

        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
        if len(head) < 8 or head[:4] != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (it does not start with the magic 'GGUF'); "
                            "pass a .gguf file from llama.cpp / ollama / LM Studio, or a "
                            "Hugging Face folder")
        (version,) = struct.unpack("<I", head[4:])
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{path}: GGUF version {version} is not supported (supported: "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        # the header is read into memory (bytes slice fast), a larger piece if it is longer
        chunk = 1 << 24
        while True:
            with open(path, "rb") as f:
                buf = f.read(chunk)
            try:
                self.meta, table, end = self._parse(_Cursor(buf, path, size))
                break
            except GGUFError:
                raise
            # a field cut short, a length past the end
            except (struct.error, ValueError, IndexError) as e:
                if len(buf) < chunk:
                    raise GGUFError(f"{path}: the GGUF header cannot be read ({e}); the file is "
                                    "truncated or corrupt, download it again") from None
                chunk *= 4
        align = self.meta.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or align < 1:
            raise GGUFError(f"{path}: general.alignment is {align!r}; expected a whole number >= 1")
        start = -(-end // align) * align                # the data begins at the next aligned byte
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str) or arch not in ARCHITECTURES:
            raise GGUFError(f"{path}: architecture {arch!r} is not supported; supported GGUF "
                            f"architectures: {', '.join(ARCHITECTURES)}")
        self.arch = arch
        self.tensors = {}
        for name, dims, kind, offset in table:
            try:
                ttype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise GGUFError(
                    f"{path}: tensor {name!r} has an unknown GGML type {kind}") from None
            gguf_quant.check_type(ttype.name, name)
            t = Tensor(path, name, dims, ttype, start + offset)
            if t.data_offset + t.n_bytes > size:
                raise GGUFError(f"{path}: tensor {name!r} ends at byte "
                                f"{t.data_offset + t.n_bytes} but the file has {size} bytes: "
                                "the file is truncated, download it again")
            self.tensors[name] = t

    @staticmethod
    def _parse(cur: _Cursor):
        cur.at = 8
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        cur.need(n_kv * 13 + n_tensors * 32, f"the table of {n_kv} keys and {n_tensors} tensors")
        meta = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"))
        table = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if not 1 <= n_dims <= 4:
                raise GGUFError(f"{cur.path}: tensor {name!r} has {n_dims} dimensions, not 1 to 4")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            table.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
        return meta, table, cur.at

    # --- config and tokens ---
    def config_fields(self) -> dict:
        """The fields of common.config.ModelConfig, from the `{arch}.*` metadata keys and the
        tensor table (shapes in GGUF order, fastest dimension first). What the metadata does
        not say, the tensors do: the vocabulary (token_embd's rows), tied embeddings (no
        output.weight), q/k/v biases, and which layers are MoE (those with ffn_gate_exps)."""
        meta, arch = self.meta, self.arch
        family = ARCHITECTURES[arch]
        shapes = {n: tuple(int(d) for d in t.shape) for n, t in self.tensors.items()}

        def number(key: str, default=None, least: int = 1):
            """The key `{arch}.{key}`: a whole number >= least (for the two real-valued keys, a
            finite number > 0); the default when it is absent, an error when it is required."""
            full = f"{arch}.{key}"
            real = key in ("rope.freq_base", "attention.layer_norm_rms_epsilon")
            if full not in meta:
                if default is None:
                    raise GGUFError(f"{self.path}: the GGUF file has no '{full}' key; it is "
                                    f"incomplete or not a {arch} model")
                return default
            v = meta[full]
            if real:
                ok = isinstance(v, (int, float)) and 0 < v < math.inf
            else:
                ok = isinstance(v, int) and v >= least
            if isinstance(v, bool) or not ok:
                raise GGUFError(f"{self.path}: '{full}' is {v!r}; expected "
                                + ("a finite number > 0" if real else f"a whole number >= {least}"))
            return v

        scaling = meta.get(f"{arch}.rope.scaling.type", "none")
        if "rope_freqs.weight" in shapes or scaling not in ("none", None):
            raise GGUFError(f"{self.path}: the file uses RoPE scaling (rope_freqs / "
                            "rope.scaling.type), which is not read from GGUF files; use the "
                            "model's Hugging Face folder")
        if "token_embd.weight" not in shapes:
            raise GGUFError(f"{self.path}: the GGUF file has no token_embd.weight tensor")
        hidden, heads = number("embedding_length"), number("attention.head_count")
        head_dim = number("attention.key_length", max(1, hidden // heads))
        if number("rope.dimension_count", head_dim) != head_dim:
            raise GGUFError(f"{self.path}: partial rotary embedding (rope dimension "
                            f"{meta.get(f'{arch}.rope.dimension_count')} < head dim {head_dim}) "
                            "is not supported")
        layers = number("block_count")
        self._check_layers(layers)               # before anything counts or loops over them
        moe = arch.endswith("moe")                  # qwen2moe, qwen3moe
        dense = ([i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" not in shapes]
                 if moe else [])
        # float32 1e-6 -> 1e-06
        eps = float(str(np.float32(number("attention.layer_norm_rms_epsilon"))))
        return dict(
            family=family,
            vocab_size=int(shapes["token_embd.weight"][-1]),
            hidden_size=hidden,
            intermediate_size=number("feed_forward_length", 0, least=0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=number("attention.head_count_kv", heads),
            head_dim=head_dim,
            rope_theta=float(number("rope.freq_base", 10000.0)),
            qkv_bias="blk.0.attn_q.bias" in shapes,
            rms_norm_eps=eps,
            tie_word_embeddings="output.weight" not in shapes,
            max_position_embeddings=number("context_length", 32768),
            num_experts=number("expert_count") if moe else 0,
            num_experts_per_tok=number("expert_used_count") if moe else 0,
            moe_intermediate_size=number("expert_feed_forward_length") if moe else 0,
            # llama.cpp renormalises the chosen experts' weights for qwen3moe, never for qwen2moe
            norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", family == "qwen3_moe")),
            mlp_only_layers=dense,
            shared_expert_intermediate_size=(number("expert_shared_feed_forward_length")
                                             if family == "qwen2_moe" else 0),
            bos_token_id=self.special_id("bos_token_id"),
            eos_token_ids=self.eos_ids(),
        )

    def _check_layers(self, layers: int) -> None:
        """The block count is the number of layers whose tensors the file holds: blk.0 ..."""
        names = (n.split(".") for n in self.tensors)
        found = {int(p[1]) for p in names if len(p) > 2 and p[0] == "blk" and p[1].isdecimal()}
        if len(found) != layers or max(found, default=-1) != layers - 1:
            raise GGUFError(f"{self.path}: '{self.arch}.block_count' is {layers}, but the file "
                            f"holds the tensors of {len(found)} layers; the file is corrupt")

    def special_id(self, key: str) -> int | None:
        """tokenizer.ggml.{key} (bos_token_id, eos_token_id): a token of the vocabulary, or None."""
        i = self.meta.get(f"tokenizer.ggml.{key}")
        n = len(self.meta.get("tokenizer.ggml.tokens") or [])
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n):
            raise GGUFError(f"{self.path}: tokenizer.ggml.{key} is {i!r}, not a token id < {n}")
        return i

    def eos_ids(self) -> list[int]:
        """The file's eos id first, then the control tokens that end a turn by their text
        (llama.cpp stops on both)."""
        meta = self.meta
        tokens, types = (meta.get("tokenizer.ggml.tokens") or [],
                         meta.get("tokenizer.ggml.token_type") or [])
        eos = self.special_id("eos_token_id")
        ids = [] if eos is None else [eos]
        for i, (tok, kind) in enumerate(zip(tokens, types)):
            if kind == TOKEN_CONTROL and tok in END_OF_TURN_TOKENS and i not in ids:
                ids.append(i)
        return ids

    def token_text(self, key: str) -> str | None:
        i = self.special_id(key)
        return None if i is None else self.meta["tokenizer.ggml.tokens"][i]

    def tokenizer(self):
        """A `tokenizers.Tokenizer` equal to the byte-level BPE the metadata describes."""
        meta = self.meta
        missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens",
                               "tokenizer.ggml.merges")
                   if k not in meta]
        if missing:
            raise GGUFError(f"{self.path}: the GGUF file has no tokenizer metadata "
                            f"({', '.join(missing)} missing); use a file converted with its "
                            "tokenizer (llama.cpp's convert_hf_to_gguf.py writes it) or the "
                            "model's Hugging Face folder")
        if meta["tokenizer.ggml.model"] != "gpt2":
            raise GGUFError(f"{self.path}: tokenizer type {meta['tokenizer.ggml.model']!r} is not "
                            "supported; only byte-level BPE ('gpt2', as Qwen, Llama 3 and SmolLM "
                            "use)")
        pre = meta.get("tokenizer.ggml.pre", "gpt2")
        if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
            raise GGUFError(f"{self.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not "
                            f"supported; supported: {', '.join(PRE_TOKENIZERS)}")
        tokens = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        merges = self._check_tokens(tokens, types, meta["tokenizer.ggml.merges"])
        try:
            return self._build_tokenizer(pre, tokens, types, merges)
        except BaseException as e:      # a Rust panic arrives as PanicException, a BaseException
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise
            raise GGUFError(f"{self.path}: the tokenizers library refused it: {e}") from None

    def _check_tokens(self, tokens, types, merges) -> list[tuple[str, str]]:
        """The vocabulary and merges as the BPE needs them, checked as they are read: every token a
        string with a type, every merge two tokens whose join is a token too (the `tokenizers`
        library panics on a join it does not know) -> the merges as pairs."""
        where = f"{self.path}: tokenizer.ggml"
        if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
            raise GGUFError(f"{where}.tokens must be a list of strings")
        if not (isinstance(types, list) and len(types) == len(tokens)
                and all(isinstance(k, int) for k in types)):
            raise GGUFError(f"{where}.token_type must give each of the {len(tokens)} tokens a type")
        if not isinstance(merges, list):
            raise GGUFError(f"{where}.merges must be a list of strings")
        vocab, pairs = set(tokens), []
        for i, m in enumerate(merges):
            pair = m.split(" ", 1) if isinstance(m, str) else []
            if len(pair) != 2 or not all(p in vocab for p in pair) or "".join(pair) not in vocab:
                raise GGUFError(f"{where}.merges[{i}] is {m!r}; expected two tokens of the "
                                "vocabulary separated by a space, whose join is a token too")
            pairs.append((pair[0], pair[1]))
        return pairs

    def _build_tokenizer(self, pre: str, tokens: list[str], types: list[int], merges: list):
        from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                                pre_tokenizers)

        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        if pre in NFC_FIRST:
            tok.normalizer = normalizers.NFC()
        steps = []
        if pre in DIGITS_FIRST:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if PRE_TOKENIZERS[pre] is None:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps += [pre_tokenizers.Split(Regex(PRE_TOKENIZERS[pre]), behavior="isolated",
                                           invert=False),
                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == TOKEN_CONTROL])
        user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
                if k == TOKEN_USER_DEFINED]
        if user:
            tok.add_tokens(user)
        return tok

    def tokenizer_parts(self) -> tuple:
        """What common/tokenizer.py reads from a model folder: the tokenizer, and the fields of
        tokenizer_config.json and config.json it needs."""
        ids = {"eos_token_id": self.eos_ids(), "bos_token_id": self.special_id("bos_token_id")}
        return self.tokenizer(), self.tokenizer_config(), ids

    def chat_template(self, builtin: str) -> tuple[str, str | None, str | None, str]:
        """ChatTemplate's arguments: tokenizer.chat_template (`builtin` for a file without one),
        the bos and eos tokens' text, and where the template came from."""
        cfg = self.tokenizer_config()
        text = cfg.get("chat_template")
        if isinstance(text, str) and text.strip():
            name = f"{self.path.name} tokenizer.chat_template"
            return text, cfg["bos_token"], cfg["eos_token"], name
        return builtin, cfg["bos_token"], cfg["eos_token"], "built-in ChatML template"

    def tokenizer_config(self) -> dict:
        """What tokenizer_config.json would say: BOS rule, special tokens, chat template."""
        cfg = {"add_bos_token": bool(self.meta.get("tokenizer.ggml.add_bos_token", False)),
               "bos_token": self.token_text("bos_token_id"),
               "eos_token": self.token_text("eos_token_id")}
        if "tokenizer.chat_template" in self.meta:
            cfg["chat_template"] = self.meta["tokenizer.chat_template"]
        return cfg

    def describe(self) -> str:
        """Which GGML types the matrices have and what stage 1 keeps each as, for the banner."""
        kinds = {}
        for t in self.tensors.values():
            if len(t.shape) >= 2:
                kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
        return ", ".join(f"{k} -> {gguf_quant.MAPPINGS[k]}"
                         for k in sorted(kinds, key=lambda k: -kinds[k]))


class GGUFWeightLoader:
    """WeightLoader's interface over a GGUF file.

    loader = GGUFWeightLoader(path)
    loader.layer("wq", 3)                     # float32 [H*D, C], dequantized (stages 2, 3; --quant)
    GGUFWeightLoader(path, keep_quantized=True).layer("wq", 3)
                                              # gguf_quant.Packed in stage 1's int8 / int4 layout
                                              # (float32 for F32 / F16 / BF16 tensors)
    """

    def __init__(self, path: str | Path, config: ModelConfig, keep_quantized: bool = False):
        self.file = open_gguf(path)
        self.folder = self.file.path
        self.config = config
        self.keep_quantized = keep_quantized
        self.describe = self.file.describe

    def names(self) -> list[str]:
        return sorted(self.file.tensors)

    def __contains__(self, name: str) -> bool:
        """A Hugging Face name (lm_head.weight, ...) or a GGUF name."""
        if name == "lm_head.weight":
            name = GLOBAL_NAMES["lm_head"]
        return name in self.file.tensors

    def _tensor(self, name: str):
        if name not in self.file.tensors:
            raise GGUFError(f"{self.file.path}: tensor {name!r} not found; the file is incomplete "
                            f"or not a {self.file.arch} model")
        return self.file.tensors[name]

    def _read(self, name: str, key: str, expert: int | None, rows: slice | None, expected):
        """One tensor (one expert of a 3-D one) as float32 or Packed, rows [O, C] like
        Hugging Face."""
        t = self._tensor(name)
        qtype = t.tensor_type.name
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))   # numpy order
        if expert is not None:
            if len(shape) != 3 or shape[0] != self.config.num_experts:
                raise GGUFError(f"{self.file.path}: tensor {name!r} has shape {list(shape)}, "
                                f"expected {self.config.num_experts} experts (the file's metadata)")
            shape = shape[1:]
        if (expected is not None and int(np.prod(shape)) == int(np.prod(expected))
                and len(shape) != len(expected)):
            # shared_gate: [C] in the file, [1, C] here
            shape = tuple(expected)
        if expected is not None and shape != tuple(expected):
            raise GGUFError(f"{self.file.path}: tensor {name!r} has shape {list(shape)}, expected "
                            f"{list(expected)} from the file's metadata")
        data = t.data if expert is None else t.data[expert]
        perm = None
        if self.file.arch == "llama" and key in ("wq", "wk"):
            heads = self.config.num_heads if key == "wq" else self.config.num_kv_heads
            # an exact row reorder
            perm = unpermute_rotary_rows(np.arange(shape[0])[:, None], heads)[:, 0]
        if rows is not None:
            idx = np.arange(shape[0])[rows] if perm is None else perm[rows]
        else:
            idx = perm
        if self.keep_quantized and len(shape) == 2 and qtype not in gguf_quant.FLOAT_TYPES:
            raw = data.reshape(shape[0], -1)
            if idx is not None:
                raw = raw[idx]
            return gguf_quant.repack(raw, qtype, shape[1], name)
        return self._float(data, t.tensor_type, shape, idx, name)

    def _float(self, data, ttype, shape, idx, name):
        from gguf.quants import dequantize
        qtype = ttype.name
        if qtype in gguf_quant.FLOAT_TYPES:
            if qtype == "BF16":
                a = (np.asarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                a = np.asarray(data)
            a = a.reshape(shape)
            a = a if idx is None else a[idx]
            return np.ascontiguousarray(a, dtype=np.float32)
        raw = data.reshape(shape[0], -1) if len(shape) == 2 else data
        if idx is not None:
            raw = raw[idx]
        out = np.ascontiguousarray(dequantize(np.ascontiguousarray(raw), ttype), dtype=np.float32)
        return out.reshape(-1, shape[1]) if len(shape) == 2 else out.reshape(shape)

    def layer(self, key: str, layer: int, expert: int | None = None, dtype=np.float32):
        name, shape = LAYER_NAMES[key].format(i=layer), self.config.expected_shape(key)
        return self._read(name, key, expert if key in EXPERT_KEYS else None, None, shape)

    def glob(self, key: str, dtype=np.float32, rows: slice | None = None):
        """A model-wide tensor: embed, final_norm, lm_head (the embedding when tied)."""
        if key == "lm_head" and GLOBAL_NAMES["lm_head"] not in self.file.tensors:
            key = "embed"
        return self._read(GLOBAL_NAMES[key], key, None, rows, self.config.expected_shape(key))

    def fused(self, keys: list[str], layer: int, expert: int | None = None, dtype=np.float32):
        """Several projections of one layer stacked by rows (WeightLoader.fused)."""
        parts = [self.layer(k, layer, expert) for k in keys]
        if (isinstance(parts[0], gguf_quant.Packed)
                and all(isinstance(p, gguf_quant.Packed) for p in parts)):
            return gguf_quant.concat(parts)
        return np.concatenate([p.dequantize() if isinstance(p, gguf_quant.Packed) else p
                               for p in parts])
