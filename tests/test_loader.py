"""common/loader.py and common/config.py against what transformers wrote."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common.config import ConfigError, ModelConfig
from common.loader import LoaderError, WeightLoader
from models import make_model


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
            np.testing.assert_array_equal(loader.get(name, "bfloat16"), t.view(torch.int16).numpy().view(np.uint16))
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
    header = raw[8:8 + n].decode().replace('"F32"', '"I64"', 1)   # same length: one tensor now claims int64
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
    base = json.loads((make_model("qwen3_moe") / "config.json").read_text())   # 5.x: rope_parameters, num_local_experts
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
])
def test_config_errors_name_the_key(change, message):
    d = json.loads((make_model("qwen3") / "config.json").read_text())
    d.update(change)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(d)


def test_config_missing_folder_says_what_a_model_folder_is(tmp_path):
    with pytest.raises(ConfigError, match="Hugging Face model folder"):
        ModelConfig.from_folder(tmp_path)
