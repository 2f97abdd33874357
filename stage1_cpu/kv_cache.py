"""The KV cache of one sequence: every layer's keys and values for positions 0..max_ctx-1.

Layout [L, 2, Hkv, T_max, D] (index 0 = K, 1 = V): for one layer and one kv head
the positions are contiguous, so attention streams each head's keys as one block.
The array is allocated with np.zeros, which the OS hands out as untouched pages:
memory is only committed for positions actually written, so a large --max-ctx
costs nothing until the conversation grows into it.
"""
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
