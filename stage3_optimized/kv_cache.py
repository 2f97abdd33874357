"""The paged KV cache: one pool of pages shared by every sequence.

Changed from stage 2, lesson by lesson (docs/lessons/stage3):
  * The rows are written by the fused qk_norm_rope_store kernel (model.py), so `store` is
    gone.
  * The pages hold bf16 (uint16 bits), half the bytes of fp32, so the same memory holds
    twice the positions and decode attention reads half as much.

As in stage 2: two pools (K and V) of NB pages of P positions each, [L, NB, P, Hkv, D];
a token's slot page * P + offset says where its K/V row goes and the block tables say
where to read a sequence's positions back. With prefix caching a page may appear in
several block tables: it is read by all of them and written by none (block_manager.py).
"""
from __future__ import annotations

import numpy as np

from common.config import ModelConfig
from .ops import BF16


class KVCache:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, xp=np):
        self.num_pages, self.page_size = num_pages, page_size
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k_pool = xp.zeros(shape, dtype=BF16)          # [L, NB, P, Hkv, D] bf16
        self.v_pool = xp.zeros(shape, dtype=BF16)          # [L, NB, P, Hkv, D] bf16

    def keys(self, layer: int):
        return self.k_pool[layer]      # [NB, P, Hkv, D]

    def values(self, layer: int):
        return self.v_pool[layer]      # [NB, P, Hkv, D]

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int) -> int:
        """K and V of one page, all layers, bf16: what one page costs in --kv-memory."""
        return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * 2

    @property
    def nbytes_per_token(self) -> int:
        L, _, _, Hkv, D = self.k_pool.shape
        return L * 2 * Hkv * D * 2
