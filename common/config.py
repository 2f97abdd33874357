"""ModelConfig: the numbers a stage needs, read from a model folder's config.json.

Five families share one dataclass:
  qwen3      Qwen3ForCausalLM      per-head RMSNorm on q and k before RoPE
  qwen3_moe  Qwen3MoeForCausalLM   the same attention, a routed MoE MLP
  llama      LlamaForCausalLM      no q/k norm (SmolLM2, DeepSeek's dense layout,
                                   DeepSeek-R1-Distill-Llama with Llama 3 RoPE scaling)
  qwen2      Qwen2ForCausalLM      no q/k norm, biases on q, k and v
                                   (DeepSeek-R1-Distill-Qwen)
  qwen2_moe  Qwen2MoeForCausalLM   qwen2's attention, routed experts plus a shared
                                   expert behind a sigmoid gate (Qwen1.5-MoE, Qwen2-MoE)

Real checkpoints use transformers 4.x keys (rope_theta, rope_scaling, num_experts);
models saved by transformers 5.x use rope_parameters and num_local_experts. Both work.
A GGUF file's metadata gives the same fields (common/gguf.py, loaded only for a GGUF model).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


class ConfigError(ValueError):
    """A config.json or generation_config.json this engine cannot run; the message says why."""


KEY = dict(num_layers="num_hidden_layers", num_heads="num_attention_heads",   # config.json's names
           num_kv_heads="num_key_value_heads", eos_token_ids="eos_token_id")


def is_int(x, least: int = 0) -> bool:        # an integer >= least (a bool is not one here)
    return isinstance(x, int) and not isinstance(x, bool) and x >= least


def is_positive(x) -> bool:                   # a finite number > 0 (NaN fails every comparison)
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


def read_json(path: Path, error: type[ValueError] = ConfigError) -> dict:
    """A JSON object file -> dict, {} without a file; else error(a message naming the file)."""
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_bytes())
    except ValueError as e:                        # not JSON, or not UTF-8
        raise error(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise error(f"{path} must hold a JSON object, not {type(d).__name__}")
    return d


def id_list(value) -> list:
    """eos_token_id as config files write it (an id, a list of ids, null) -> a list, unchecked."""
    return [] if value is None else value if isinstance(value, list) else [value]


def gguf_path(path: str | Path) -> Path | None:
    """The .gguf file `path` stands for: itself, or the one .gguf inside a folder without
    config.json; None for anything else (a Hugging Face folder). Every reader of a model
    asks this first, and only a GGUF model loads common/gguf.py."""
    p = Path(path)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        files = sorted(p.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
    return None


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE scaling (rope_type "llama3", Llama 3.1 and DeepSeek-R1-Distill-Llama).
    Wavelengths longer than original_max_position_embeddings / low_freq_factor are
    stretched by `factor`, those shorter than original_max_position_embeddings /
    high_freq_factor are kept, and the band between is blended smoothly
    (ops.llama3_inv_freq has the formula)."""
    factor: float                           # how much longer the context is than in pretraining
    low_freq_factor: float                  # the low end of the blended band
    high_freq_factor: float                 # the high end (> low_freq_factor)
    original_max_position_embeddings: int   # the pretraining context length


@dataclass
class ModelConfig:
    family: str                  # "qwen3" | "qwen3_moe" | "llama" | "qwen2" | "qwen2_moe"
    vocab_size: int              # V
    hidden_size: int             # C
    intermediate_size: int       # F, the dense MLP width
    num_layers: int              # L
    num_heads: int               # H query heads
    num_kv_heads: int            # Hkv key/value heads (GQA: H % Hkv == 0)
    head_dim: int                # D
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling | None = None   # Llama 3's frequency scaling; None: plain RoPE
    qkv_bias: bool = False       # q_proj, k_proj, v_proj add a bias (qwen2, qwen2_moe)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False   # lm_head reuses embed_tokens
    max_position_embeddings: int = 32768
    # --- mixture of experts (qwen3_moe, qwen2_moe) ---
    num_experts: int = 0         # E routed experts per MoE layer (0: dense model)
    num_experts_per_tok: int = 0 # k experts chosen per token
    moe_intermediate_size: int = 0   # width of one expert's MLP
    norm_topk_prob: bool = False # renormalise the k chosen router weights to sum to 1
    decoder_sparse_step: int = 1 # every n-th layer is MoE ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... except these, which stay dense
    # qwen2_moe: width of the shared expert every token goes through
    shared_expert_intermediate_size: int = 0
    # --- special tokens ---
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.family not in ARCHITECTURES.values():
            raise ConfigError(f"unknown model family {self.family!r}; supported: "
                              + ", ".join(ARCHITECTURES.values()))
        moe, qwen2_moe = int(self.family in MOE_FAMILIES), int(self.family == "qwen2_moe")
        lowest = dict(vocab_size=1, hidden_size=1, intermediate_size=0, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=1, max_position_embeddings=1, decoder_sparse_step=1,
                      num_experts=0, num_experts_per_tok=moe, moe_intermediate_size=moe,
                      shared_expert_intermediate_size=qwen2_moe)
        for name, least in lowest.items():             # every size and count: an integer, in range
            if not is_int(v := getattr(self, name), least):
                raise ConfigError(f"{KEY.get(name, name)} must be an integer >= {least}, got {v!r}")
        for name in ("rope_theta", "rms_norm_eps"):   # 0 or less gives NaN logits, or none at all
            if not is_positive(v := getattr(self, name)):
                raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("mlp_only_layers", "eos_token_ids"):
            if not (isinstance(v := getattr(self, name), list) and all(map(is_int, v))):
                raise ConfigError(f"{KEY.get(name, name)} must be a list of integers >= 0: {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if moe and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                              f"1..num_experts ({self.num_experts})")
        r = self.rope_scaling
        if r is not None:
            if not all(map(is_positive, vars(r).values())):
                raise ConfigError(f"llama3 rope scaling needs all its factors and "
                                  f"original_max_position_embeddings > 0, got {r}")
            if r.high_freq_factor <= r.low_freq_factor:
                raise ConfigError("llama3 rope scaling needs high_freq_factor "
                                  f"({r.high_freq_factor}) > low_freq_factor "
                                  f"({r.low_freq_factor}): the blend divides by their difference")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each q and k head with RMSNorm before RoPE; Llama and Qwen2 do not."""
        return self.family in ("qwen3", "qwen3_moe")

    @property
    def is_moe(self) -> bool:
        """A family with routed experts (some of its layers may still be dense)."""
        return self.family in MOE_FAMILIES

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE's and Qwen2-MoE's rule: layer i is sparse unless listed in
        mlp_only_layers, and only every decoder_sparse_step-th layer is."""
        return (self.is_moe and self.num_experts > 0
                and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def expected_shape(self, key: str) -> tuple[int, ...] | None:
        """The shape of the loader's tensor `key` (common/loader.py names them; one expert's
        for e_*) that these numbers imply, for checking what a file holds."""
        C, D, V = self.hidden_size, self.head_dim, self.vocab_size
        F, Fe, E = self.intermediate_size, self.moe_intermediate_size, self.num_experts
        H, Hkv, Fs = self.num_heads, self.num_kv_heads, self.shared_expert_intermediate_size
        return {
            "attn_norm": (C,), "mlp_norm": (C,), "final_norm": (C,), "q_norm": (D,), "k_norm": (D,),
            "wq": (H * D, C), "wk": (Hkv * D, C), "wv": (Hkv * D, C), "wo": (C, H * D),
            "bq": (H * D,), "bk": (Hkv * D,), "bv": (Hkv * D,),
            "w_gate": (F, C), "w_up": (F, C), "w_down": (C, F),
            "router": (E, C), "e_gate": (Fe, C), "e_up": (Fe, C), "e_down": (C, Fe),
            "s_gate": (Fs, C), "s_up": (Fs, C), "s_down": (C, Fs), "shared_gate": (1, C),
            "embed": (V, C), "lm_head": (V, C),
        }.get(key)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        arch = archs[0] if isinstance(archs := d.get("architectures") or [None], list) else archs
        if arch is None:
            family = d.get("model_type") if d.get("model_type") in ARCHITECTURES.values() else None
            if family is None:
                raise ConfigError("config.json has no 'architectures' and an unknown 'model_type' "
                                  f"({d.get('model_type')!r}); supported: "
                                  + ", ".join(ARCHITECTURES))
        elif not isinstance(arch, str) or arch not in ARCHITECTURES:
            raise ConfigError(f"architecture {arch!r} is not supported; supported: "
                              + ", ".join(ARCHITECTURES))
        else:
            family = ARCHITECTURES[arch]

        def need(key: str):
            if key not in d or d[key] is None:
                raise ConfigError(f"missing the key {key!r} (needed for {family})")
            return d[key]

        if family in ("qwen3", "qwen3_moe", "llama") and d.get("attention_bias"):
            raise ConfigError(f"attention_bias=true is not supported for {family} (its "
                              "checkpoints have no bias; only qwen2 and qwen2_moe have q/k/v "
                              "biases)")
        if d.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported (the MLP projections have no bias)")
        if d.get("use_sliding_window") or "sliding_attention" in str(d.get("layer_types")):
            raise ConfigError("sliding-window attention (use_sliding_window=true) is not "
                              "supported; every layer must attend over the whole context")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
        scaling, theta = cls._rope(d)

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        moe = family in MOE_FAMILIES
        experts = d.get("num_experts", d.get("num_local_experts")) if moe else 0
        if moe and experts is None:
            raise ConfigError("missing the key 'num_experts' (or 'num_local_experts')")
        return cls(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or is_int(heads, 1) and is_int(hidden) and hidden // heads,
            rope_theta=theta,
            rope_scaling=scaling,
            # Qwen2 always has q/k/v biases; Qwen2-MoE has them unless qkv_bias says otherwise
            qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(d.get("qkv_bias", True))),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            num_experts=experts or 0,
            num_experts_per_tok=need("num_experts_per_tok") if moe else 0,
            moe_intermediate_size=need("moe_intermediate_size") if moe else 0,
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=d.get("mlp_only_layers") or [],
            shared_expert_intermediate_size=(need("shared_expert_intermediate_size")
                                             if family == "qwen2_moe" else 0),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=id_list(d.get("eos_token_id")),
        )

    @staticmethod
    def _rope(d: dict) -> tuple[RopeScaling | None, float]:
        """(Llama 3's RoPE scaling or None, theta), from 4.x's keys or 5.x's rope_parameters."""
        params, scaling_4x = d.get("rope_parameters") or {}, d.get("rope_scaling") or {}
        if not (isinstance(params, dict) and isinstance(scaling_4x, dict)):
            raise ConfigError("rope_parameters and rope_scaling must be JSON objects (or null)")
        rope = {**params, **scaling_4x}
        rope_type = (scaling_4x.get("rope_type") or scaling_4x.get("type")
                     or params.get("rope_type") or params.get("type") or "default")
        if rope_type not in ("default", "llama3"):
            raise ConfigError(f"rope type {rope_type!r} is not supported, only the default RoPE "
                              "and 'llama3' (Llama 3 / DeepSeek-R1-Distill-Llama scaling)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError("partial_rotary_factor must be 1: RoPE rotates the whole head")
        theta = d.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise ConfigError("missing the key 'rope_theta' (or 'rope_parameters.rope_theta')")
        if rope_type != "llama3":
            return None, theta
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings") if rope.get(k) is None]
        if missing:
            raise ConfigError(f"rope type 'llama3' needs {', '.join(missing)} in 'rope_scaling' "
                              "(or 'rope_parameters')")
        return RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                           rope["original_max_position_embeddings"]), theta

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        """The config of a model: a Hugging Face folder's config.json (and generation_config.json),
        or a GGUF file's metadata (a .gguf file, or a folder holding one)."""
        g = gguf_path(folder)
        path = g or Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: --model must be a Hugging Face model folder "
                              "(config.json, *.safetensors, tokenizer.json) or a known model name")
        if g is not None:
            from common.gguf import open_gguf    # GGUF code loads only for a GGUF model
        fields = open_gguf(g).config_fields() if g else read_json(path)
        try:
            cfg = cls(**fields) if g else cls.from_dict(fields)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        cls._add_generation_eos(cfg, Path(folder))
        return cfg

    @staticmethod
    def _add_generation_eos(cfg: "ModelConfig", folder: Path) -> None:
        """generation_config.json may list more end-of-turn ids (Qwen3: <|im_end|> and
        <|endoftext|>)."""
        gen = folder / "generation_config.json"
        if folder.is_dir() and gen.is_file():
            g = read_json(gen).get("eos_token_id")
            if not all(map(is_int, id_list(g))):
                raise ConfigError(f"{gen}: eos_token_id must be an id or a list of ids, got {g!r}")
            for t in id_list(g):
                if t not in cfg.eos_token_ids:
                    cfg.eos_token_ids.append(t)
