"""ModelConfig: the numbers a stage needs, read from a model folder's config.json.

Three families share one dataclass:
  qwen3      Qwen3ForCausalLM      per-head RMSNorm on q and k before RoPE
  qwen3_moe  Qwen3MoeForCausalLM   the same attention, a routed MoE MLP
  llama      LlamaForCausalLM      no q/k norm (SmolLM2, DeepSeek's dense layout)

Real checkpoints use transformers 4.x keys (rope_theta, num_experts); models
saved by transformers 5.x use rope_parameters and num_local_experts. Both work.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
}


class ConfigError(ValueError):
    """A config.json this engine cannot run; the message says which key and why."""


@dataclass
class ModelConfig:
    family: str                  # "qwen3" | "qwen3_moe" | "llama"
    vocab_size: int              # V
    hidden_size: int             # C
    intermediate_size: int       # F, the dense MLP width
    num_layers: int              # L
    num_heads: int               # H query heads
    num_kv_heads: int            # Hkv key/value heads (GQA: H % Hkv == 0)
    head_dim: int                # D
    rope_theta: float = 10000.0  # RoPE base
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False   # lm_head reuses embed_tokens
    max_position_embeddings: int = 32768
    # --- mixture of experts (qwen3_moe only) ---
    num_experts: int = 0         # E routed experts per MoE layer (0: dense model)
    num_experts_per_tok: int = 0 # k experts chosen per token
    moe_intermediate_size: int = 0   # width of one expert's MLP
    norm_topk_prob: bool = False # renormalise the k chosen router weights to sum to 1
    decoder_sparse_step: int = 1 # every n-th layer is MoE ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... except these, which stay dense
    # --- special tokens ---
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.family not in ARCHITECTURES.values():
            raise ConfigError(f"unknown model family {self.family!r}; supported: qwen3, qwen3_moe, llama")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotate-half RoPE, got {self.head_dim}")
        if self.family == "qwen3_moe" and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                              f"({self.num_experts})")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each q and k head with RMSNorm before RoPE; Llama does not."""
        return self.family != "llama"

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen3-MoE's rule: layer i is sparse unless listed in mlp_only_layers,
        and only every decoder_sparse_step-th layer is."""
        return (self.family == "qwen3_moe" and self.num_experts > 0
                and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        arch = (d.get("architectures") or [None])[0]
        if arch is None:
            family = {"qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama"}.get(d.get("model_type"))
            if family is None:
                raise ConfigError("config.json has no 'architectures' and an unknown 'model_type' "
                                  f"({d.get('model_type')!r}); supported: " + ", ".join(ARCHITECTURES))
        elif arch not in ARCHITECTURES:
            raise ConfigError(f"architecture {arch!r} is not supported; supported: " + ", ".join(ARCHITECTURES))
        else:
            family = ARCHITECTURES[arch]

        def need(key: str):
            if key not in d or d[key] is None:
                raise ConfigError(f"config.json is missing the key {key!r} (needed for {family})")
            return d[key]

        if d.get("attention_bias"):
            raise ConfigError("attention_bias=true is not supported (Qwen3 and Llama checkpoints have no bias)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported; only 'silu' (SwiGLU)")
        scaling = d.get("rope_scaling") or {}
        rope_params = d.get("rope_parameters") or {}
        rope_type = scaling.get("rope_type", scaling.get("type")) or rope_params.get("rope_type", "default")
        if rope_type not in ("default", None):
            raise ConfigError(f"rope type {rope_type!r} is not supported; only the default RoPE")
        # transformers 4.x: rope_theta at top level; 5.x: inside rope_parameters
        theta = d.get("rope_theta", rope_params.get("rope_theta"))
        if theta is None:
            raise ConfigError("config.json is missing the key 'rope_theta' (or 'rope_parameters.rope_theta')")

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        moe = family == "qwen3_moe"
        experts = d.get("num_experts", d.get("num_local_experts")) if moe else 0
        if moe and experts is None:
            raise ConfigError("config.json is missing the key 'num_experts' (or 'num_local_experts')")
        return cls(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            num_experts=int(experts or 0),
            num_experts_per_tok=int(need("num_experts_per_tok")) if moe else 0,
            moe_intermediate_size=int(need("moe_intermediate_size")) if moe else 0,
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: --model must be a Hugging Face model folder "
                              "(config.json, *.safetensors, tokenizer.json) or a known model name")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        cfg = cls.from_dict(d)
        # generation_config.json may list more end-of-turn ids (Qwen3: <|im_end|> and <|endoftext|>)
        gen = Path(folder) / "generation_config.json"
        if gen.is_file():
            try:
                g = json.loads(gen.read_text()).get("eos_token_id")
            except json.JSONDecodeError:
                g = None
            for t in ([g] if isinstance(g, int) else (g or [])):
                if t not in cfg.eos_token_ids:
                    cfg.eos_token_ids.append(t)
        return cfg
