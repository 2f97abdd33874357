"""Broken model files and models that compute NaN: one test for each failure a mutation fuzz of
tiny models found (tests/test_model_fuzz.py runs the fuzzer itself).

  * a GGUF file's vocabulary or merges corrupted: the tokenizers library raised TypeError,
    Exception or a Rust panic;
  * num_hidden_layers (block_count) of 10^12: loading ran for ever;
  * rms_norm_eps or rope_theta of 0 or less: NaN logits reached the sampler;
  * a byte flipped in a safetensors header: KeyError: 'shape';
  * a forward pass with non-finite logits: "Probabilities contain NaN", or token 0 for ever.

Each file gets one clear error naming the file and the field, and the command line exits with 2
and no traceback; a request whose logits are not finite ends with finish_reason "error", in every
stage, and the requests beside it go on.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from bench.testbed.models import make_model
from common.chat_template import BUILTIN_CHATML
from common.config import ConfigError, ModelConfig
from common.engine import Request
from common.gguf import GGUFError
from common.gguf_write import write_gguf
from common.loader import LoaderError, open_weights
from common.sampling import NO_TOKEN, SamplingParams, Sampler
from common.tiny_model import build_tokenizer
from common.tokenizer import Tokenizer
from model_fuzz import gguf_fields

ROOT = Path(__file__).resolve().parent.parent


def model_folder(dst: Path, family: str = "qwen3", **overrides) -> Path:
    """A tiny model folder with a real (small) BPE tokenizer and a chat template."""
    shutil.copytree(make_model(family, hidden_size=128, **overrides), dst)
    build_tokenizer(512).save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
         "chat_template": BUILTIN_CHATML}))
    return dst


def edit_config(folder: Path, **changes) -> Path:
    d = json.loads((folder / "config.json").read_text())
    d.update(changes)
    (folder / "config.json").write_text(json.dumps(d))
    return folder


def set_gguf_field(path: Path, what: str, value) -> Path:
    """Rewrite the header number called `what` (model_fuzz.gguf_fields' names) in place."""
    data = bytearray(path.read_bytes())
    at, fmt, _ = next(f for f in gguf_fields(bytes(data))[0] if f[2] == what)
    struct.pack_into(fmt, data, at, value)
    path.write_bytes(bytes(data))
    return path


def generate(model: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "stage1_cpu.generate", "--model", str(model), "--kernels", "plain",
           "--prompt", "Hello", "--max-tokens", "4", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def assert_clean_exit(r: subprocess.CompletedProcess, *says: str, code: int = 2) -> None:
    """Exit code 2 (a bad model), one error line that says each of `says`, no traceback."""
    assert r.returncode == code and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("error: ") == 1 and all(s in r.stderr for s in says), r.stderr[-3000:]


# ----------------------------------------------------------------------------- GGUF tokenizer data

def tokenizer_gguf(path: Path, tokens: list[str], merges: list[str], **ids) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    if "eos" in ids:
        w.add_eos_token_id(ids["eos"])
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("merges,says", [
    (["a c"], r"merges\[0\] is 'a c'"),          # a part outside the vocabulary (was: Exception)
    (["a b", "ab"], r"merges\[1\] is 'ab'"),      # one part (was: TypeError from tokenizers)
    (["a b", "ab b"], r"merges\[1\] is 'ab b'"),  # a join not in the vocabulary (was: a Rust panic)
])
def test_gguf_merges_that_make_no_bpe_name_the_file_and_the_merge(tmp_path, merges, says):
    path = tokenizer_gguf(tmp_path / "tok.gguf", ["a", "b", "ab"], merges)
    with pytest.raises(GGUFError, match=says) as e:
        Tokenizer(path)
    assert str(path) in str(e.value) and "tokenizer.ggml" in str(e.value)


def test_gguf_eos_id_outside_the_vocabulary_names_the_key(tmp_path):
    path = tokenizer_gguf(tmp_path / "tok.gguf", ["a", "b", "ab"], ["a b"], eos=7)
    with pytest.raises(GGUFError, match=r"tokenizer.ggml.eos_token_id is 7, not a token id < 3"):
        Tokenizer(path)


def test_corrupted_gguf_vocabulary_exits_2_from_the_command_line(tmp_path):
    """A byte of a token's text changed (the fuzz's most common traceback): the merges that
    use that token no longer make a BPE."""
    src = model_folder(tmp_path / "m")
    path = write_gguf(src, tmp_path / "m.gguf", "Q8_0")
    token = json.loads((src / "tokenizer.json").read_text())["model"]["merges"][-1][0].encode()
    data = path.read_bytes()
    at = data.index(struct.pack("<Q", len(token)) + token) + 8      # the text of a merge's token
    path.write_bytes(data[:at] + b"~" + data[at + 1:])
    assert_clean_exit(generate(path), str(path), "tokenizer.ggml.merges[")


# ----------------------------------------------------------------------------- layer counts

@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_num_hidden_layers_of_10_12_fails_at_once_naming_the_key(tmp_path, family):
    folder = edit_config(model_folder(tmp_path / "m", family), num_hidden_layers=10**12)
    t0 = time.perf_counter()
    says = r"config.json: num_hidden_layers is 1000000000000, but the weights hold the tensors of 2"
    with pytest.raises(LoaderError, match=says):
        open_weights(folder, ModelConfig.from_folder(folder))
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_gguf_block_count_of_2_31_fails_at_once_naming_the_key(tmp_path, family):
    arch = family.replace("_", "")
    path = write_gguf(model_folder(tmp_path / "m", family), tmp_path / "m.gguf", "F32")
    set_gguf_field(path, f"{arch}.block_count", 2**31)           # a uint32 field
    t0 = time.perf_counter()
    says = rf"'{arch}.block_count' is 2147483648, but the file holds the tensors of 2 layers"
    with pytest.raises(GGUFError, match=says):
        ModelConfig.from_folder(path)
    assert time.perf_counter() - t0 < 5


def test_huge_layer_count_exits_2_from_the_command_line_without_hanging(tmp_path):
    folder = edit_config(model_folder(tmp_path / "m", "qwen3_moe"), num_hidden_layers=2**62)
    r = generate(folder, timeout=60)                   # a hang fails here, after a minute
    assert_clean_exit(r, str(folder / "config.json"), "num_hidden_layers is 4611686018427387904")


# ----------------------------------------------------------------------------- values that make no

@pytest.mark.parametrize("key,value", [
    ("rms_norm_eps", -1), ("rms_norm_eps", 0), ("rms_norm_eps", float("nan")),
    ("rope_theta", 0), ("rope_theta", -1), ("rope_theta", float("inf")), ("rope_theta", "1e6")])
def test_eps_and_rope_theta_must_be_finite_and_positive(tmp_path, key, value):
    folder = edit_config(model_folder(tmp_path / "m"), **{key: value})
    says = f"config.json: {key} must be a finite number > 0, got {value!r}"
    with pytest.raises(ConfigError, match=says):
        ModelConfig.from_folder(folder)


@pytest.mark.parametrize("key,value,says", [
    ("num_attention_heads", 0, "num_attention_heads must be an integer >= 1, got 0"),
    ("num_key_value_heads", 3, r"num_attention_heads \(4\) must be a multiple of num_key_value"),
    ("hidden_size", 96.5, "hidden_size must be an integer >= 1, got 96.5"),
    ("max_position_embeddings", None, "max_position_embeddings must be an integer >= 1, got None"),
    ("eos_token_id", {"a": 1}, "eos_token_id must be a list of integers >= 0"),
    ("rope_scaling", [1, 2], "rope_parameters and rope_scaling must be JSON objects"),
    ("architectures", [["Qwen3ForCausalLM"]], "architecture .* is not supported"),
])
def test_config_values_of_the_wrong_kind_name_the_file_and_key(tmp_path, key, value, says):
    folder = edit_config(model_folder(tmp_path / "m"), **{key: value})
    with pytest.raises(ConfigError, match=says) as e:
        ModelConfig.from_folder(folder)
    assert str(folder / "config.json") in str(e.value)


@pytest.mark.parametrize("key,value,says", [
    ("qwen3.attention.layer_norm_rms_epsilon", -1.0,
     "'qwen3.attention.layer_norm_rms_epsilon' is -1.0; expected a finite number > 0"),
    ("qwen3.rope.freq_base", 0.0, "'qwen3.rope.freq_base' is 0.0; expected a finite number > 0"),
    ("qwen3.attention.head_count", 0, "'qwen3.attention.head_count' is 0; expected a whole number"),
])
def test_gguf_hyper_parameters_that_make_no_model_name_the_key(tmp_path, key, value, says):
    path = write_gguf(model_folder(tmp_path / "m"), tmp_path / "m.gguf", "F32")
    set_gguf_field(path, key, value)
    with pytest.raises(GGUFError, match=says) as e:
        ModelConfig.from_folder(path)
    assert str(path) in str(e.value)


def test_negative_eps_exits_2_from_the_command_line(tmp_path):
    folder = edit_config(model_folder(tmp_path / "m"), rms_norm_eps=-1)
    assert_clean_exit(generate(folder), str(folder / "config.json"), "rms_norm_eps must be")


# ----------------------------------------------------------------------------- safetensors headers

def rewrite_header(folder: Path, edit) -> Path:
    """model.safetensors with its JSON header passed through edit(header) -> header."""
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = edit(json.loads(raw[8:8 + n]))
    text = json.dumps(header).encode()
    f.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return f


@pytest.mark.parametrize("edit,says", [
    (lambda h: {k: ({"dtype": v["dtype"], "shapf": v["shape"], "data_offsets": v["data_offsets"]}
                    if k == "model.norm.weight" else v) for k, v in h.items()},
     "tensor 'model.norm.weight' has a malformed header entry"),        # was: KeyError: 'shape'
    (lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "data_offsets": [8, 2]}},
     "tensor 'model.norm.weight' has a malformed header entry"),
    (lambda h: {**h, "model.norm.weight": {**h["model.norm.weight"], "shape": [128.0]}},
     "tensor 'model.norm.weight' has a malformed header entry"),        # was: TypeError in reshape
    (lambda h: list(h), "the safetensors header is not a valid JSON object"),  # was: AttributeError
])
def test_a_malformed_safetensors_header_is_refused_by_name(tmp_path, edit, says):
    f = rewrite_header(model_folder(tmp_path / "m"), edit)
    with pytest.raises(LoaderError, match=says) as e:
        open_weights(f.parent, ModelConfig.from_folder(f.parent))
    assert str(f) in str(e.value)


def test_a_flipped_byte_in_the_safetensors_header_exits_2_from_the_command_line(tmp_path):
    folder = model_folder(tmp_path / "m")
    f = folder / "model.safetensors"
    raw = f.read_bytes()
    at = raw.index(b'"shape"')
    f.write_bytes(raw[:at + 1] + b"z" + raw[at + 2:])                 # "shape" -> "zhape"
    assert_clean_exit(generate(folder), str(f), "malformed header entry")


# ----------------------------------------------------------------------------- non-finite logits

@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_the_sampler_answers_non_finite_logits_with_no_token(temperature, bad):
    logits = np.random.default_rng(0).normal(size=64).astype(np.float32)
    if bad == "-inf":
        logits[:] = -np.inf                   # every logit -inf: nothing to sample
    else:
        logits[5] = float(bad)
    s = Sampler(SamplingParams(temperature=temperature, seed=1))
    assert s(logits, [], []) == NO_TOKEN
    assert s(np.arange(64, dtype=np.float32), [], []) in range(64)    # the next row samples


def poison(src: Path, dst: Path, row: int | None = None) -> Path:
    """A copy of the folder whose embedding row `row` is NaN (only prompts holding that token
    compute NaN), or with row None whose final norm is NaN (every request does)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    if row is None:
        weights["model.norm.weight"][:] = np.nan
    else:
        weights["model.embed_tokens.weight"][row] = np.nan
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def run(engine, requests: dict[str, list[int]], max_tokens: int = 6) -> dict[str, list]:
    """Every request at once -> {id: [(token, finish_reason), ...]} (greedy, EOS ignored)."""
    for rid, ids in requests.items():
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(Request(rid, ids, params))
    got: dict[str, list] = {rid: [] for rid in requests}
    for _ in range(200):
        if not engine.has_work():
            return got
        for ev in engine.step():
            got[ev.request_id].append((ev.token_id, ev.finish_reason))
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    """(clean folder, folder whose embedding row X is NaN, X, a good prompt, its greedy tokens)."""
    from stage1_cpu.engine import LLMEngine
    root = tmp_path_factory.mktemp("nan")
    clean = model_folder(root / "clean")
    good = Tokenizer(clean).encode("Hello, how are you today?")
    engine = LLMEngine(clean, use_numba=False, progress=False, max_ctx=64)
    out = [t for t, _ in run(engine, {"a": good})["a"]]
    x = next(t for t in range(300, 512) if t not in good + out)
    return clean, poison(clean, root / "bad", x), x, good, out


def stage_engine(stage: str, folder: Path):
    if stage == "stage1":
        from stage1_cpu.engine import LLMEngine
        return LLMEngine(folder, use_numba=False, progress=False, max_ctx=64)
    if stage == "stage1-ngram":
        from stage1_cpu.speculative import SpeculativeEngine
        return SpeculativeEngine(folder, use_numba=False, progress=False, max_ctx=64)
    module = __import__(f"{stage}.engine", fromlist=["LLMEngine"])
    return module.LLMEngine(folder, max_ctx=64, slots=4, token_budget=64, page_size=4, num_pages=64,
                            device="cpu", progress=False)


@pytest.mark.parametrize("stage", ["stage1", "stage1-ngram", "stage2_batched", "stage3_optimized"])
def test_non_finite_logits_end_that_request_with_an_error_and_the_others_go_on(nan_model, stage):
    clean, bad, x, good, out = nan_model
    engine = stage_engine(stage, bad)
    got = run(engine, {"bad": good[:3] + [x] + good[3:], "good": good})
    assert got["bad"] == [(-1, "error")]                     # no token, nothing sampled from NaN
    expected = out if stage.startswith("stage1") else [t for t, _ in run(stage_engine(stage, clean),
                                                                        {"a": good})["a"]]
    assert [t for t, _ in got["good"]] == expected and got["good"][-1][1] == "length"
    assert not engine.has_work()


def test_non_finite_logits_stop_generate_with_a_message(nan_model, tmp_path):
    """Exit code 1, as for any engine error during generation (the model loaded)."""
    r = generate(poison(nan_model[0], tmp_path / "m"))           # the final norm NaN: every request
    assert_clean_exit(r, "logits were not finite", code=1)


def test_the_chat_says_the_logits_were_not_finite_and_answers_the_next_question(nan_model, capsys):
    from common.chat import run_chat
    from common.chat_template import ChatTemplate
    from stage1_cpu.engine import LLMEngine
    clean, bad, x, _, _ = nan_model
    tok = Tokenizer(bad)
    text = tok.decode([x])
    params = SamplingParams(temperature=0)

    def chat(folder, lines):
        engine = LLMEngine(folder, use_numba=False, progress=False, max_ctx=128)
        template = ChatTemplate.from_folder(folder)
        code = run_chat(engine, tok, template, params, max_tokens=5, lines=lines)
        return code, capsys.readouterr()

    code, bad_run = chat(bad, [text, "hi"])
    says = "ended by an engine error (its logits were not finite)"
    assert code == 0 and bad_run.err.count(says) == 1
    _, clean_run = chat(clean, ["hi"])
    assert bad_run.out.strip().splitlines()[-1] == clean_run.out.strip().splitlines()[-1]
    assert clean_run.out.strip()


# ----------------------------------------------------------------------------- the server

def test_the_server_answers_non_finite_logits_with_an_error_and_serves_the_next_request(nan_model):
    """A request whose forward pass gives NaN: a clear 500 body, or an error event on a stream;
    the server stays up, and the next request gets the clean model's own tokens. A request
    naming another model (a broken file, say) gets 404 at its param."""
    import httpx

    from common.chat_template import ChatTemplate
    from common.server import create_app
    from stage1_cpu.engine import LLMEngine
    from test_server import LiveServer
    clean, bad, x, good, out = nan_model
    engine = LLMEngine(bad, use_numba=False, progress=False, max_ctx=64)
    tok = Tokenizer(bad)
    server = LiveServer(create_app(engine, tok, ChatTemplate.from_folder(bad), "tiny", folder=bad))
    url = server.url + "/v1/completions"
    body = {"model": "tiny", "prompt": good[:3] + [x] + good[3:], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    try:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert "logits were not finite" in r.json()["error"]["message"]
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert s.status_code == 200 and events[-1] == "[DONE]"
        assert "logits were not finite" in json.loads(events[-2])["error"]["message"], events
        r = httpx.post(url, json={**body, "model": str(tmp := bad / "broken.gguf")}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model" and str(tmp) in r.text
        r = httpx.post(url, json={**body, "prompt": good}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode(out) != ""
        server.wait_idle()
    finally:
        server.close()


def test_serve_with_a_broken_model_says_why_and_exits_2(tmp_path):
    folder = edit_config(model_folder(tmp_path / "m"), rope_theta=0)
    cmd = [sys.executable, "-m", "stage1_cpu.serve", "--model", str(folder),
           "--addr", "127.0.0.1:0", "--log-level", "warning"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    says = f"error: loading the model failed: ConfigError: {folder / 'config.json'}: rope_theta"
    assert says in r.stderr, r.stderr[-3000:]
