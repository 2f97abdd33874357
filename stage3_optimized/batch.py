"""BatchInfo: everything the model needs to know about a packed batch, explicitly.

Changed from stage 2, lesson by lesson (docs/lessons/stage3):
  * The longest context stays a host int (`max_context`): decode attention sizes its grid by
    it and the model checks max_ctx against it, where stage 2 read it back from the device,
    a sync per step.
  * The prefill tokens are also cut into tiles of up to 16 consecutive tokens of one
    sequence (`tile_start`, `tile_count`), the unit of work of the tensor-core prefill
    kernel (cuda/prefill_attention_tc.cu).
  * SamplingInputs: the sampling parameters of the rows that sample, the sampling kernel's
    other input.

As in stage 2 (stage 1's forward takes one sequence and a `start_pos`), the tokens of S
sequences are packed into one array of N tokens, decode sequences first (one token
each), then prefill chunks. For each token the model needs its position (RoPE, causal
mask), its slot in the paged cache (where its K/V go), and for each sequence its block
table and context length (where to read K/V from). A sequence with a prefix-cache hit
simply starts at num_computed > 0, like the next chunk of a chunked prefill. The
scheduler's choices become these arrays here, on the host, once per step; they are
passed to the model as an argument, never through a global.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .sequence import Sequence

PREFILL_TILE = 16                 # query tokens per tile of the tensor-core prefill kernel


@dataclass
class BatchInfo:
    num_decode: int               # the first num_decode sequences (and tokens) have one query each
    positions: np.ndarray         # [N] int32  position of each token in its own sequence
    slot_mapping: np.ndarray      # [N] int32  page * P + offset: where each token's K/V are stored
    token_seq: np.ndarray         # [N] int32  which sequence (row of block_tables) each token is in
    block_tables: np.ndarray      # [S, max_blocks] int32  pages of each sequence (padded with 0)
    context_lens: np.ndarray      # [S] int32  positions in the cache once this step's tokens are in
    query_start: np.ndarray       # [S+1] int32  token offsets of the sequences in the packed batch
    logits_rows: np.ndarray       # [S'] int32  packed rows whose logits are needed (last token of
                                  #             each sequence that samples a token this step)
    tile_start: np.ndarray        # [n_tiles] int32  first token of each prefill tile, counted from
                                  #             the first prefill token (the batch's num_decode-th)
    tile_count: np.ndarray        # [n_tiles] int32  its tokens (1..16), all of one sequence
    max_context: int = 0          # max(context_lens), kept on the host: sizing a launch grid or
                                  #             checking max_ctx needs no device-to-host copy

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def to(self, xp) -> "BatchInfo":
        """A copy with every array on xp's device (cupy: one host-to-device copy each)."""
        return BatchInfo(**{f.name: (xp.asarray(getattr(self, f.name))
                                     if isinstance(getattr(self, f.name), np.ndarray)
                                     else getattr(self, f.name)) for f in fields(self)})


@dataclass
class SamplingInputs:
    """The sampling parameters of the rows that sample (kernels.sample's arguments)."""
    temperature: np.ndarray       # [S'] float32 (0: greedy)
    top_k: np.ndarray             # [S'] int32 (0: off)
    top_p: np.ndarray             # [S'] float32 (1: off)
    u: np.ndarray                 # [S'] float32 uniform numbers, each from its request's generator

    def to(self, xp) -> "SamplingInputs":
        """A copy on xp's device (cupy: one host-to-device copy per array)."""
        return SamplingInputs(*(xp.asarray(getattr(self, f.name)) for f in fields(self)))


def build_batch(seqs: list[Sequence], num_tokens: list[int],
                page_size: int) -> tuple[list[Sequence], np.ndarray, BatchInfo]:
    """The scheduler's (sequence, tokens to feed) pairs -> (seqs in batch order, token ids [N],
    BatchInfo). Batch order: decode sequences (one token) first, so the decode kernel takes a prefix
    of the batch and the prefill kernel the rest."""
    order = sorted(range(len(seqs)), key=lambda i: num_tokens[i] != 1)   # stable: decodes first
    seqs = [seqs[i] for i in order]
    counts = [num_tokens[i] for i in order]
    num_decode = sum(1 for n in counts if n == 1)

    tokens, positions, slots, token_seq, logits_rows = [], [], [], [], []
    query_start = [0]
    for s, (seq, n) in enumerate(zip(seqs, counts)):
        start = seq.num_computed
        pos = np.arange(start, start + n)
        table = np.asarray(seq.block_table, dtype=np.int64)
        tokens.extend(seq.token_ids[start:start + n])
        positions.append(pos)
        slots.append(table[pos // page_size] * page_size + pos % page_size)
        token_seq.append(np.full(n, s))
        query_start.append(query_start[-1] + n)
        # the whole sequence is in: sample its next token
        if start + n == len(seq.token_ids):
            logits_rows.append(query_start[-1] - 1)

    # prefill tiles: each chunk (the sequences after the decodes) cut into runs of <= 16 tokens
    tile_start, tile_count = [], []
    for s in range(num_decode, len(seqs)):
        for t in range(query_start[s], query_start[s + 1], PREFILL_TILE):
            tile_start.append(t - query_start[num_decode])
            tile_count.append(min(PREFILL_TILE, query_start[s + 1] - t))

    max_blocks = max(len(seq.block_table) for seq in seqs)
    block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    for s, seq in enumerate(seqs):
        block_tables[s, :len(seq.block_table)] = seq.block_table
    i32 = lambda parts: np.concatenate(parts).astype(np.int32)  # noqa: E731
    info = BatchInfo(
        num_decode=num_decode,
        positions=i32(positions),
        slot_mapping=i32(slots),
        token_seq=i32(token_seq),
        block_tables=block_tables,
        context_lens=np.array([seq.num_computed + n
                               for seq, n in zip(seqs, counts)], dtype=np.int32),
        query_start=np.array(query_start, dtype=np.int32),
        logits_rows=np.array(logits_rows, dtype=np.int32),
        tile_start=np.array(tile_start, dtype=np.int32),
        tile_count=np.array(tile_count, dtype=np.int32),
        max_context=max(seq.num_computed + n for seq, n in zip(seqs, counts)),
    )
    return seqs, np.array(tokens, dtype=np.int32), info
