"""The paged KV cache: one pool of pages shared by every sequence.

Changed from stage 1: instead of one [L, 2, Hkv, T_max, D] cache for the single
sequence, two pools (K and V) of NB pages of P positions each, [L, NB, P, Hkv, D].
A sequence owns whichever pages the block manager gave it; a token's slot
page * P + offset says where its K/V row goes (store) and the block tables say
where to read a sequence's positions back (attention). Per layer, a pool is a
contiguous [NB, P, Hkv, D] block the kernels index directly.
"""
from __future__ import annotations

import numpy as np

from common.config import ModelConfig
from . import kernels


class KVCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, xp=np):
        self.num_pages, self.page_size = num_pages, page_size
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_pool = xp.zeros(shape, dtype=np.float32)    # [L, NB, P, Hkv, D]
        self.v_pool = xp.zeros(shape, dtype=np.float32)    # [L, NB, P, Hkv, D]

    def store(self, layer: int, k, v, slot_mapping) -> None:
        """Write the new tokens' k, v [N, Hkv, D] into their slots [N] of this layer's pages."""
        kernels.store_kvcache(k, v, self.k_pool[layer], self.v_pool[layer], slot_mapping)

    def keys(self, layer: int):
        return self.k_pool[layer]      # [NB, P, Hkv, D]

    def values(self, layer: int):
        return self.v_pool[layer]      # [NB, P, Hkv, D]

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int) -> int:
        """K and V of one page, all layers, float32: what one page costs in --kv-memory."""
        return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * 4

    @property
    def nbytes_per_token(self) -> int:
        L, _, _, Hkv, D = self.k_pool.shape
        return L * 2 * Hkv * D * 4
