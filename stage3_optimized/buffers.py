"""Every array a step writes, allocated once: the activations, and the inputs' one upload.

Changed from stage 2: a new file. Stage 2 writes its layer loop's outputs into fp32
buffers kept from step to step (model.Scratch) but allocates what its kernels make
outside the loop (the logits, attention's partial results, the sampled ids), and copies
each of a step's BatchInfo arrays to the device on its own. On a GPU each of those is a
call the host pays for (a `cupy.empty` about 2 us, a copy from pageable memory more:
bench/host_costs.json), and a decode step of one sequence computes in about a third of a
millisecond: the host, not the GPU, sets its pace. Here:

  * `Activations`: one buffer per intermediate of the forward pass (the residual stream, the
    QKV output, q, attention's output, the MLP's, the logits, ...), sized for the largest
    step the scheduler can make (token_budget tokens, `slots` sequences). A step takes views
    of their first rows (`take`): a view costs no device call.
  * `StepInputs`: every number a step sends from the host (token ids, positions, slots,
    block tables, tiles, the sampling parameters) packed into one page-locked buffer and
    copied in one transfer; the arrays the kernels read are views of its device twin.
  * The same addresses every step are what a CUDA graph needs (cuda_graphs.py): a field of
    StepInputs lands where the sizes of the fields before it put it, so two steps with the
    same sizes (a graph's decode bucket) read their inputs at the same addresses.

device="cpu" uses numpy arrays for both (the host buffer is the "device" one).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from common.config import ModelConfig
from . import kernels
from .batch import BatchInfo, SamplingInputs
from .ops import BF16


@dataclass
class Activations:
    """The forward pass's intermediates, [rows, ...] for the largest step; `take(N, S)` gives a
    step of N tokens and S sequences that sample its views."""
    x: object             # [T, C] float32  the residual stream (every block adds into it)
    h: object             # [T, C] bf16     RMSNorm's output, the input of an unfused GEMM
    qkv: object           # [T, (H + 2 Hkv) D] bf16
    q: object             # [T, H, D] bf16  q after its norm and RoPE
    att: object           # [T, H, D] bf16  attention's output
    gate_up: object       # [T, 2F] bf16
    act: object           # [T, F] bf16     SwiGLU's output (an unfused MLP)
    attn_scratch: object  # [S * H * splits * (D + 2)] float32: decode attention's partial results
    logits: object        # [S, V] float32
    next_tokens: object   # [S] int32       the sampled ids

    @classmethod
    def allocate(cls, xp, cfg: ModelConfig, max_tokens: int,
                 max_seqs: int, max_ctx: int) -> "Activations":
        T, S = max_tokens, max_seqs
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        C, F = cfg.hidden_size, cfg.intermediate_size
        return cls(x=xp.zeros((T, C), np.float32), h=xp.zeros((T, C), BF16),
                   qkv=xp.zeros((T, (H + 2 * Hkv) * D), BF16), q=xp.zeros((T, H, D), BF16),
                   att=xp.zeros((T, H, D), BF16), gate_up=xp.zeros((T, 2 * F), BF16),
                   act=xp.zeros((T, F), BF16),
                   attn_scratch=xp.zeros(S * H * kernels.decode_splits(max_ctx) * (D + 2),
                                         np.float32),
                   logits=xp.zeros((S, cfg.vocab_size), np.float32),
                   next_tokens=xp.zeros(S, np.int32))

    def take(self, N: int, S: int) -> "Activations":
        """Views of the first N token rows and S sequence rows (the scratch whole)."""
        per_seq = ("logits", "next_tokens")
        return replace(self, **{f.name: getattr(self, f.name)[:S] if f.name in per_seq
                                else getattr(self, f.name)[:N]
                                for f in fields(self) if f.name != "attn_scratch"})

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(self, f.name).nbytes) for f in fields(self))


# a step's inputs, in the order they are packed: BatchInfo's arrays, the token ids, and the
# sampling parameters of the S' rows that sample (float fields travel as their 32 bits)
INT_FIELDS = ("tokens", "positions", "slot_mapping", "token_seq", "context_lens", "query_start",
              "logits_rows", "tile_start", "tile_count", "top_k", "block_tables")
FLOAT_FIELDS = ("temperature", "top_p", "u")


class StepInputs:
    """One page-locked host buffer and its device twin, big enough for the largest step."""

    def __init__(self, xp, max_tokens: int, max_seqs: int, max_blocks: int):
        T, S = max_tokens, max_seqs
        # tokens, positions, slots, token_seq; context_lens, query_start, logits_rows, top_k;
        # the tiles (a chunk of n tokens has ceil(n / 16) of them); block tables; the floats
        n = 4 * T + 4 * S + 1 + 2 * (T // 16 + S) + S * max_blocks + 3 * S
        self.xp = xp
        self.device = xp.zeros(n, np.int32)
        # numpy: the host buffer is the device's
        if not kernels._on_gpu(self.device):
            self.pinned, self.host = None, self.device
        else:
            self.pinned = xp.cuda.alloc_pinned_memory(n * 4)
            # (what cupyx.empty_pinned does)
            self.host = np.ndarray(n, np.int32, buffer=self.pinned)
        self.copied = None                    # a CUDA event after the last copy (it reads `host`)

    def upload(self, tokens: np.ndarray, batch: BatchInfo, sampling: SamplingInputs | None = None):
        """Host arrays -> (tokens, batch, sampling) as views of the device buffer: one copy."""
        if self.copied is not None:
            # the last copy has read the host buffer
            self.copied.synchronize()
        arrays = dict(tokens=tokens, **{f.name: getattr(batch, f.name) for f in fields(batch)
                                        if isinstance(getattr(batch, f.name), np.ndarray)})
        if sampling is not None:
            arrays.update(vars(sampling))
        places, at = {}, 0
        for name in INT_FIELDS + FLOAT_FIELDS:
            if name not in arrays:
                continue
            a = np.asarray(arrays[name])
            assert at + a.size <= self.host.size, f"a step's inputs outgrow StepInputs at {name!r}"
            dtype = np.float32 if name in FLOAT_FIELDS else np.int32
            self.host[at:at + a.size].view(dtype)[...] = a.reshape(-1)
            places[name] = (at, a.shape, dtype)
            at += a.size
        self._copy(at)
        view = {name: self.device[a:a + int(np.prod(shape))].view(dtype).reshape(shape)
                for name, (a, shape, dtype) in places.items()}
        dev_batch = replace(batch,
                            **{f.name: view[f.name] for f in fields(batch) if f.name in view})
        dev_sampling = (None if sampling is None
                        else SamplingInputs(*(view[f.name] for f in fields(SamplingInputs))))
        return view["tokens"], dev_batch, dev_sampling

    def _copy(self, n: int) -> None:
        """host[:n] -> device[:n]: one asynchronous copy from pinned memory (none on the CPU)."""
        if self.pinned is None:
            return
        stream = self.xp.cuda.get_current_stream()
        self.device[:n].set(self.host[:n], stream=stream)
        if self.copied is None:
            self.copied = self.xp.cuda.Event(disable_timing=True)
        self.copied.record(stream)
