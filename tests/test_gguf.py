"""GGUF files read directly (common/gguf.py, common/gguf_quant.py), without an engine:
the block repacking against the `gguf` package's own dequantizer, the loader against
transformers reading the same file, the tokenizer against the folder it came from,
and one clear error for each kind of bad file.

Files are written by common/gguf_write.py from tiny random models (rows multiples of
32: hidden 128, experts 64 wide); K-quant blocks are crafted from random bytes (rows of
256), since the `gguf` package cannot write them. Nothing is downloaded.
"""
from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest

from bench.testbed.models import make_model
from common import gguf_quant as gq

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

T = gguf.GGMLQuantizationType
# the shapes of every file here: rows (in_features) multiples of 32
SHAPE = dict(hidden_size=128)
MOE = dict(hidden_size=128, moe_intermediate_size=64)
FAMILY_KW = {"qwen3": SHAPE, "llama": SHAPE, "qwen2": SHAPE, "qwen3_moe": MOE,
             "qwen2_moe": dict(MOE, shared_expert_intermediate_size=96)}

_files: dict = {}


def gguf_file(family: str, qtype: str, tmp_root) -> tuple:
    """(HF folder, GGUF file of it in qtype), written once per session."""
    from common.gguf_write import write_gguf
    key = (family, qtype)
    if key not in _files:
        folder = make_model(family, **FAMILY_KW[family])
        path = tmp_root / f"{family}-{qtype}.gguf"
        write_gguf(folder, path, qtype)
        _files[key] = (folder, path)
    return _files[key]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


# ----------------------------------------------------------------------------- block repacking

def _weights(rows=6, cols=96, seed=0):
    """cols = 3 groups of 32: an odd count, so int4 needs its padded group."""
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


@pytest.mark.parametrize("qtype,fmt",
                         [("Q8_0", "int8"), ("Q5_0", "int8"), ("Q4_0", "int4"), ("Q4_1", "int4")])
def test_exact_mappings_are_bit_exact_against_gguf_dequantize(qtype, fmt):
    raw = quantize(_weights(), T[qtype])
    ref = dequantize(raw, T[qtype])                     # the gguf package's reading of the bytes
    p = gq.repack(raw, qtype, 96)
    assert p.fmt == fmt and p.group_size == 32 and p.scales.dtype == np.uint16
    assert p.data.shape == ((6, 3, 32) if fmt == "int8" else (6, 2, 32))   # int4: G = 3 padded to 4
    np.testing.assert_array_equal(p.dequantize(), ref)
    assert np.abs(ref).max() > 1.0


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_repacked_arrays_are_stage1s_own_layout(qtype):
    """The same bytes stage 1's quantize writes when it quantizes the dequantized values
    at group 32 (it reproduces a 4-bit / 8-bit grid exactly): layout, nibble order, padded
    group, fp16 scales and minimums. Q4_0 only differs in how its minimum is found, so only
    the values are compared there."""
    from stage1_cpu.quant import quantize as s1_quantize
    raw = quantize(_weights(8, 160, seed=1), T[qtype])
    p = gq.repack(raw, qtype, 160)
    w = s1_quantize(p, p.fmt)                           # stage 1's hook: taken as it is
    np.testing.assert_array_equal(w.dequantize(), dequantize(raw, T[qtype]))
    again = s1_quantize(dequantize(raw, T[qtype]), p.fmt, 32)
    assert again.data.shape == p.data.shape
    if qtype != "Q4_0":
        np.testing.assert_array_equal(again.data, p.data)
        np.testing.assert_array_equal(again.scales, p.scales)


def _kquant_blocks(qtype: str, rows: int, n_blocks: int,
                   seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Valid K-quant bytes: random everywhere, the fp16 super-block scales set to small
    finite values (random bits could be inf / NaN)."""
    size = gguf.GGML_QUANT_SIZES[T[qtype]][1]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, n_blocks, size), dtype=np.uint8)
    scales = ((rng.random((rows, n_blocks, 2)) * 0.01 + 1e-3) * scale).astype(np.float16)
    scales = scales.view(np.uint8)
    if qtype == "Q6_K":
        b[..., -2:] = scales[..., :2]                    # d is the last field
    else:
        b[..., :4] = scales.reshape(rows, n_blocks, 4)   # d, dmin first
    return b.reshape(rows, -1)


# the largest error of each mapping, relative to the largest |weight| of the tensor (measured
# on these random blocks: Q4_K 3.5e-4 (fp16 rounding of d*sc and dmin*m), Q5_K 3.7e-3,
# Q6_K 3.9e-3, Q5_1 ~4e-3 (int8's rounding, at most half of max|W| / 127 per group))
KQUANT_BOUNDS = {"Q4_K": ("int4", 1e-3), "Q5_K": ("int8", 4e-3), "Q6_K": ("int8", 4e-3),
                 "Q5_1": ("int8", 4e-3)}


@pytest.mark.parametrize("qtype", list(KQUANT_BOUNDS))
def test_kquant_and_q5_1_mappings_stay_within_their_stated_error(qtype):
    if qtype == "Q5_1":
        raw = quantize(_weights(8, 512, seed=2), T.Q5_1)
    else:
        raw = _kquant_blocks(qtype, 8, 2)
    ref = dequantize(raw, T[qtype])
    p = gq.repack(raw, qtype, 512)
    fmt, bound = KQUANT_BOUNDS[qtype]
    err = np.abs(p.dequantize() - ref).max() / np.abs(ref).max()
    assert p.fmt == fmt
    # not exact (so the test measures something)
    assert 0 < err < bound, err


def test_q4_k_keeps_its_nibbles_byte_for_byte():
    """Q4_K's 32-byte runs are stage 1's int4 pairs already: data is the qs bytes as stored."""
    raw = _kquant_blocks("Q4_K", 3, 2, seed=4)
    p = gq.repack(raw, "Q4_K", 512)
    qs = raw.reshape(3, 2, 144)[..., 16:].reshape(3, 8, 32)
    np.testing.assert_array_equal(p.data, qs)


def test_q8_0_block_holding_minus_128_is_requantized_with_a_warning():
    """The choice for -128 (outside stage 1's int8 range, which its AVX2 path relies on):
    requantize that block from its values, warn with the tensor's name; other blocks stay exact."""
    raw = quantize(_weights(2, 64), T.Q8_0).copy()
    raw[0, 2 + 5] = 0x80                                 # block 0 of row 0: q[5] = -128
    ref = dequantize(raw, T.Q8_0)
    with pytest.warns(UserWarning, match=r"blk\.0\.attn_q\.weight: 1 Q8_0 block\(s\) hold -128"):
        p = gq.repack(raw, "Q8_0", 64, "blk.0.attn_q.weight")
    assert p.data.min() >= -127
    out = p.dequantize()
    np.testing.assert_array_equal(out[1], ref[1])
    np.testing.assert_array_equal(out[0, 32:], ref[0, 32:])
    assert np.abs(out[0, :32] - ref[0, :32]).max() <= np.abs(ref[0, :32]).max() / 127
    with warnings.catch_warnings():
        warnings.simplefilter("error")                   # a clean file: no warning
        gq.repack(quantize(_weights(2, 64), T.Q8_0), "Q8_0", 64)


def test_q4_0_with_a_scale_too_large_for_fp16_minimum_becomes_int8_exactly():
    raw = quantize(_weights(2, 64) * 1e5, T.Q4_0)       # |d| ~ 4e4 > 8188: -8d overflows fp16
    p = gq.repack(raw, "Q4_0", 64)
    assert p.fmt == "int8"
    np.testing.assert_array_equal(p.dequantize(), dequantize(raw, T.Q4_0))


def test_mixed_formats_fuse_into_int8():
    a = gq.repack(quantize(_weights(4, 64), T.Q4_1), "Q4_1", 64)
    b = gq.repack(quantize(_weights(2, 64, 5), T.Q8_0), "Q8_0", 64)
    f = gq.concat([a, b])
    assert f.fmt == "int8" and f.out_features == 6
    np.testing.assert_array_equal(f.dequantize()[4:], b.dequantize())
    assert np.abs(f.dequantize()[:4] - a.dequantize()).max() < np.abs(a.dequantize()).max() / 127


# ----------------------------------------------------------------------------- the loader

@pytest.mark.parametrize("family", list(FAMILY_KW))
def test_every_tensor_dequantized_equals_transformers_reading_the_file(family, root):
    """Names, expert slicing, the shared-expert gate's shape and llama's Q/K row order, against
    transformers' own GGUF reader (config from the source folder: transformers does not read
    head_dim or the expert widths of every architecture from the metadata)."""
    import torch
    import transformers as tf

    from common.config import ModelConfig
    from common.loader import LAYER_NAMES, GLOBAL_NAMES, WeightLoader, open_weights
    folder, path = gguf_file(family, "Q8_0", root)
    ours = open_weights(path, ModelConfig.from_folder(path))
    ref = tf.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32,
        config=tf.AutoConfig.from_pretrained(folder)).state_dict()
    hf = WeightLoader(folder)
    cfg = ours.config
    assert cfg == hf.config or ((cfg.family, cfg.num_layers, cfg.num_experts)
                                == (hf.config.family, 2, hf.config.num_experts))
    checked = 0
    for key, pattern in LAYER_NAMES.items():
        for e in (range(cfg.num_experts) if key.startswith("e_") else [None]):
            name = pattern.format(i=1, e=e)
            if name not in ref:
                continue
            np.testing.assert_array_equal(ours.layer(key, 1, e), ref[name].numpy(), err_msg=name)
            checked += 1
    for key, name in GLOBAL_NAMES.items():
        if name in ref:
            np.testing.assert_array_equal(ours.glob(key), ref[name].numpy(), err_msg=name)
    assert checked >= 9
    # quantized for real: not the source weights
    assert not np.array_equal(ours.layer("wq", 1), hf.layer("wq", 1))


def test_config_from_metadata_equals_the_source_folders(root):
    from common.config import ModelConfig
    for family in FAMILY_KW:
        folder, path = gguf_file(family, "Q8_0", root)
        ours, src = ModelConfig.from_folder(path), ModelConfig.from_folder(folder)
        if family == "qwen2_moe":
            assert (ours.norm_topk_prob, src.norm_topk_prob) == (False, False)
        assert ours == src, family


def test_llama_q_rows_come_back_in_hugging_face_order_when_kept_quantized(root):
    """The row reorder applies to the packed rows too (an exact reorder, no arithmetic)."""
    from common.config import ModelConfig
    from common.loader import WeightLoader, open_weights
    folder, path = gguf_file("llama", "Q4_1", root)
    cfg = ModelConfig.from_folder(path)
    packed = open_weights(path, cfg, keep_quantized=True).layer("wq", 0)
    assert isinstance(packed, gq.Packed) and packed.fmt == "int4"
    np.testing.assert_array_equal(packed.dequantize(), open_weights(path, cfg).layer("wq", 0))
    src = WeightLoader(folder).layer("wq", 0)
    assert np.abs(packed.dequantize() - src).max() < 0.2 * np.abs(src).max()   # near the source ...
    raw = open_weights(path, cfg).file.tensors["blk.0.attn_q.weight"].data
    raw_rows = dequantize(np.asarray(raw), T.Q4_1)
    # ... the file's order is not
    assert np.abs(raw_rows - src).max() > 0.5 * np.abs(src).max()


# ------------------------------------------------------------------- tokenizer and template

def _tokenizer_file(tmp_path, folder, arch="qwen3", pre="qwen2"):
    """A GGUF file that holds the folder's tokenizer and template and one tiny tensor."""
    from common.gguf_write import _tokenizer_metadata
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    _tokenizer_metadata(w, folder, {"vocab_size": 151669, "eos_token_id": [151645, 151643]}, pre)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen_tokenizer_from_metadata_encodes_like_its_tokenizer_json(qwen3_tokenizer_dir,
                                                                       tmp_path):
    """tokenizer.ggml.* + pre 'qwen2' rebuilt into the same pipeline as Qwen's tokenizer.json
    (NFC, Qwen's regex, byte-level BPE, the special tokens), checked id for id, and the
    template and special ids from the file."""
    from common.chat_template import ChatTemplate
    from common.tokenizer import Tokenizer
    path = _tokenizer_file(tmp_path, qwen3_tokenizer_dir)
    ours, ref = Tokenizer(path), Tokenizer(qwen3_tokenizer_dir)
    texts = ["Hello world", "The year 2024 had 366 days; pi is 3.14159!",
             "  spaces\n\n\ttabs\r\n  ", "héllo wörld, 日本語 🤗", "e\u0301 (combining)",
             "<|im_start|>user\nhi<|im_end|>", "I'm sure they've said it'll work",
             "x = 12345678 + y_1"]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text))
    assert ours.eos_token_ids[:2] == [151645, 151643]
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert (ChatTemplate.from_folder(path).render(msgs)
            == ChatTemplate.from_folder(qwen3_tokenizer_dir).render(msgs))


def test_the_pre_tokenizer_the_file_names_is_the_one_that_runs(tmp_path):
    """llama-bpe (Llama 3) cuts digits three at a time, qwen2 one at a time, smollm cuts
    every digit out before GPT-2's regex (checked on the pre-tokenizer's pieces: the
    vocabulary is the same in all three files)."""
    from common.gguf import open_gguf
    cut = {}
    for pre in ("llama-bpe", "qwen2", "smollm"):
        path = tmp_path / f"{pre}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(["a", "b", "ab"])
        w.add_token_merges(["a b"])
        w.add_tensor("token_embd.weight", np.zeros((2, 32), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tok = open_gguf(path).tokenizer()
        cut[pre] = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("x 1234567")]
    assert cut["llama-bpe"] == ["x", "Ġ", "123", "456", "7"]
    assert cut["qwen2"] == ["x", "Ġ", "1", "2", "3", "4", "5", "6", "7"]
    assert cut["smollm"] == ["x", "Ġ", "1", "2", "3", "4", "5", "6", "7"]


# ----------------------------------------------------------------------------- bad files

def _write(path, arch="qwen3", tensors=None, tokenizer=True, raw_types=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "ab"])
        w.add_token_merges(["a b"])
    for name, (arr, t) in (tensors
                           or {"token_embd.weight": (np.zeros((2, 32), np.float32), None)}).items():
        if t is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("QWEN3_STAGES_CACHE", str(cache))
    yield cache
    assert not cache.exists() or not any(cache.rglob("*")), ("a bad file must write nothing to "
                                                              "the cache")


def _error(path) -> str:
    from common.models import ModelResolveError, resolve_model
    with pytest.raises(ModelResolveError) as e:
        resolve_model(path, progress=False)
    return str(e.value)


def test_truncated_file_says_truncated(root, tmp_path, private_cache):
    _, good = gguf_file("qwen3", "Q8_0", root)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size - 1000])
    assert "truncated" in _error(cut)
    head = tmp_path / "head.gguf"
    head.write_bytes(good.read_bytes()[:300])            # cut inside the metadata
    assert "truncated or corrupt" in _error(head)


def test_wrong_magic_and_version_are_named(root, tmp_path, private_cache):
    _, good = gguf_file("qwen3", "F32", root)
    data = bytearray(good.read_bytes())
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + bytes(data[4:]))
    assert "not a GGUF file" in _error(bad)
    data[4:8] = (7).to_bytes(4, "little")
    bad = tmp_path / "version.gguf"
    bad.write_bytes(bytes(data))
    assert "GGUF version 7 is not supported" in _error(bad)


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path, private_cache):
    msg = _error(_write(tmp_path / "g.gguf", arch="gemma3"))
    assert "'gemma3' is not supported" in msg
    assert "llama, qwen2, qwen2moe, qwen3, qwen3moe" in msg


def test_unmapped_tensor_type_names_type_and_tensor(tmp_path, private_cache):
    raw = np.zeros((2, 84), np.uint8)                    # one Q2_K block per row (256 weights)
    path = _write(tmp_path / "q2.gguf", tensors={"blk.0.attn_q.weight": (raw, T.Q2_K)})
    msg = _error(path)
    assert "'blk.0.attn_q.weight'" in msg and "Q2_K" in msg and "Q4_K" in msg


def test_missing_tokenizer_metadata_says_so(tmp_path, private_cache):
    from common.gguf import GGUFError
    from common.tokenizer import Tokenizer
    path = _write(tmp_path / "notok.gguf", tokenizer=False)
    with pytest.raises(GGUFError, match="no tokenizer metadata .*tokenizer.ggml.model"):
        Tokenizer(path)


def test_a_folder_with_one_gguf_is_that_file(root, tmp_path):
    from common.config import ModelConfig, gguf_path
    _, path = gguf_file("qwen3", "F32", root)
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(path, d / "x.gguf")
    assert gguf_path(d) == d / "x.gguf"
    assert ModelConfig.from_folder(d) == ModelConfig.from_folder(path)
    shutil.copy(path, d / "y.gguf")
    assert gguf_path(d) is None                          # two files: which one? the resolver asks
    assert "pass one of them" in _error(d)
