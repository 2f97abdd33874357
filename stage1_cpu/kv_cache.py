"""The KV cache of one sequence, [L, 2, Hkv, T_max, D] (0 = K, 1 = V): a kv head's positions
are contiguous, so attention streams its keys as one block. np.zeros hands out untouched
pages, so a large --max-ctx costs no memory until the conversation grows into it."""
from __future__ import annotations

import numpy as np

from common.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, max_ctx: int):
        self.max_ctx = max_ctx
        self.data = np.zeros((cfg.num_layers, 2, cfg.num_kv_heads, max_ctx, cfg.head_dim),
                             dtype=np.float32)    # [L, 2, Hkv, T_max, D]

    def store(self, layer: int, start_pos: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write the new tokens' k, v [T, Hkv, D] at positions start_pos..start_pos+T-1."""
        T = k.shape[0]
        self.data[layer, 0, :, start_pos:start_pos + T] = k.transpose(1, 0, 2)   # [Hkv, T, D]
        self.data[layer, 1, :, start_pos:start_pos + T] = v.transpose(1, 0, 2)

    def keys(self, layer: int) -> np.ndarray:
        return self.data[layer, 0]     # [Hkv, T_max, D]

    def values(self, layer: int) -> np.ndarray:
        return self.data[layer, 1]     # [Hkv, T_max, D]

    @property
    def nbytes_per_token(self) -> int:
        L, _, Hkv, _, D = self.data.shape
        return L * 2 * Hkv * D * 4
