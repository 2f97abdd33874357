"""qwen2, qwen2_moe and Llama 3 RoPE scaling against transformers, in stage 1 and in
stage 2 on device="cpu" (its numpy twins): every position's fp32 logits and 32 greedy
tokens, on tiny random models transformers saved itself, at awkward shapes. Then a
check that each new piece (biases, the shared expert, the scaling) moves the
reference's logits, so a model that left it out could not pass; and the byte counts
the roofline uses."""
import json
import shutil

import numpy as np
import pytest

from bench.testbed.models import hf_greedy, hf_logits, load_hf, make_model
from common.engine import Request
from common.sampling import SamplingParams

PROMPT = [5, 17, 300, 42, 7, 99, 256, 3, 128, 64, 11, 480, 200, 13]
OTHER = [400, 2, 77, 31, 250, 9, 160, 88, 501, 6, 44, 333, 120, 71, 19, 260, 3, 90, 444]
STEPS = 32

# Llama 3's scaling with a pretraining context of 32: with head_dim 32 and theta 1e5
# the wavelengths are 6.3, 12.9, 26.4, 54, ... positions, so pair 0 is kept (< 32/4),
# pairs 1 and 2 are blended and the rest slowed by the factor, all within the test
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)

CASES = {
    "qwen2": dict(family="qwen2"),
    "qwen2_hd64_one_kv_head": dict(family="qwen2", head_dim=64, num_attention_heads=3,
                                   num_key_value_heads=1, hidden_size=72, intermediate_size=100),
    # Qwen2-MoE's defaults: top 4 of 8, not renormalised; shared expert 80 wide, routed 48
    "qwen2_moe_top4_nonorm": dict(family="qwen2_moe"),
    # a dense layer between two MoE layers, top 2 renormalised
    "qwen2_moe_top2_norm_dense_middle": dict(family="qwen2_moe", num_experts_per_tok=2,
                                             norm_topk_prob=True, num_hidden_layers=3,
                                             mlp_only_layers=[1]),
    # every second layer MoE, one KV head, a shared expert narrower than a routed one, no q/k/v bias
    "qwen2_moe_step2_one_kv_head_nobias": dict(family="qwen2_moe", decoder_sparse_step=2,
                                               num_key_value_heads=1,
                                               shared_expert_intermediate_size=24, qkv_bias=False),
    "llama3_rope": dict(family="llama", rope_scaling=LLAMA3),
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny matmuls on a shared 2-core machine: torch's threads only fight."""
    import torch
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def rel_err(a, b):
    """max |a - b| relative to the reference's scale."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def stage1_model(folder, fmt="none"):
    from common.config import ModelConfig
    from stage1_cpu.model import Model
    from stage1_cpu.weights import load_weights
    w = load_weights(folder, ModelConfig.from_folder(folder), fmt, progress=False)
    # the per-op path, on the fast kernels (test_stage1_decode_step.py holds the one region to it)
    return Model(w, 256, w.fast.kernels())


def stage2_engine(folder, **kw):
    from stage2_batched.engine import LLMEngine
    args = dict(max_ctx=256, slots=4, token_budget=16, page_size=16, num_pages=64,
                device="cpu", progress=False)
    args.update(kw)
    return LLMEngine(folder, **args)


_refs: dict = {}


def reference(case):
    """(folder, transformers' logits of PROMPT and OTHER, its greedy continuation of PROMPT)."""
    if case not in _refs:
        folder = make_model(**CASES[case])
        _refs[case] = (folder, hf_logits(folder, PROMPT), hf_logits(folder, OTHER),
                       hf_greedy(folder, PROMPT, STEPS))
    return _refs[case]


@pytest.mark.parametrize("case", list(CASES))
def test_stage1_fp32_logits_every_position_match_transformers(case):
    folder, ref, _, _ = reference(case)
    ours = stage1_model(folder).forward(np.array(PROMPT), 0, all_logits=True)
    assert ours.shape == ref.shape and np.abs(ref).max() > 1.0
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_stage1_fp32_greedy_32_tokens_equal_transformers(case):
    folder, _, _, ref = reference(case)
    assert len(set(ref)) > 3, "the reference must vary for the comparison to mean anything"
    model = stage1_model(folder)
    logits, out = model.forward(np.array(PROMPT), 0), []
    for pos in range(len(PROMPT), len(PROMPT) + STEPS):
        out.append(int(np.argmax(logits)))
        logits = model.forward(np.array(out[-1:]), pos)     # decode: one token at a time
    assert out == ref


@pytest.mark.parametrize("case", ["qwen2", "qwen2_moe_top2_norm_dense_middle"])
def test_stage1_engine_with_chunked_prefill_equals_transformers(case):
    """The engine as the chat and server use it: prompts prefilled 5 tokens at a time,
    the default model options (decode in one parallel region: fast/decode_step.py)."""
    from stage1_cpu.engine import LLMEngine
    folder, _, _, ref = reference(case)
    eng = LLMEngine(folder, max_ctx=128, progress=False, prefill_chunk=5)
    from stage1_cpu.fast import OneRegionModel
    assert isinstance(eng.model, OneRegionModel)
    eng.add_request(Request("r", PROMPT,
                            SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)))
    out = []
    while eng.has_work():
        out += [e.token_id for e in eng.step()]
    assert out == ref


@pytest.mark.parametrize("case", list(CASES))
def test_stage2_cpu_logits_of_a_packed_batch_match_transformers(case):
    """Two prompts packed into one batch, every position's logits."""
    from stage2_batched.batch import build_batch
    from stage2_batched.sequence import Sequence
    folder, ref_a, ref_b, _ = reference(case)
    eng = stage2_engine(folder)
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seqs = [Sequence.from_request(Request(str(i), p, greedy1), i)
            for i, p in enumerate([PROMPT, OTHER])]
    for s in seqs:
        eng.block_manager.allocate(s, len(s.token_ids))
    _, tokens, batch = build_batch(seqs, [len(PROMPT), len(OTHER)], 16)
    logits = np.asarray(eng.model.forward(tokens, batch, all_logits=True))   # [N, V]
    for i, ref in enumerate([ref_a, ref_b]):
        got = logits[batch.query_start[i]:batch.query_start[i + 1]]
        assert got.shape == ref.shape
        assert rel_err(got, ref) < 1e-4, f"sequence {i}"


@pytest.mark.parametrize("case", list(CASES))
def test_stage2_cpu_greedy_32_tokens_equal_transformers(case):
    """Chunked prefill (budget 16 < 14 + 19 prompt tokens) beside a second request."""
    folder, _, _, ref = reference(case)
    eng = stage2_engine(folder)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    eng.add_request(Request("a", PROMPT, params))
    eng.add_request(Request("b", OTHER, params))
    out = {"a": [], "b": []}
    while eng.has_work():
        for ev in eng.step():
            out[ev.request_id].append(ev.token_id)
    assert out["a"] == ref and len(out["b"]) == STEPS


def _hf_logits_changed(folder, change):
    """transformers' logits of PROMPT after change(model) edits the loaded model in place."""
    import torch
    model = load_hf(folder)
    with torch.no_grad():
        change(model)
        return model(torch.tensor([PROMPT])).logits[0].float().numpy()


def _zero(names):
    def change(model):
        for name, p in model.named_parameters():
            if any(n in name for n in names):
                p.zero_()
    return change


@pytest.mark.parametrize("case,what", [
    ("qwen2", "q/k/v biases"),
    ("qwen2_moe_top4_nonorm", "q/k/v biases"),
    ("qwen2_moe_top4_nonorm", "shared expert"),
    ("qwen2_moe_top4_nonorm", "shared expert gate"),
    ("llama3_rope", "rope scaling"),
])
def test_each_new_piece_moves_the_reference_logits(case, what, tmp_path):
    """Without this, the parity tests above could pass on a model that ignores the piece."""
    folder, ref, _, _ = reference(case)
    if what == "rope scaling":
        plain = tmp_path / "plain"
        shutil.copytree(folder, plain)
        cfg = json.loads((plain / "config.json").read_text())
        cfg["rope_parameters"] = {"rope_type": "default",
                                  "rope_theta": cfg["rope_parameters"]["rope_theta"]}
        (plain / "config.json").write_text(json.dumps(cfg))
        other = hf_logits(plain, PROMPT)
    else:
        names = {"q/k/v biases": ["_proj.bias"], "shared expert": ["shared_expert.down_proj"],
                 "shared expert gate": ["shared_expert_gate"]}[what]
        other = _hf_logits_changed(folder, _zero(names))
    assert rel_err(other, ref) > 0.05, (f"{what} barely changes the logits: the test would not see "
                                        "it missing")


def test_config_of_each_case_reads_the_new_fields():
    from common.config import ModelConfig, RopeScaling
    c = ModelConfig.from_folder(make_model(**CASES["qwen2_moe_top4_nonorm"]))
    assert (c.family, c.qkv_bias, c.qk_norm) == ("qwen2_moe", True, False)
    assert (c.num_experts_per_tok, c.norm_topk_prob) == (4, False)
    assert (c.moe_intermediate_size, c.shared_expert_intermediate_size) == (48, 80)
    c = ModelConfig.from_folder(make_model(**CASES["qwen2_moe_top2_norm_dense_middle"]))
    assert [c.is_moe_layer(i) for i in range(3)] == [True, False, True] and c.norm_topk_prob
    c = ModelConfig.from_folder(make_model(**CASES["qwen2_moe_step2_one_kv_head_nobias"]))
    assert [c.is_moe_layer(i) for i in range(2)] == [False, True] and not c.qkv_bias
    c = ModelConfig.from_folder(make_model(**CASES["llama3_rope"]))
    assert c.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32) and c.rope_theta == 1e5
    c = ModelConfig.from_folder(make_model(**CASES["qwen2"]))
    assert c.family == "qwen2" and c.qkv_bias and not c.qk_norm and not c.is_moe


def test_llama3_rope_tables_equal_transformers_rotary_embedding():
    """The cos/sin tables themselves, at positions far past the pretraining context."""
    import torch
    from stage1_cpu import ops
    from stage2_batched import ops as ops2
    folder, *_ = reference("llama3_rope")
    model = load_hf(folder)
    cfg = model.config
    pos = torch.arange(0, 2000)[None]
    with torch.no_grad():
        # [1, T, D]
        cos_ref, sin_ref = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    half = cfg.head_dim // 2
    from common.config import ModelConfig
    c = ModelConfig.from_folder(folder)
    for rope_tables in (ops.rope_tables, ops2.rope_tables):
        cos, sin = rope_tables(2000, c.head_dim, c.rope_theta, c.rope_scaling)
        np.testing.assert_allclose(cos, cos_ref[0, :, :half].numpy(), atol=2e-4)
        np.testing.assert_allclose(sin, sin_ref[0, :, :half].numpy(), atol=2e-4)
    plain, _ = ops.rope_tables(2000, c.head_dim, c.rope_theta)
    assert np.abs(plain - cos).max() > 0.5                  # the scaling changed the tables
    # stage 2 does not change RoPE: its twin is stage 1's, as parsed code (STYLE 1)
    import ast
    import inspect
    dump = lambda f: ast.dump(ast.parse(inspect.getsource(f)).body[0])   # noqa: E731
    assert dump(ops.llama3_inv_freq) == dump(ops2.llama3_inv_freq)


# ---- bytes: what the weights hold and what one decode token reads ----

def _moe_bytes(c, bytes_per):
    """By hand from the config: (all matrices, those one decode token reads) of a MoE model,
    fp32, untied; the embedding, norms and biases left out."""
    C, D, H, Hkv = c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads
    attn = (H + 2 * Hkv) * D * C + C * H * D
    expert = 3 * c.moe_intermediate_size * C
    shared = 3 * c.shared_expert_intermediate_size * C
    every = read = c.vocab_size * C                          # lm_head
    for i in range(c.num_layers):
        every += attn
        read += attn
        if c.is_moe_layer(i):
            # router, shared expert and its gate
            small = c.num_experts * C + shared + (C if shared else 0)
            every += small + c.num_experts * expert
            read += small + c.num_experts_per_tok * expert
        else:
            every += 3 * c.intermediate_size * C
            read += 3 * c.intermediate_size * C
    return every * bytes_per, read * bytes_per


@pytest.mark.parametrize("case", ["qwen2_moe_top4_nonorm", "qwen2_moe_top2_norm_dense_middle"])
def test_nbytes_counts_every_expert_and_decode_nbytes_only_the_routed_share(case):
    from bench.common import stage1_bytes
    from common.config import ModelConfig
    from stage1_cpu.weights import load_weights
    from stage2_batched.weights import load_weights as load_weights2
    from stage3_optimized.weights import load_weights as load_weights3
    folder = make_model(**CASES[case])
    cfg = ModelConfig.from_folder(folder)
    w1 = load_weights(folder, cfg, "none", progress=False)
    w2 = load_weights2(folder, cfg, progress=False)
    every, read = _moe_bytes(w1.config, 4)
    assert read < every
    assert (stage1_bytes(w1), stage1_bytes(w1, decode=True)) == (every, read)
    assert (w2.nbytes, w2.decode_nbytes) == (every, read)
    w3 = load_weights3(folder, cfg, progress=False)   # bf16, q/k/v, gate/up fused: the same bytes
    assert (w3.nbytes, w3.decode_nbytes) == _moe_bytes(w1.config, 2)
    # int8: the routed experts still count k of E, each at about a quarter of fp32 + scales
    q = load_weights(folder, cfg, "int8", progress=False)
    assert 0 < stage1_bytes(q, decode=True) < stage1_bytes(q) < every


def test_dense_decode_nbytes_equals_nbytes():
    from bench.common import stage1_bytes
    from common.config import ModelConfig
    from stage1_cpu.weights import load_weights
    folder = make_model("qwen2")
    w = load_weights(folder, ModelConfig.from_folder(folder), "none", progress=False)
    c = w.config
    C, D = c.hidden_size, c.head_dim
    per_layer = ((c.num_heads + 2 * c.num_kv_heads) * D * C + C * c.num_heads * D
                 + 3 * c.intermediate_size * C)
    assert (stage1_bytes(w) == stage1_bytes(w, decode=True)
            == 4 * (c.vocab_size * C + c.num_layers * per_layer))


def test_int8_qwen2_moe_logits_close_to_fp32():
    """The biases and the shared expert also run with quantized weights (loose bound:
    random weights are a worst case for quantization)."""
    folder = make_model("qwen2_moe", hidden_size=128, intermediate_size=256, initializer_range=0.05)
    exact = stage1_model(folder).forward(np.array(PROMPT), 0, all_logits=True)
    int8 = stage1_model(folder, "int8").forward(np.array(PROMPT), 0, all_logits=True)
    assert 0 < rel_err(int8, exact) < 5e-2


# A template in the style DeepSeek-R1-Distill-Qwen / -Llama ship (written for this test):
# the BOS token first, then the system prompt bare, full-width-bar role tokens, earlier
# answers with their reasoning cut off at </think>, and a generation prompt that opens
# the reasoning. The engine renders whatever template the model folder carries.
DISTILL_STYLE = (
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] %}"
    "{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.system }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{% set c = m['content'] %}"
    "{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + c + '<｜end▁of▁sentence｜>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")


def test_a_qwen2_folder_renders_its_own_distill_style_chat_template(tmp_path):
    from common.chat_template import ChatTemplate
    folder = tmp_path / "distill"
    shutil.copytree(make_model("qwen2"), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<｜begin▁of▁sentence｜>"}, "eos_token": "<｜end▁of▁sentence｜>",
         "chat_template": DISTILL_STYLE}))
    template = ChatTemplate.from_folder(folder)
    assert not template.is_builtin
    text = template.render([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "2+2?"},
                            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
                            {"role": "user", "content": "and 3+3?"}])
    assert text == ("<｜begin▁of▁sentence｜>Be brief.<｜User｜>2+2?<｜Assistant｜>\n\n4"
                    "<｜end▁of▁sentence｜>"
                    "<｜User｜>and 3+3?<｜Assistant｜><think>\n")
