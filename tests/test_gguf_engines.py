"""Every stage runs a GGUF file: stage 1 with the blocks kept as its own int8 / int4
(--quant stored, the default on a GGUF), stages 2 and 3 dequantized to their dtype.

The oracle is transformers loading the same file (`from_pretrained(dir, gguf_file=...)`,
which dequantizes); its config comes from the source folder, since transformers reads
neither head_dim nor the expert widths from every architecture's metadata. Stage 1
multiplies with fp32 activations here (--activations fp32): the exact mappings then
compute the function transformers computes, so greedy tokens agree step for step.
"""
from __future__ import annotations

import numpy as np
import pytest

from bench.testbed.models import make_model
from common.config import ModelConfig
from common.engine import Request
from common.sampling import SamplingParams
from test_gguf import gguf_file

PROMPT = [5, 17, 300, 42, 7, 99, 256, 3, 128, 64, 11, 480, 200, 13]
STEPS = 16
# one file type per family, so every exact mapping runs end to end once
CASES = [("qwen3", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q5_0"), ("qwen3_moe", "Q4_0"),
         ("qwen2_moe", "Q4_1")]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    import torch
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-engines")


_refs: dict = {}


def reference(family, qtype, root):
    """(file, transformers' last-position logits of PROMPT, its greedy continuation)."""
    import torch
    import transformers as tf
    if (family, qtype) not in _refs:
        folder, path = gguf_file(family, qtype, root)
        model = tf.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32,
            config=tf.AutoConfig.from_pretrained(folder)).eval()
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT])).logits[0, -1].numpy()
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        _refs[family, qtype] = (path, logits, out[0, len(PROMPT):].tolist())
    return _refs[family, qtype]


def run(engine) -> list[int]:
    engine.add_request(Request("r", PROMPT,
                               SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)))
    out = []
    while engine.has_work():
        out += [e.token_id for e in engine.step()]
    return out


@pytest.mark.parametrize("family,qtype", CASES)
def test_stage1_keeps_the_blocks_and_greedy_tokens_equal_transformers(family, qtype, root):
    from stage1_cpu.engine import LLMEngine
    path, _, ref = reference(family, qtype, root)
    assert len(set(ref)) > 3
    eng = LLMEngine(path, quant="stored", max_ctx=128, progress=False, activations="fp32")
    w = eng.weights
    expect = {"Q8_0": "int8", "Q5_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}[qtype]
    assert w.layers[0].wqkv.fmt == expect and w.lm_head.fmt == expect
    assert f"{qtype} -> " in eng.describe_kernels()
    assert run(eng) == ref


def test_stage1_f32_file_logits_match_transformers(root):
    from stage1_cpu.model import build_model
    from stage1_cpu.weights import load_weights
    path, ref, _ = reference("qwen3", "F32", root)
    w = load_weights(path, ModelConfig.from_folder(path), "stored", progress=False, kernels="plain")
    assert w.layers[0].wqkv.fmt == "none"
    ours = build_model(w, 128).forward(np.array(PROMPT), 0)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


def test_stage1_quant_flag_requantizes_a_gguf(root):
    """--quant int4 on a Q8_0 file: dequantized, then stage 1's own int4 (the embedding int8)."""
    from stage1_cpu.weights import load_weights
    path, _, _ = reference("qwen3", "Q8_0", root)
    w = load_weights(path, ModelConfig.from_folder(path), "int4", progress=False, kernels="plain")
    assert w.layers[0].wqkv.fmt == "int4" and w.lm_head.fmt == "int8" and w.source


def test_stage2_cpu_greedy_tokens_equal_transformers_on_a_llama_file(root):
    """Dequantized to fp32, llama's Q/K rows un-permuted."""
    from stage2_batched.engine import LLMEngine
    path, _, ref = reference("llama", "Q8_0", root)
    eng = LLMEngine(path, max_ctx=256, slots=4, token_budget=16, page_size=16, num_pages=64,
                    device="cpu", progress=False)
    assert run(eng) == ref


def test_stage3_cpu_runs_a_gguf_as_it_runs_the_same_weights_from_a_folder(root):
    """bf16: an F32 file and the folder it was written from round to the very same bf16
    weights, so stage 3 gives the same tokens from both (a file of another type is checked
    by stage 2 against transformers; stage 3's loader reads it through the same interface)."""
    from stage3_optimized.engine import LLMEngine
    folder, path = gguf_file("qwen2_moe", "F32", root)
    kw = dict(max_ctx=256, slots=4, token_budget=16, page_size=16, num_pages=64,
              device="cpu", progress=False)
    assert run(LLMEngine(path, **kw)) == run(LLMEngine(folder, **kw))


SCALE = 0.02   # fp16 super-block scales of 2e-5..2e-4: weights ~0.01-0.1, logits ~10


def _kquant_file(root, kinds: dict):
    """A qwen3 file whose matrices are crafted K-quant blocks (random bytes, small fp16 scales):
    `kinds` maps a GGUF tensor-name suffix to its type, like llama-quantize's Q4_K_M mix
    (attn_v and ffn_down in Q6_K, the rest Q4_K). Norms come from a random model."""
    import gguf
    from test_gguf import _kquant_blocks
    from common.gguf_write import write_gguf
    folder = make_model("qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=32)
    f32 = write_gguf(folder, root / "kq-f32.gguf", "F32")
    src = gguf.GGUFReader(f32)
    out = root / "kq.gguf"
    w = gguf.GGUFWriter(str(out), "qwen3")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            vals = [bytes(field.parts[i]).decode() if sub == gguf.GGUFValueType.STRING
                    else field.parts[i][0].item()
                    for i in field.data]
            w.add_array(key, vals)
        elif kind == gguf.GGUFValueType.STRING:
            w.add_string(key, bytes(field.parts[field.data[0]]).decode())
        else:
            w.add_key_value(key, field.parts[field.data[0]][0].item(), kind)
    for n, t in enumerate(src.tensors):
        data = np.asarray(t.data)
        kind = next((k for s, k in kinds.items()
                     if t.name.endswith(s)), None) if data.ndim == 2 else None
        if kind is None:
            w.add_tensor(t.name, np.array(data))
            continue
        rows, cols = data.shape
        raw = _kquant_blocks(kind, rows, cols // 256, seed=n, scale=SCALE)
        w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# the largest logit difference each mapping makes, relative to the largest |logit| (stage 1 on
# the blocks as mapped against stage 1 on the file's exactly dequantized fp32 weights), with
# what was measured on these crafted files: Q4_K 2.3e-4 (fp16-rounded scales only), Q5_K 7.7e-4,
# Q6_K 2.4e-2 (int8 g32 spans two Q6_K sub-blocks of 16 whose random scales differ up to 128x:
# a worst case), the Q4_K_M mix 5.5e-3 (docs/gguf.md)
KQ_LOGIT_BOUNDS = {"Q4_K_M": ({"attn_v.weight": "Q6_K",
                               "ffn_down.weight": "Q6_K", ".weight": "Q4_K"}, 1.5e-2),
                   "Q4_K": ({".weight": "Q4_K"}, 1e-3), "Q5_K": ({".weight": "Q5_K"}, 3e-3),
                   "Q6_K": ({".weight": "Q6_K"}, 5e-2)}


@pytest.mark.parametrize("mix", list(KQ_LOGIT_BOUNDS))
def test_kquant_mappings_move_the_logits_by_their_stated_bound(mix, root):
    from stage1_cpu.model import build_model
    from stage1_cpu.weights import load_weights
    kinds, bound = KQ_LOGIT_BOUNDS[mix]
    path = _kquant_file(root, kinds)
    cfg = ModelConfig.from_folder(path)
    exact = build_model(load_weights(path, cfg, "none", progress=False, kernels="plain"), 128)
    w = load_weights(path, cfg, "stored", progress=False, kernels="plain")
    mapped = build_model(w, 128)
    ref = exact.forward(np.array(PROMPT), 0, all_logits=True)
    ours = mapped.forward(np.array(PROMPT), 0, all_logits=True)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    print(f"{mix}: largest logit difference {err:.2e} of max |logit| "
          f"{np.abs(ref).max():.1f}; {w.source}")
    assert np.abs(ref).max() > 0.5 and np.std(ref) > 0
    assert 0 < err < bound


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q4_0", "Q8_0"])
def test_files_from_llama_cpps_own_quantizer_run_close_to_llama_cpp(ftype, root):
    """Where the `bench` extra's llama.cpp is installed: its quantizer (llama_model_quantize)
    turns an F32 file into Q4_K_M / Q4_0 / Q8_0 (types and mixes of its own choosing), and
    stage 1's last-position logits on that file stay close to llama.cpp's own (which rounds
    its activations to 8 bits: bound 5 % of max |logit|, the same top token)."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")
    from stage1_cpu.model import build_model
    from stage1_cpu.weights import load_weights
    from common.gguf_write import write_gguf
    folder = make_model("qwen3", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                        num_key_value_heads=2, head_dim=32)
    f32 = write_gguf(folder, root / "lq-f32.gguf", "F32")
    out = root / f"lq-{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}"), 2
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    llm = llama_cpp.Llama(str(out), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(PROMPT)
    ref = np.array(llm.scores[len(PROMPT) - 1], dtype=np.float32)
    w = load_weights(out, ModelConfig.from_folder(out), "stored", progress=False, kernels="plain")
    ours = build_model(w, 128).forward(np.array(PROMPT), 0)
    assert np.abs(ref).max() > 1.0
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max(), w.source
    assert int(np.argmax(ours)) == int(np.argmax(ref))
