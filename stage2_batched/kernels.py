"""Launch a CUDA kernel for cupy arrays, run its numpy twin for numpy arrays.

Changed from stage 1: the fast twins of ops.py are CUDA C kernels (one .cu file
each under cuda/, compiled at first use by cupy.RawModule with NVRTC) instead of
numba functions. Every function takes and returns arrays of one kind: cupy arrays
on device="cuda" run the kernel, numpy arrays on device="cpu" run the twin in
ops.py, so the engine, paging and scheduling run and are tested without a GPU.

The wrappers make inputs contiguous float32 / int32, choose the launch grid the
.cu header documents, and pass scalars as numpy scalars of the C type the kernel
declares (int -> np.int32, float -> np.float32). Each writes its result into the
`out=` buffer it is given (model.py's Scratch: the step's buffers, kept from step
to step) or, given none, into a new array. A kernel never writes the array it
reads (the .cu files declare their pointers __restrict__), so out is another buffer.
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from . import ops

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
KERNEL_FILES = {                      # kernel name -> its .cu file under cuda/
    "embedding": "embedding.cu",
    "rmsnorm": "rmsnorm.cu",
    "rope": "rope.cu",
    "store_kvcache": "store_kvcache.cu",
    "paged_decode_attention": "decode_attention.cu",
    "prefill_attention": "prefill_attention.cu",
    "silu_mul": "silu_mul.cu",
    "residual_add": "residual_add.cu",
}
MAX_HEAD_DIM = 256                    # the attention kernels keep D/32 values per lane in registers


@functools.cache
def _kernel(name: str):
    """Compile the kernel's .cu file once per process (cupy also caches the binary on disk)."""
    import cupy
    code = (CUDA_DIR / KERNEL_FILES[name]).read_text()
    return cupy.RawModule(code=code, options=("--std=c++17",)).get_function(name)


def _on_gpu(x) -> bool:
    return not isinstance(x, np.ndarray)


def _f32(x):
    import cupy
    return cupy.ascontiguousarray(x, dtype=cupy.float32)


def _i32(x):
    import cupy
    return cupy.ascontiguousarray(x, dtype=cupy.int32)


def _blocks(n: int, per_block: int = 256) -> int:
    return (n + per_block - 1) // per_block


def _output(out, shape):
    """The caller's buffer, checked against the kernel's output shape, or a new array
    (on a GPU a `cupy.empty`: a call the host pays for, which the buffer saves)."""
    import cupy
    if out is None:
        return cupy.empty(shape, dtype=cupy.float32)
    assert out.shape == tuple(shape) and out.flags.c_contiguous, \
        f"out {out.shape} is not a contiguous buffer of the output's shape {tuple(shape)}"
    return out


def _twin(value, out):
    """A twin's result, copied into out when the caller gives one: on both devices the
    caller then reads its result from the same buffer."""
    if out is None:
        return value
    out[...] = value
    return out


def matmul(x, w, out=None):
    """x [N, K] @ w [K, M] -> [N, M]: one cuBLAS GEMM on the GPU (cupy.matmul), numpy's on cpu."""
    if not _on_gpu(x):
        return np.matmul(x, w, out=out)
    import cupy
    return cupy.matmul(x, w, out=out)


def embedding(ids, table, out=None):
    """ids [N] int32, table [V, C] -> [N, C]"""
    if not _on_gpu(table):
        return _twin(ops.embedding(ids, table), out)
    N, C = ids.shape[0], table.shape[1]
    out = _output(out, (N, C))
    if N:
        _kernel("embedding")((N,), (256,), (_i32(ids), _f32(table), out, np.int32(C)))
    return out


def rmsnorm(x, w, eps: float, out=None):
    """x [..., C], w [C] -> [..., C]; every row of C values is normalised on its own."""
    if not _on_gpu(x):
        return _twin(ops.rmsnorm(x, w, eps), out)
    x = _f32(x)
    C = x.shape[-1]
    rows = x.size // C
    out = _output(out, x.shape)
    if rows:
        _kernel("rmsnorm")((rows,), (256,), (x, _f32(w), out, np.int32(C), np.float32(eps)))
    return out


def rope(x, cos, sin, out=None):
    """x [N, H, D], cos/sin [N, D/2] (each token's own row) -> [N, H, D]"""
    if not _on_gpu(x):
        return _twin(ops.rope(x, cos, sin), out)
    x = _f32(x)
    N, H, D = x.shape
    out = _output(out, x.shape)
    if N:
        _kernel("rope")((N,), (128,), (x, out, _f32(cos), _f32(sin), np.int32(H), np.int32(D)))
    return out


def store_kvcache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v [N, Hkv, D] -> written into k_cache, v_cache [NB, P, Hkv, D] at slot_mapping [N]."""
    if not _on_gpu(k_cache):
        return ops.store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    N, Hkv, D = k.shape
    assert k_cache.flags.c_contiguous and v_cache.flags.c_contiguous, "the pool must be contiguous"
    if N:
        _kernel("store_kvcache")((N,), (128,), (_f32(k), _f32(v), k_cache, v_cache,
                                                _i32(slot_mapping), np.int32(Hkv * D)))


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out=None):
    """q [S, H, D] (one query per sequence), pages [NB, P, Hkv, D], block_tables [S, max_blocks],
    context_lens [S] -> [S, H, D]"""
    if not _on_gpu(q):
        return _twin(ops.paged_decode_attention(q, k_cache, v_cache,
                                                block_tables, context_lens), out)
    q = _f32(q)
    S, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert D <= MAX_HEAD_DIM, (
        f"head_dim {D} > {MAX_HEAD_DIM} is not supported by the attention kernels")
    out = _output(out, q.shape)
    if S:
        block_tables = _i32(block_tables)
        _kernel("paged_decode_attention")(
            (S, H), (128,),
            (q, k_cache, v_cache, block_tables, _i32(context_lens), out,
             np.int32(H), np.int32(Hkv), np.int32(D), np.int32(P),
             np.int32(block_tables.shape[1]), np.float32(1.0 / np.sqrt(D))))
    return out


def prefill_attention(q, k_cache, v_cache, block_tables, token_seq, positions, out=None):
    """q [N, H, D] packed prefill tokens; token n reads the block table row token_seq[n] and
    sees positions 0..positions[n] -> [N, H, D]"""
    if not _on_gpu(q):
        return _twin(ops.prefill_attention(q, k_cache, v_cache, block_tables,
                                           token_seq, positions), out)
    q = _f32(q)
    N, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert D <= MAX_HEAD_DIM, (
        f"head_dim {D} > {MAX_HEAD_DIM} is not supported by the attention kernels")
    out = _output(out, q.shape)
    if N:
        block_tables = _i32(block_tables)
        warps = 4                                    # query tokens per block (WARPS in the .cu)
        _kernel("prefill_attention")(
            ((N + warps - 1) // warps, H), (32 * warps,),
            (q, k_cache, v_cache, block_tables, _i32(token_seq), _i32(positions), out,
             np.int32(N), np.int32(H), np.int32(Hkv), np.int32(D), np.int32(P),
             np.int32(block_tables.shape[1]), np.float32(1.0 / np.sqrt(D))))
    return out


def silu_mul(gate, up, out=None):
    """[N, F], [N, F] -> silu(gate) * up [N, F]"""
    if not _on_gpu(gate):
        return _twin(ops.silu_mul(gate, up), out)
    gate, up = _f32(gate), _f32(up)
    out = _output(out, gate.shape)
    if gate.size:
        _kernel("silu_mul")((_blocks(gate.size),), (256,), (gate, up, out, np.int64(gate.size)))
    return out


def residual_add(x, y, out=None):
    """[N, C], [N, C] -> x + y [N, C]"""
    if not _on_gpu(x):
        return _twin(ops.residual_add(x, y), out)
    x, y = _f32(x), _f32(y)
    out = _output(out, x.shape)
    if x.size:
        _kernel("residual_add")((_blocks(x.size),), (256,), (x, y, out, np.int64(x.size)))
    return out


def route(logits, k: int, norm: bool):
    """MoE routing, on the host: the router's logits [T, E] (copied back from the device)
    -> each token's top-k experts [T, k] and their weights [T, k] (ops.route)."""
    return ops.route(to_host(logits), k, norm)


def to_host(x) -> np.ndarray:
    """A device array as numpy (a copy from the GPU; the array itself on cpu)."""
    return x if isinstance(x, np.ndarray) else x.get()
