"""Launch a CUDA kernel for cupy arrays, run its numpy twin for numpy arrays.

Changed from stage 2: bf16 arrays and fused kernels. A bf16 array is a uint16
array of its bits on both devices (so the same code runs on CuPy versions with and
without a bfloat16 dtype, and a kernel's `unsigned short*` takes it as is). The
GEMM is cuBLAS gemmEx with bf16 inputs and fp32 accumulation (CUBLAS_COMPUTE_32F)
called through cupy.cuda.cublas, instead of cupy.matmul on float32. The fused
kernels replace stage 2's rmsnorm + residual_add (add_rmsnorm), rmsnorm + rope +
store_kvcache (qk_norm_rope_store) and silu_mul (swiglu, which reads the fused
gate/up GEMM's output). Decode attention is two launches (the GQA-shared split kernel
and the merge); prefill attention runs on tensor cores (prefill_attention_tc.cu) where
the head dim allows, with the plain kernel beside it; `sample` picks tokens on the device.

The wrappers make inputs contiguous, allocate the output, choose the launch grid
the .cu header documents, and pass scalars as numpy scalars of the C type the
kernel declares (int -> np.int32, float -> np.float32).
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from . import ops

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
KERNEL_FILES = {                      # kernel name -> its .cu file under cuda/
    "embedding": "embedding.cu",
    "add_rmsnorm": "add_rmsnorm.cu",
    "qk_norm_rope_store": "qk_norm_rope_store.cu",
    "swiglu": "swiglu.cu",
    "paged_decode_attention": "decode_attention.cu",
    "merge_attention": "decode_attention.cu",
    "prefill_attention": "prefill_attention.cu",
    "prefill_attention_tc": "prefill_attention_tc.cu",
    "sample": "sample.cu",
}
MAX_GRID_Y = 65535                    # a launch's grid.y limit (grid.x goes to 2^31 - 1)
MAX_HEAD_DIM = 256                    # the attention kernels keep D/32 values per lane in registers
TC_MAX_HEAD_DIM, TC_WARPS = 128, 4     # the tensor-core prefill: O in registers, 4 heads per block

# cuBLAS / CUDA enums (cublas_api.h, library_types.h): named here so the call reads
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0


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


def _bf16(x):
    import cupy
    assert x.dtype == np.uint16, f"expected bf16 bits (uint16), got {x.dtype}"
    return cupy.ascontiguousarray(x)


def _ptr(x) -> int:
    """The device address of a cupy array (what a cuBLAS call takes)."""
    return x.data.ptr


def _i32(x):
    import cupy
    return cupy.ascontiguousarray(x, dtype=cupy.int32)


def to_bf16(x):
    """float32 -> bf16 bits, round to nearest even, on either device (the MoE sum, Qwen2's biased q/k/v)."""
    if not _on_gpu(x):
        return ops.bf16_bits(x)
    import cupy
    u = _f32(x).view(cupy.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)


def linear(x, w, out_f32: bool = False):
    """x [N, K] bf16 @ w [M, K] bf16 .T -> [N, M] bf16 (float32 with out_f32), fp32 accumulation.
    cuBLAS is column-major: the row-major out [N, M] is, to cuBLAS, the column-major
    out^T [M, N] = W [M, K] . x^T [K, N]; the row-major W [M, K] is to it a K x M matrix,
    so it is read with op T, and x [N, K] is a K x N matrix read as is."""
    if not _on_gpu(w):
        return ops.linear(x, w, out_f32)
    import cupy
    from cupy.cuda import cublas
    x = _bf16(x)
    N, K = x.shape
    M = w.shape[0]
    out = cupy.empty((N, M), dtype=cupy.float32 if out_f32 else cupy.uint16)
    if N == 0:
        return out
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)        # alpha and beta are host floats:
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)   # (fp32, the compute type's scalars)
    cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, M, N, K,
                  one.ctypes.data, _ptr(w), CUDA_R_16BF, K,
                  _ptr(x), CUDA_R_16BF, K,
                  zero.ctypes.data, _ptr(out), CUDA_R_32F if out_f32 else CUDA_R_16BF, M,
                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    return out


def embedding(ids, table):
    """ids [N] int32, table [V, C] bf16 -> [N, C] bf16"""
    if not _on_gpu(table):
        return ops.embedding(ids, table)
    import cupy
    N, C = ids.shape[0], table.shape[1]
    out = cupy.empty((N, C), dtype=cupy.uint16)
    if N:
        _kernel("embedding")((N,), (128,), (_i32(ids), table, out, np.int32(C)))
    return out


def add_rmsnorm(x, residual, w, eps: float):
    """x [N, C] bf16, residual [N, C] float32 or None (the first block), w [C] bf16
    -> (h [N, C] bf16, residual + x [N, C] float32). The residual is updated in place."""
    if not _on_gpu(x):
        return ops.add_rmsnorm(x, residual, w, eps)
    import cupy
    x = _bf16(x)
    N, C = x.shape
    first = residual is None
    residual = cupy.empty((N, C), dtype=cupy.float32) if first else _f32(residual)
    h = cupy.empty((N, C), dtype=cupy.uint16)
    if N:
        _kernel("add_rmsnorm")((N,), (256,), (x, residual, _bf16(w), h, np.int32(C), np.float32(eps),
                                              np.int32(0 if first else 1)))
    return h, residual


def qk_norm_rope_store(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping,
                       H: int, Hkv: int, eps: float):
    """qkv [N, (H + 2 Hkv) D] bf16, norms [D] bf16 or None, cos/sin [N, D/2] float32,
    pages [NB, P, Hkv, D] bf16 (k, v written at slot_mapping [N]) -> q [N, H, D] bf16"""
    if not _on_gpu(qkv):
        return ops.qk_norm_rope_store(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, slot_mapping,
                                      H, Hkv, eps)
    import cupy
    qkv = _bf16(qkv)
    N = qkv.shape[0]
    D = qkv.shape[1] // (H + 2 * Hkv)
    assert D <= MAX_HEAD_DIM and D % 2 == 0
    assert k_cache.flags.c_contiguous and v_cache.flags.c_contiguous, "the pool must be contiguous"
    q = cupy.empty((N, H, D), dtype=cupy.uint16)
    has_norm = q_norm is not None
    qn = _bf16(q_norm) if has_norm else q           # any pointer when unused (never read)
    kn = _bf16(k_norm) if has_norm else q
    if N:
        _kernel("qk_norm_rope_store")(
            (N, H + Hkv), (32,),
            (qkv, qn, kn, _f32(cos), _f32(sin), k_cache, v_cache, _i32(slot_mapping), q,
             np.int32(H), np.int32(Hkv), np.int32(D), np.float32(eps), np.int32(has_norm)))
    return q


# decode attention splits each context into pieces of SPLIT_LEN positions (flash-decoding)
SPLIT_LEN = 512
DECODE_TILE = 32                      # positions per shared-memory tile (TILE in decode_attention.cu)


def decode_shared_bytes(D: int) -> int:
    """The split kernel's dynamic shared memory: K and V tiles [2, TILE, D] bf16 (32 KB at
    D = 256, within the 48 KB a kernel gets without raising its attribute)."""
    return 2 * DECODE_TILE * D * 2


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, split_len: int = 0,
                           max_len: int | None = None):
    """q [S, H, D] bf16 (one query per sequence), pages [NB, P, Hkv, D] bf16,
    block_tables [S, max_blocks], context_lens [S] -> [S, H, D] bf16.
    Two launches: the split kernel (one block per sequence, kv head and split) and the merge.
    split_len: positions per split (default SPLIT_LEN; the tests use small ones).
    max_len: an upper bound of context_lens known on the host (BatchInfo.max_context), which
    sizes the grid without a device-to-host copy; without it the lengths are read back."""
    if not _on_gpu(q):
        return ops.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens)
    import cupy
    q = _bf16(q)
    S, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert D <= MAX_HEAD_DIM, f"head_dim {D} > {MAX_HEAD_DIM} is not supported by the attention kernels"
    assert H // Hkv <= 16, "the decode kernel gives each query head of a group one of 16 warps at most"
    out = cupy.empty_like(q)
    if S == 0:
        return out
    block_tables, context_lens = _i32(block_tables), _i32(context_lens)
    split_len = split_len or SPLIT_LEN
    if max_len is None:
        max_len = int(context_lens.max())            # one small copy (and a sync) to size the grid
    splits = (max_len + split_len - 1) // split_len
    part_out = cupy.empty((S, H, splits, D), dtype=cupy.float32)
    part_ml = cupy.empty((S, H, splits, 2), dtype=cupy.float32)
    group = H // Hkv
    _kernel("paged_decode_attention")(
        (S * Hkv, splits), (32 * group,),
        (q, k_cache, v_cache, block_tables, context_lens, part_out, part_ml,
         np.int32(H), np.int32(Hkv), np.int32(D), np.int32(P), np.int32(block_tables.shape[1]),
         np.int32(split_len), np.int32(splits), np.float32(1.0 / np.sqrt(D))),
        shared_mem=decode_shared_bytes(D))
    _kernel("merge_attention")((S * H,), (32,), (part_out, part_ml, context_lens, out, np.int32(H),
                                                 np.int32(D), np.int32(split_len), np.int32(splits)))
    return out


def prefill_attention(q, k_cache, v_cache, block_tables, token_seq, positions,
                      tile_start=None, tile_count=None, tensor_cores: bool = True):
    """q [N, H, D] bf16 packed prefill tokens; token n reads the block table row token_seq[n] and
    sees positions 0..positions[n] -> [N, H, D] bf16.
    With the tiles of batch.py and a head dim the WMMA kernel takes (a multiple of 16, <= 128),
    the tensor-core kernel runs (prefill_attention_tc.cu); otherwise, or with
    tensor_cores=False, the plain one (prefill_attention.cu), which it is tested against."""
    if not _on_gpu(q):
        return ops.prefill_attention(q, k_cache, v_cache, block_tables, token_seq, positions)
    import cupy
    q = _bf16(q)
    N, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert D <= MAX_HEAD_DIM, f"head_dim {D} > {MAX_HEAD_DIM} is not supported by the attention kernels"
    out = cupy.empty_like(q)
    if N == 0:
        return out
    block_tables = _i32(block_tables)
    scale = np.float32(1.0 / np.sqrt(D))
    if tensor_cores and tile_start is not None and D % 16 == 0 and D <= TC_MAX_HEAD_DIM and _tc_available():
        G = H // Hkv
        warps = min(G, TC_WARPS)                     # query heads per block (WARPS in the .cu)
        _kernel("prefill_attention_tc")(
            (int(tile_start.shape[0]), Hkv * ((G + TC_WARPS - 1) // TC_WARPS)), (32 * warps,),
            (q, k_cache, v_cache, block_tables, _i32(token_seq), _i32(positions), _i32(tile_start),
             _i32(tile_count), out, np.int32(H), np.int32(Hkv), np.int32(D), np.int32(P),
             np.int32(block_tables.shape[1]), scale))
        return out
    warps = 4                                        # query tokens per block (WARPS in the .cu)
    _kernel("prefill_attention")(
        ((N + warps - 1) // warps, H), (32 * warps,),
        (q, k_cache, v_cache, block_tables, _i32(token_seq), _i32(positions), out,
         np.int32(N), np.int32(H), np.int32(Hkv), np.int32(D), np.int32(P),
         np.int32(block_tables.shape[1]), scale))
    return out


@functools.cache
def _tc_available() -> bool:
    """Whether the tensor-core kernel compiles here (it needs sm_80 or newer for bf16 wmma);
    if not, the plain kernel runs (said once), so an old GPU costs speed, not the engine.
    With QS_REQUIRE_GPU=1 (bench/gpu_check.sh) the fallback is an error instead: there the
    check must prove the tensor-core kernel, not pass on the plain one."""
    import os
    try:
        _kernel("prefill_attention_tc")
        return True
    except Exception as e:  # cupy's CompileException, or a missing toolkit
        if os.environ.get("QS_REQUIRE_GPU") == "1":
            raise RuntimeError(f"QS_REQUIRE_GPU=1 and the tensor-core prefill kernel does not compile here "
                               f"({type(e).__name__}: {str(e)[:300]})") from e
        import warnings
        warnings.warn(f"the tensor-core prefill kernel does not compile here ({type(e).__name__}: "
                      f"{str(e)[:200]}); using the plain prefill kernel")
        return False


def swiglu(gate_up):
    """[N, 2F] bf16 (gate | up) -> silu(gate) * up [N, F] bf16"""
    if not _on_gpu(gate_up):
        return ops.swiglu(gate_up)
    import cupy
    gate_up = _bf16(gate_up)
    N, F2 = gate_up.shape
    out = cupy.empty((N, F2 // 2), dtype=cupy.uint16)
    if N:
        _kernel("swiglu")(((F2 // 2 + 255) // 256, min(N, MAX_GRID_Y)), (256,),
                          (gate_up, out, np.int32(N), np.int32(F2 // 2)))
    return out


def sample(logits, temperature, top_k, top_p, u):
    """logits [S, V] float32, per-row temperature, top_k, top_p and uniform u [S]
    -> next tokens [S] int32 (on the device: S ids cross to the host, not S * V logits)."""
    if not _on_gpu(logits):
        return ops.sample(logits, temperature, top_k, top_p, u)
    import cupy
    logits = _f32(logits)
    S, V = logits.shape
    tokens = cupy.empty(S, dtype=cupy.int32)
    if S:
        _kernel("sample")((S,), (256,), (logits, _f32(temperature), _i32(top_k), _f32(top_p), _f32(u),
                                         tokens, np.int32(V)))
    return tokens


def to_host(x) -> np.ndarray:
    """A device array as numpy (a copy from the GPU; the array itself on cpu)."""
    return x if isinstance(x, np.ndarray) else x.get()
