"""common/loader.py and common/config.py against what transformers wrote."""
import importlib
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bench.testbed.models import make_model
from common.config import ConfigError, ModelConfig
from common.loader import LoaderError, WeightLoader


def test_every_tensor_of_a_sharded_bf16_folder_equals_torch_exactly():
    folder = make_model("qwen3", dtype="bfloat16", sharded=True)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    loader = WeightLoader(folder)
    count = 0
    for shard in shards:
        for name, t in load_file(shard).items():
            assert t.dtype == torch.bfloat16
            ours = loader.get(name)
            np.testing.assert_array_equal(ours, t.float().numpy())
            np.testing.assert_array_equal(loader.get(name, "bfloat16"),
                                          t.view(torch.int16).numpy().view(np.uint16))
            count += 1
    assert count == len(loader.names()) > 20


def test_fused_qkv_stacks_the_three_projections():
    folder = make_model("qwen3")
    loader = WeightLoader(folder)
    fused = loader.fused(["wq", "wk", "wv"], 1)
    parts = [loader.layer(k, 1) for k in ("wq", "wk", "wv")]
    c = loader.config
    assert fused.shape == ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size)
    np.testing.assert_array_equal(fused, np.concatenate(parts))


def test_tied_lm_head_reads_the_embedding():
    folder = make_model("qwen3", tie_word_embeddings=True)
    loader = WeightLoader(folder)
    np.testing.assert_array_equal(loader.glob("lm_head"), loader.glob("embed"))


def _copy(folder, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(folder, dst)
    return dst


def test_broken_folders_give_clear_errors(tmp_path):
    sharded = make_model("qwen3", dtype="bfloat16", sharded=True)
    single = make_model("qwen3")

    d = _copy(sharded, tmp_path / "a")
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(LoaderError, match="shard .* is missing"):
        WeightLoader(d)

    d = _copy(single, tmp_path / "b")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(LoaderError, match="truncated"):
        WeightLoader(d).layer("w_down", 1)

    d = _copy(single, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoaderError, match=r"shape \[.*\], expected \[.*\] from config.json"):
        WeightLoader(d).layer("wq", 0)

    d = _copy(single, tmp_path / "d")
    raw = bytearray((d / "model.safetensors").read_bytes())
    n = int.from_bytes(raw[:8], "little")
    # same length: one tensor now claims int64
    header = raw[8:8 + n].decode().replace('"F32"', '"I64"', 1)
    raw[8:8 + n] = header.encode()
    (d / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(LoaderError, match="dtype I64"):
        for name in WeightLoader(d).names():
            WeightLoader(d).get(name)

    d = _copy(single, tmp_path / "e")
    (d / "model.safetensors").unlink()
    with pytest.raises(LoaderError, match="no model.safetensors"):
        WeightLoader(d)

    with pytest.raises(LoaderError, match="'model.layers.9.self_attn.q_proj.weight' not found"):
        WeightLoader(single).layer("wq", 9)


def test_config_reads_4x_and_5x_keys_and_generation_eos():
    # 5.x: rope_parameters, num_local_experts
    base = json.loads((make_model("qwen3_moe") / "config.json").read_text())
    new = ModelConfig.from_dict(base)
    old = dict(base)
    old.pop("rope_parameters")
    old["rope_theta"] = base["rope_parameters"]["rope_theta"]
    old["num_experts"] = old.pop("num_local_experts")
    assert ModelConfig.from_dict(old) == new
    assert new.family == "qwen3_moe" and new.num_experts == 8 and new.rope_theta == 1e6
    assert new.is_moe_layer(0) and new.qk_norm
    llama = ModelConfig.from_folder(make_model("llama"))
    assert llama.family == "llama" and not llama.qk_norm and llama.eos_token_ids == [2]


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel.*not supported"),
    ({"hidden_size": None}, "missing the key 'hidden_size'"),
    ({"num_key_value_heads": 3}, "multiple of"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, "'linear' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0}},
     "needs original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     r"high_freq_factor \(4.0\) > low_freq_factor"),
    ({"attention_bias": True}, "attention_bias=true is not supported for qwen3"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "sliding-window"),
])
def test_config_errors_name_the_key(change, message):
    d = json.loads((make_model("qwen3") / "config.json").read_text())
    d.update(change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(d)


def test_config_missing_folder_says_what_a_model_folder_is(tmp_path):
    with pytest.raises(ConfigError, match="Hugging Face model folder"):
        ModelConfig.from_folder(tmp_path)


def test_config_reads_llama3_rope_scaling_from_4x_and_5x_keys():
    """Real checkpoints (DeepSeek-R1-Distill-Llama) write rope_theta and rope_scaling;
    transformers 5.x writes one rope_parameters dict. Both give the same config."""
    from common.config import RopeScaling
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    folder = make_model("llama", rope_scaling=dict(rope_type="llama3", **scaling))
    new = json.loads((folder / "config.json").read_text())
    assert new["rope_parameters"]["rope_type"] == "llama3" and "rope_scaling" not in new
    old = dict(new)
    old["rope_theta"] = old.pop("rope_parameters")["rope_theta"]
    old["rope_scaling"] = dict(type="llama3", **scaling)        # the older spelling of rope_type
    a, b = ModelConfig.from_dict(new), ModelConfig.from_dict(old)
    assert a == b and a.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192) and a.rope_theta == 1e5
    old["rope_scaling"] = None                                   # Qwen2 checkpoints write null
    assert ModelConfig.from_dict(old).rope_scaling is None


def test_config_of_a_real_qwen2_moe_checkpoint_shape():
    """4.x keys as Qwen1.5-MoE-A2.7B's config.json has them (num_experts, rope_theta,
    use_sliding_window false), written here by hand from its documented shape."""
    d = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936,
         "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
         "num_attention_heads": 16, "num_key_value_heads": 16, "rope_theta": 1000000.0,
         "rms_norm_eps": 1e-6, "hidden_act": "silu",
         "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
         "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
         "shared_expert_intermediate_size": 5632,
         "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
         "tie_word_embeddings": False}
    c = ModelConfig.from_dict(d)
    assert (c.family, c.num_experts, c.head_dim,
            c.qkv_bias, c.qk_norm) == ("qwen2_moe", 60, 128, True, False)
    assert all(c.is_moe_layer(i) for i in range(24)) and c.shared_expert_intermediate_size == 5632
    d.pop("shared_expert_intermediate_size")
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        ModelConfig.from_dict(d)
    d2 = {**d, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    c2 = ModelConfig.from_dict(d2)
    assert (c2.family, c2.qkv_bias, c2.num_experts, c2.is_moe_layer(0)) == ("qwen2", True, 0, False)


def test_biases_and_shared_expert_tensors_equal_torch():
    import transformers as tf
    folder = make_model("qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1])
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    loader = WeightLoader(folder)
    for i in range(3):
        att = f"model.layers.{i}.self_attn."
        for key, proj in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
            np.testing.assert_array_equal(loader.layer(key, i), sd[att + proj + ".bias"])
            # the test model's biases are not zero
            assert np.abs(sd[att + proj + ".bias"]).max() > 0.1
        fused = loader.fused(["bq", "bk", "bv"], i)
        parts = [sd[att + p + ".bias"] for p in ("q_proj", "k_proj", "v_proj")]
        np.testing.assert_array_equal(fused, np.concatenate(parts))
    mlp = "model.layers.0.mlp."
    assert loader.layer("s_gate", 0).shape == (80, 96)
    assert loader.layer("s_down", 0).shape == (96, 80)
    for key, name in (("s_gate", "shared_expert.gate_proj"), ("s_up", "shared_expert.up_proj"),
                      ("s_down", "shared_expert.down_proj"), ("shared_gate", "shared_expert_gate")):
        np.testing.assert_array_equal(loader.layer(key, 0), sd[mlp + name + ".weight"])
    # the dense middle layer has the dense MLP's names and no experts
    assert loader.layer("w_gate", 1).shape == (160, 96)
    with pytest.raises(LoaderError, match="shared_expert"):
        loader.layer("s_gate", 1)


# ------------------------------------------------------------ one path: config -> weights -> model

def _engine(stage: str, path):
    """Each stage's engine on `path`, as small and as quick to build as it comes (no compiling)."""
    if stage == "stage1":
        from stage1_cpu.engine import LLMEngine
        return LLMEngine(path, max_ctx=64, progress=False, use_numba=False)
    engine = importlib.import_module(f"{stage}.engine")
    return engine.LLMEngine(path, max_ctx=64, slots=4, token_budget=64, page_size=16, num_pages=8,
                            device="cpu", progress=False)


@pytest.mark.parametrize("source", ["folder", "gguf"])
@pytest.mark.parametrize("stage", ["stage1", "stage2_batched", "stage3_optimized"])
def test_each_engine_parses_its_config_once_and_passes_it_on(stage, source, tmp_path, monkeypatch):
    """The engine reads config.json (or the GGUF file's metadata) once; the weights and the
    model get that config, not one the loader parsed again."""
    from common.gguf_write import write_gguf
    folder = make_model("qwen3_moe", decoder_sparse_step=2)
    path = folder if source == "folder" else write_gguf(folder, tmp_path / "m.gguf", "F32")
    parses, built = [], []
    from_folder, post_init = ModelConfig.from_folder.__func__, ModelConfig.__post_init__
    monkeypatch.setattr(ModelConfig, "from_folder",
                        classmethod(lambda cls, f: parses.append(f) or from_folder(cls, f)))
    monkeypatch.setattr(ModelConfig, "__post_init__",
                        lambda self: built.append(self) or post_init(self))
    engine = _engine(stage, path)
    assert parses == [path] and len(built) == 1, (parses, len(built))
    assert engine.weights.config is engine.config is engine.model.config


# the families whose loaders step differently: dense (untied), dense with tied embeddings, a MoE
# model with a dense layer between sparse ones, and one with a shared expert
BAR_CASES = {"dense": dict(family="qwen3"), "tied": dict(family="llama", tie_word_embeddings=True),
             "moe": dict(family="qwen3_moe", decoder_sparse_step=2),
             "shared_expert": dict(family="qwen2_moe")}


def _load(stage: str, folder):
    cfg = ModelConfig.from_folder(folder)
    if stage == "stage1":
        from stage1_cpu.weights import load_weights
        return load_weights(folder, cfg, "none", progress=True, kernels="plain")
    return importlib.import_module(f"{stage}.weights").load_weights(folder, cfg, progress=True)


@pytest.mark.parametrize("case", list(BAR_CASES))
@pytest.mark.parametrize("stage", ["stage1", "stage2_batched", "stage3_optimized"])
def test_the_loading_bar_ends_exactly_at_its_total(stage, case, monkeypatch):
    """Each stage's loader advances common.loader.loading's bar once per matrix it holds: the
    bar ends on its total, no step short and none past it, for dense and MoE models alike
    (a MoE layer's every expert counted once, the tied lm_head too)."""
    import rich.progress
    bars = []

    class Recorded(rich.progress.Progress):
        def __exit__(self, *exc):
            bars.extend((t.description, t.total, t.completed) for t in self.tasks)
            return super().__exit__(*exc)

    monkeypatch.setattr(rich.progress, "Progress", Recorded)
    w = _load(stage, make_model(**BAR_CASES[case]))
    ((title, total, done),) = bars
    assert title.startswith("loading weights") and done == total, (title, total, done)
    cfg = w.config
    experts = sum(cfg.num_experts for i in range(cfg.num_layers) if cfg.is_moe_layer(i))
    assert total > cfg.num_layers * 4 + experts        # every layer's and every expert's matrices
