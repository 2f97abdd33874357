"""Read a Hugging Face model folder directly: safetensors, memory-mapped, one tensor at a time.

open_weights() is the one entry point for the stages: a folder gives the WeightLoader
below, a GGUF file common/gguf.py's GGUFWeightLoader, with the same methods.

A safetensors file is an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets: [begin, end]}}, then the raw bytes. We parse
the header ourselves and map each tensor's bytes with np.memmap when it is read,
so a tensor costs no memory until then (and none once converted), and a broken
file gets an error naming the file and tensor.

The rename table (HF name -> the engine's short name) lives here, not in the model:
stages ask for "wq" of layer 3 and never spell out "model.layers.3.self_attn.q_proj.weight".
"""
from __future__ import annotations

import dataclasses
import json
import struct
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from common.config import ModelConfig, gguf_path, is_int, read_json

# safetensors dtype -> (numpy storage dtype, bytes per element)
_DTYPES = {
    "F32": (np.float32, 4),
    "F16": (np.float16, 2),
    "BF16": (np.uint16, 2),   # bf16 is stored as its raw 16 bits; see _to_float32
}

# the engine's name -> HF name, per layer ({i} = layer, {e} = expert)
LAYER_NAMES = {
    "attn_norm": "model.layers.{i}.input_layernorm.weight",           # [C]
    "wq": "model.layers.{i}.self_attn.q_proj.weight",                 # [H*D, C]
    "wk": "model.layers.{i}.self_attn.k_proj.weight",                 # [Hkv*D, C]
    "wv": "model.layers.{i}.self_attn.v_proj.weight",                 # [Hkv*D, C]
    "wo": "model.layers.{i}.self_attn.o_proj.weight",                 # [C, H*D]
    "bq": "model.layers.{i}.self_attn.q_proj.bias",                   # [H*D]   (qwen2, qwen2_moe)
    "bk": "model.layers.{i}.self_attn.k_proj.bias",                   # [Hkv*D] (qwen2, qwen2_moe)
    "bv": "model.layers.{i}.self_attn.v_proj.bias",                   # [Hkv*D] (qwen2, qwen2_moe)
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",             # [D]   (qwen3 only)
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",             # [D]   (qwen3 only)
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",   # [C]
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",                # [F, C]
    "w_up": "model.layers.{i}.mlp.up_proj.weight",                    # [F, C]
    "w_down": "model.layers.{i}.mlp.down_proj.weight",                # [C, F]
    "router": "model.layers.{i}.mlp.gate.weight",                     # [E, C]  (MoE only)
    "e_gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",    # [Fe, C] (MoE only)
    "e_up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",        # [Fe, C]
    "e_down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",    # [C, Fe]
    "s_gate": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",  # [Fs, C] (qwen2_moe only)
    "s_up": "model.layers.{i}.mlp.shared_expert.up_proj.weight",      # [Fs, C]
    "s_down": "model.layers.{i}.mlp.shared_expert.down_proj.weight",  # [C, Fs]
    # [1, C]  sigmoid gate of the shared expert
    "shared_gate": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
GLOBAL_NAMES = {
    "embed": "model.embed_tokens.weight",   # [V, C]
    "final_norm": "model.norm.weight",      # [C]
    "lm_head": "lm_head.weight",            # [V, C] (absent when tied)
}


def open_weights(path: str | Path, config: ModelConfig, keep_quantized: bool = False):
    """The one way a stage reads a model's weights, whatever the model is, given the config the
    engine read from it: a Hugging Face folder -> WeightLoader; a .gguf file (or a folder holding
    one and no config.json) -> common.gguf.GGUFWeightLoader. Both answer layer / glob / fused under
    the engine's short names with float32 arrays; keep_quantized (stage 1, GGUF only)
    hands quantized matrices over in stage 1's int8 / int4 layout instead."""
    g = gguf_path(path)
    if g is not None:
        from common.gguf import GGUFWeightLoader    # GGUF code loads only for a GGUF model
        return GGUFWeightLoader(g, config, keep_quantized=keep_quantized)
    return WeightLoader(path, config)


class LoaderError(ValueError):
    """A model folder whose weights cannot be read; the message names the file and tensor."""


def _to_float32(raw: np.ndarray, st_dtype: str) -> np.ndarray:
    if st_dtype == "BF16":
        # bf16 is the top half of a float32: shifting the bits back is exact
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


class _File:
    """One .safetensors file: its parsed header and a lazy memory map of the data."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoaderError(f"{path}: file is truncated (no safetensors header); "
                                  "download it again")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise LoaderError(f"{path}: header length {n} exceeds the file size {size}; "
                                  "the file is truncated or not a safetensors file")
            try:
                self.header = dict(json.loads(f.read(n)))      # a JSON object, or an error
            except (ValueError, TypeError):
                raise LoaderError(f"{path}: the safetensors header is not a valid JSON object; "
                                  "the file is corrupt, download it again") from None
        self.header.pop("__metadata__", None)
        for name, info in self.header.items():     # each {dtype, shape, data_offsets: [begin, end]}
            at, shape = map((info if type(info) is dict else {}).get, ("data_offsets", "shape"))
            if not (type(at) is list and type(shape) is list and len(at) == 2
                    and all(map(is_int, at + shape)) and at[0] <= at[1]):
                raise LoaderError(f"{path}: tensor {name!r} has a malformed header entry "
                                  f"{info!s:.99}; the file is corrupt, download it again")
        self.data_start = 8 + n
        self.data_size = size - self.data_start

    def raw(self, name: str) -> tuple[np.ndarray, str]:
        info = self.header[name]
        st_dtype = info.get("dtype")
        if not isinstance(st_dtype, str) or st_dtype not in _DTYPES:
            raise LoaderError(f"{self.path}: tensor {name!r} has dtype {st_dtype}; "
                              f"supported: {', '.join(_DTYPES)}")
        np_dtype, width = _DTYPES[st_dtype]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end > self.data_size:
            raise LoaderError(f"{self.path}: tensor {name!r} ends at byte {end} but the file holds "
                              f"{self.data_size} data bytes: the file is truncated, "
                              "download it again")
        if end - begin != (n := width * int(np.prod(shape, dtype=object))):   # exact for any size
            raise LoaderError(f"{self.path}: tensor {name!r} has {end - begin} bytes, "
                              f"expected {n} for shape {list(shape)}")
        if end == begin:
            return np.zeros(shape, dtype=np_dtype), st_dtype
        # one mapping per tensor, dropped once the caller has converted it: the file's
        # pages then leave this process (a mapping of the whole file would keep every
        # page read so far resident, ~the checkpoint's size at the end of loading)
        mapped = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_start + begin,
                           shape=(end - begin,))
        return mapped.view(np_dtype).reshape(shape), st_dtype


class WeightLoader:
    """All tensors of a model folder, read on demand.

    loader = WeightLoader(folder)
    wq = loader.layer("wq", 3)           # float32 [H*D, C], read from the mapped file now
    """

    def __init__(self, folder: str | Path, config: ModelConfig | None = None):
        self.folder = Path(folder)
        self.config = config or ModelConfig.from_folder(folder)
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        self._where: dict[str, _File] = {}
        self.source = index if index.is_file() else single       # what error messages name
        if index.is_file():
            weight_map = read_json(index, LoaderError).get("weight_map")
            if type(weight_map) is not dict or not all(type(v) is str for v in weight_map.values()):
                raise LoaderError(f"{index}: not a valid index (it needs a 'weight_map')")
            files = {}
            for shard in sorted(set(weight_map.values())):
                path = self.folder / shard
                if not path.is_file():
                    raise LoaderError(f"{path}: shard listed in {index.name} is missing; "
                                      "download the complete model folder")
                files[shard] = _File(path)
            for name, shard in weight_map.items():
                if name not in files[shard].header:
                    raise LoaderError(f"{files[shard].path}: tensor {name!r} is listed in "
                                      f"{index.name} but not in the shard")
                self._where[name] = files[shard]
        elif single.is_file():
            f = _File(single)
            self._where = {name: f for name in f.header}
        else:
            raise LoaderError(f"{self.folder}: no model.safetensors or "
                              "model.safetensors.index.json; --model must be a Hugging Face model "
                              "folder with safetensors weights")
        # each layer config.json declares has tensors: checked before anything loops over the layers
        L = self.config.num_layers
        layers = {n.split(".")[2] for n in self._where if n.startswith("model.layers.")}
        if not (L <= len(layers) and all(str(i) in layers for i in range(L))):
            raise LoaderError(f"{self.folder / 'config.json'}: num_hidden_layers is {L}, but the "
                              f"weights hold the tensors of {len(layers)} layers")

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).header[name]["shape"])

    def _file(self, name: str) -> _File:
        if name not in self._where:
            raise LoaderError(f"{self.source}: tensor {name!r} not found in the weights; "
                              "is this the model the config.json describes?")
        return self._where[name]

    def get(self, name: str, dtype=np.float32, shape: tuple[int, ...] | None = None,
            rows: slice | None = None) -> np.ndarray:
        """One tensor, converted to dtype (float32, or 'bfloat16' to keep the raw bf16 bits as
        uint16). shape, when given, is checked; rows, when given, reads only those rows (the rest of
        the tensor is never touched)."""
        raw, st_dtype = self._file(name).raw(name)
        if shape is not None and tuple(raw.shape) != tuple(shape):
            raise LoaderError(f"{self._file(name).path}: tensor {name!r} has shape "
                              f"{list(raw.shape)}, expected {list(shape)} from config.json")
        if rows is not None:
            raw = raw[rows]
        if dtype == "bfloat16":
            if st_dtype != "BF16":
                raise LoaderError(f"tensor {name!r} is {st_dtype}, not BF16")
            return np.array(raw)
        out = _to_float32(raw, st_dtype)
        return out if out.dtype == dtype else out.astype(dtype)

    # --- the rename table, with the shapes config.json implies ---
    def layer(self, key: str, layer: int,
              expert: int | None = None, dtype=np.float32) -> np.ndarray:
        name = LAYER_NAMES[key].format(i=layer, e=expert)
        return self.get(name, dtype, self.config.expected_shape(key))

    def glob(self, key: str, dtype=np.float32, rows: slice | None = None) -> np.ndarray:
        """A model-wide tensor: embed, final_norm, lm_head (the embedding when tied)."""
        if key == "lm_head" and (self.config.tie_word_embeddings
                                 or GLOBAL_NAMES["lm_head"] not in self):
            key = "embed"
        return self.get(GLOBAL_NAMES[key], dtype, self.config.expected_shape(key), rows)

    def fused(self, keys: list[str], layer: int,
              expert: int | None = None, dtype=np.float32) -> np.ndarray:
        """Several projections of one layer stacked along the output axis, e.g.
        ["wq", "wk", "wv"] -> [(H + 2*Hkv) * D, C] so one matmul computes q, k and v
        (of one MoE expert, with expert: ["e_gate", "e_up"] -> [2 * Fe, C]; the biases
        ["bq", "bk", "bv"] -> [(H + 2*Hkv) * D], in the same order as the rows)."""
        return np.concatenate([self.layer(k, layer, expert, dtype=dtype) for k in keys], axis=0)


def stack(ws: list):
    """Matrices of one format and in_features (dataclasses with data, scales and mins, as
    stage 1's quant.Weight) -> one matrix, their rows stacked in order."""
    cat = lambda name: (None if getattr(ws[0], name) is None  # noqa: E731
                        else np.concatenate([getattr(w, name) for w in ws]))
    return dataclasses.replace(ws[0], out_features=sum(w.out_features for w in ws),
                               data=cat("data"), scales=cat("scales"), mins=cat("mins"))


@contextmanager
def loading(cfg: ModelConfig, title: str, attn: int, mlp: int, show: bool = True):
    """A progress bar that advances once per matrix loaded: `with loading(...) as step:`, then
    step(matrix) -> matrix. attn, mlp: how many matrices one layer's attention and one MLP hold
    (a MoE layer has one MLP per expert, and a shared one); 3 more for embed, lm_head (the
    embedding again when tied) and final_norm."""
    from rich.progress import Progress
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    n_shared = n_moe if cfg.shared_expert_intermediate_size else 0
    total = 3 + cfg.num_layers * (attn + mlp) + (n_moe * (cfg.num_experts - 1) + n_shared) * mlp
    with Progress(transient=True, disable=not show) as bar:
        task = bar.add_task(title, total=total)

        def step(value):
            bar.advance(task)
            return value

        yield step
