"""Launch a CUDA kernel for cupy arrays, run its numpy twin for numpy arrays.

As in stage 2, every function takes and returns arrays of one kind: cupy arrays on
device="cuda" run the kernel, numpy arrays on device="cpu" run the twin in ops.py.

Changed from stage 2, lesson by lesson (docs/lessons/stage3):
  * qk_norm_rope_store: stage 2's per-head rmsnorm, rope and store_kvcache as one kernel
    that reads the fused QKV GEMM's rows in place; one layer's fixed arguments travel as one
    record (ops.LayerHeads).
  * swiglu: stage 2's silu_mul on the fused gate/up GEMM's output, read in place.
  * The KV pages are bf16, held as their 16 bits (a uint16 array, on both devices: the same
    code runs on CuPy with and without a bfloat16 dtype, and a kernel's `unsigned short*`
    takes it as is); the attention kernels widen them as they read.
  * The weights are bf16 and the GEMM is cuBLAS gemmEx with bf16 inputs and fp32
    accumulation (CUBLAS_COMPUTE_32F, through cupy.cuda.cublas) instead of cupy.matmul on
    float32; a float32 input is rounded to bf16 on the way in (to_bf16).
  * rmsnorm writes bf16, the input of the GEMM after it, from bf16 norm weights; the GEMM
    takes a bf16 input as it is.
  * Attention and swiglu write bf16 too: every GEMM input comes in bf16, none is converted.
  * The GEMMs write bf16 too (float32 with out_f32: the logits, a block's output) and
    qk_norm_rope_store, swiglu and attention read bf16: every activation between kernels is
    bf16.
  * Decode attention is two launches: the GQA-shared split kernel and the merge.
  * Prefill attention runs on tensor cores (prefill_attention_tc.cu) where the head dim
    allows, with the plain kernel beside it.
  * `sample` picks each row's token on the device.
  * Every wrapper writes into the `out=` it is given (views of buffers allocated once,
    buffers.py) and checks its inputs instead of converting them: a conversion would be an
    allocation and a copy nobody sees.
  * qk_norm_rope_store reads each token's cos/sin row from the model's tables itself.
  * A block's last GEMM adds its fp32 sums into the residual stream (`add_into=`, cuBLAS
    with beta = 1): stage 2's residual_add is gone.
  * A decode batch of at most 4 rows runs its projections as gemv.cu, with the RMSNorm or
    SwiGLU in front and the bias or residual add behind fused into the one launch (linear,
    rmsnorm_linear, swiglu_linear); bigger batches run rmsnorm.cu, swiglu.cu and cuBLAS, the
    same arithmetic in more launches.
  * The GEMM is called through ctypes on CuPy's handle (cublas.py): a call a CUDA graph can
    record.

The wrappers check inputs, choose the launch grid the .cu header documents, and pass
scalars as numpy scalars of the C type the kernel declares (int -> np.int32, float ->
np.float32). Inputs must already be contiguous arrays of the kernel's dtype (`_bf16`,
`_f32`, `_i32` only check). Without `out` a wrapper allocates (the tests, the MoE path).
"""
from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import numpy as np

from . import cublas, ops
from .cublas import CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, CUDA_R_32F

CUDA_DIR = Path(__file__).resolve().parent / "cuda"
KERNEL_FILES = {                      # kernel name -> its .cu file under cuda/
    "embedding": "embedding.cu",
    "rmsnorm": "rmsnorm.cu",
    "qk_norm_rope_store": "qk_norm_rope_store.cu",
    "gemv": "gemv.cu",
    "paged_decode_attention": "decode_attention.cu",
    "merge_attention": "decode_attention.cu",
    "prefill_attention": "prefill_attention.cu",
    "prefill_attention_tc": "prefill_attention_tc.cu",
    "swiglu": "swiglu.cu",
    "sample": "sample.cu",
}
MAX_GRID_Y = 65535                    # a launch's grid.y limit (grid.x goes to 2^31 - 1)
MAX_HEAD_DIM = 256                    # the attention kernels keep D/32 values per lane in registers
TC_MAX_HEAD_DIM, TC_WARPS = 128, 4     # the tensor-core prefill: O in registers, 4 heads per block
GEMV_MAX_ROWS = 4                     # gemv.cu's MAX_N: a decode batch of up to 4 sequences
GEMV_SMEM = 48 * 1024                 # its input rows in dynamic shared memory, at most
GEMV_MAX_BLOCKS = 1024                # its grid; each warp strides over the rows past it
# A block's static and dynamic shared memory share 48 KB unless the kernel's attribute
# max_dynamic_shared_size_bytes is raised (every GPU since Volta allows more: 227 KB on an
# H100). gemv.cu's 32 static bytes plus 48 KB of input rows need it raised.
RAISED_SMEM = {"gemv": GEMV_SMEM}     # kernel -> the dynamic shared memory it may take


def _compile(name: str):
    """The kernel, compiled from its .cu file (cupy also caches the binary on disk)."""
    import cupy
    code = (CUDA_DIR / KERNEL_FILES[name]).read_text()
    return cupy.RawModule(code=code, options=("--std=c++17",)).get_function(name)


@functools.cache
def _kernel(name: str):
    """The kernel, compiled once per process, its shared memory attribute raised where
    RAISED_SMEM says (once: the attribute stays with the compiled function)."""
    fn = _compile(name)
    if name in RAISED_SMEM:
        fn.max_dynamic_shared_size_bytes = RAISED_SMEM[name]
    return fn


def _on_gpu(x) -> bool:
    return not isinstance(x, np.ndarray)


def _check(x, dtype, what: str):
    """x must be a contiguous array of dtype: a wrapper never converts (a conversion is a copy)."""
    assert x.dtype == dtype and x.flags.c_contiguous, (
        f"{what}: expected a contiguous {np.dtype(dtype)} array")
    return x


def _bf16(x):
    return _check(x, np.uint16, "bf16 bits (uint16)")


def _f32(x):
    return _check(x, np.float32, "float32")


def _i32(x):
    return _check(x, np.int32, "int32")


def _ptr(x) -> int:
    """The device address of a cupy array (what a cuBLAS call takes)."""
    return x.data.ptr


def _output(out, shape, dtype=np.float32):
    """The caller's buffer, checked against the kernel's output shape and dtype, or a new
    array (on a GPU a `cupy.empty`: a call the host pays for, which the buffer saves)."""
    if out is None:
        import cupy
        return cupy.empty(shape, dtype=dtype)
    assert tuple(out.shape) == tuple(shape) and out.dtype == dtype and out.flags.c_contiguous, \
        f"out is {out.dtype} {tuple(out.shape)}, expected a contiguous {np.dtype(dtype)} {shape}"
    return out


def _twin(value, out):
    """A twin's result, copied into out when the caller gives one: on both devices the
    caller then reads its result from the same buffer."""
    if out is None:
        return value
    out[...] = value
    return out


def to_bf16(x):
    """float32 -> bf16 bits, round to nearest even, a NaN a quiet NaN (as ops.bf16_bits), on
    either device (the MoE sum, Qwen2's biased q/k/v)."""
    if not _on_gpu(x):
        return ops.bf16_bits(x)
    import cupy
    u = cupy.ascontiguousarray(x, dtype=cupy.float32).view(cupy.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16      # (a NaN's may carry into the sign bit)
    quiet_nan = ((u >> 16) & 0x8000) | 0x7FC0
    return cupy.where((u & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded).astype(cupy.uint16)


def _gemv_fits(N: int, K: int) -> bool:
    """gemv.cu takes N <= 4 rows, 16-byte weight rows (K % 8 == 0) and N * K bf16 inputs in
    its 48 KB of dynamic shared memory (the 8B model's MLP input: K = 12,288, two rows)."""
    return 0 < N <= GEMV_MAX_ROWS and K % 8 == 0 and N * K * 2 <= GEMV_SMEM


def _gemv(w, N: int, K: int, *, x=None, norm_in=None, norm_w=None, bias=None, out_bf16=None,
          out_f32=None, eps: float = 0.0, prologue: int = 0, epilogue: int = 0) -> None:
    """One gemv.cu launch (its header says what each prologue / epilogue does). The pointers a
    mode leaves unused get w viewed as their type: never read, never written."""
    M = w.shape[0]
    any16, any32 = w, w.view(np.float32)
    args = (_bf16(x) if x is not None else any16, _f32(norm_in) if norm_in is not None else any32,
            _bf16(norm_w) if norm_w is not None else any16, _bf16(w),
            _f32(bias) if bias is not None else any32,
            out_bf16 if out_bf16 is not None else any16, out_f32 if out_f32 is not None else any32,
            np.int32(N), np.int32(M), np.int32(K), np.float32(eps), np.int32(prologue),
            np.int32(epilogue), np.int32(bias is not None))
    _kernel("gemv")((min((M + 7) // 8, GEMV_MAX_BLOCKS),), (256,), args, shared_mem=N * K * 2)


def _gemm(x, w, c, accumulate: bool = False) -> None:
    """c [N, M] (bf16 or float32) = x [N, K] bf16 @ w [M, K] bf16 .T (+ c when accumulate), by
    cuBLAS. cuBLAS is column-major: the row-major c [N, M] is, to cuBLAS, the column-major
    c^T [M, N] = W [M, K] . x^T [K, N]; the row-major W [M, K] is to it a K x M matrix,
    so it is read with op T, and x [N, K] is a K x N matrix read as is."""
    N, K = x.shape
    M = w.shape[0]
    c_type = CUDA_R_32F if c.dtype == np.float32 else CUDA_R_16BF
    cublas.blas().gemm(CUBLAS_OP_T, CUBLAS_OP_N, M, N, K, _ptr(_bf16(w)), CUDA_R_16BF, K,
                       _ptr(_bf16(x)), CUDA_R_16BF, K, _ptr(c), c_type, M, accumulate)


def linear(x, w, out_f32: bool = False, out=None, add_into=None):
    """x [N, K] bf16 @ w [M, K] bf16 .T with fp32 sums -> [N, M] bf16 (float32 with out_f32),
    or added into add_into [N, M] float32 (the residual stream: a block's last GEMM), which
    is returned: gemv.cu for a decode batch, cuBLAS otherwise (beta = 1 to add)."""
    if not _on_gpu(w):
        if add_into is not None:
            add_into += ops.linear(x, w, out_f32=True)
            return add_into
        return _twin(ops.linear(x, w, out_f32), out)
    N, K = x.shape
    if add_into is not None:
        assert _f32(add_into).shape == (N, w.shape[0])
        out = add_into
    else:
        out = _output(out, (N, w.shape[0]), np.float32 if out_f32 else np.uint16)
    if N == 0:
        return out
    if _gemv_fits(N, K):
        epilogue = 2 if add_into is not None else 1 if out_f32 else 0
        _gemv(w, N, K, x=x, out_bf16=out if epilogue == 0 else None,
              out_f32=out if epilogue else None, epilogue=epilogue)
    else:
        _gemm(x, w, out, accumulate=add_into is not None)
    return out


def embedding(ids, table, out=None):
    """ids [N] int32, table [V, C] bf16 -> [N, C] float32: the residual stream's first value."""
    if not _on_gpu(table):
        return _twin(ops.embedding(ids, table), out)
    N, C = ids.shape[0], table.shape[1]
    out = _output(out, (N, C))
    if N:
        _kernel("embedding")((N,), (128,), (_i32(ids), _bf16(table), out, np.int32(C)))
    return out


def rmsnorm(x, w, eps: float, out=None):
    """x [N, C] float32 (the residual stream), w [C] bf16 -> rmsnorm(x) * w [N, C] bf16."""
    if not _on_gpu(x):
        return _twin(ops.rmsnorm_bf16(x, w, eps), out)
    N, C = _f32(x).shape
    h = _output(out, (N, C), np.uint16)
    if N:
        _kernel("rmsnorm")((N,), (256,), (x, _bf16(w), h, np.int32(C), np.float32(eps)))
    return h


def rmsnorm_linear(x, norm_w, eps: float, w, h=None, bias=None, out_f32: bool = False, out=None):
    """A block's first GEMM with its RMSNorm in front (ops.rmsnorm_linear): x [N, K] float32
    -> rmsnorm(x) * norm_w @ w.T [N, M] bf16 (+ bias [M] float32 before the rounding;
    float32 with out_f32). A decode batch: one gemv.cu launch. Else rmsnorm.cu into h [N, K]
    (a buffer for the normed rows), then the GEMM."""
    if not _on_gpu(w):
        return _twin(ops.rmsnorm_linear(x, norm_w, eps, w, bias, out_f32), out)
    N, K = _f32(x).shape
    out = _output(out, (N, w.shape[0]), np.float32 if out_f32 else np.uint16)
    if N == 0:
        return out
    if _gemv_fits(N, K):
        _gemv(w, N, K, norm_in=x, norm_w=norm_w, bias=bias, eps=eps, prologue=1,
              out_bf16=None if out_f32 else out, out_f32=out if out_f32 else None,
              epilogue=1 if out_f32 else 0)
        return out
    h = rmsnorm(x, norm_w, eps, out=h)
    if bias is None:
        return linear(h, w, out_f32, out=out)
    # Qwen2's q/k/v bias on a big batch: the fp32 GEMM, the bias, one rounding (cupy's
    # elementwise kernels: a prefill step, where a few extra launches do not show)
    out[...] = to_bf16(linear(h, w, out_f32=True) + bias)
    return out


def qk_norm_rope_store(qkv, heads: ops.LayerHeads, positions, slot_mapping, out=None):
    """qkv [N, (H + 2 Hkv) D] bf16, one layer's heads (ops.LayerHeads: its q/k norm weights,
    the model's RoPE tables, its pages [NB, P, Hkv, D] bf16, H, Hkv, eps), positions [N],
    slot_mapping [N] (k and v go there) -> q [N, H, D] bf16 (ops.qk_norm_rope_store)"""
    if not _on_gpu(qkv):
        return _twin(ops.qk_norm_rope_store(qkv, heads, positions, slot_mapping), out)
    H, Hkv = heads.H, heads.Hkv
    qkv = _bf16(qkv)
    N = qkv.shape[0]
    D = qkv.shape[1] // (H + 2 * Hkv)
    assert D <= MAX_HEAD_DIM and D % 2 == 0
    k_cache, v_cache = heads.k_cache, heads.v_cache
    assert k_cache.flags.c_contiguous and v_cache.flags.c_contiguous, "the pool must be contiguous"
    out = _output(out, (N, H, D), np.uint16)
    has_norm = heads.q_norm is not None
    qn = _bf16(heads.q_norm) if has_norm else out         # any pointer when unused (never read)
    kn = _bf16(heads.k_norm) if has_norm else out
    if N:
        _kernel("qk_norm_rope_store")(
            (N, H + Hkv), (32,),
            (qkv, qn, kn, _f32(heads.cos), _f32(heads.sin), _i32(positions), k_cache, v_cache,
             _i32(slot_mapping), out, np.int32(H), np.int32(Hkv), np.int32(D),
             np.float32(heads.eps), np.int32(has_norm)))
    return out


# decode attention splits each context into pieces of SPLIT_LEN positions (flash-decoding)
SPLIT_LEN = 512
# positions per shared-memory tile (TILE in decode_attention.cu)
DECODE_TILE = 32


def decode_shared_bytes(D: int) -> int:
    """The split kernel's dynamic shared memory: K and V tiles [2, TILE, D] bf16 (32 KB at
    D = 256, within the 48 KB a kernel gets without raising its attribute)."""
    return 2 * DECODE_TILE * D * 2


def decode_splits(max_len: int, split_len: int = 0) -> int:
    """How many splits of split_len (default SPLIT_LEN) positions cover a context of max_len."""
    split_len = split_len or SPLIT_LEN
    return (max_len + split_len - 1) // split_len


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, split_len: int = 0,
                           max_len: int | None = None, out=None, scratch=None):
    """q [S, H, D] bf16 (one query per sequence), pages [NB, P, Hkv, D] bf16,
    block_tables [S, max_blocks], context_lens [S] -> [S, H, D] bf16.
    Two launches: the split kernel (one block per sequence, kv head and split) and the merge.
    split_len: positions per split (default SPLIT_LEN; the tests use small ones).
    max_len: an upper bound of context_lens known on the host (BatchInfo.max_context), which
    sizes the grid without a device-to-host copy; without it the lengths are read back.
    scratch: a float32 array of at least S * H * splits * (D + 2) values for the partial
    results (buffers.py sizes one); without it they are allocated."""
    if not _on_gpu(q):
        return _twin(ops.paged_decode_attention(q, k_cache, v_cache,
                                                block_tables, context_lens), out)
    q = _bf16(q)
    S, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert D <= MAX_HEAD_DIM, (
        f"head_dim {D} > {MAX_HEAD_DIM} is not supported by the attention kernels")
    assert H // Hkv <= 16, (
        "the decode kernel gives each query head of a group one of 16 warps at most")
    out = _output(out, (S, H, D), np.uint16)
    if S == 0:
        return out
    block_tables, context_lens = _i32(block_tables), _i32(context_lens)
    split_len = split_len or SPLIT_LEN
    if max_len is None:
        max_len = int(context_lens.max())            # one small copy (and a sync) to size the grid
    splits = decode_splits(max_len, split_len)
    n = S * H * splits
    scratch = _output(None, (n * (D + 2),), np.float32) if scratch is None else _f32(scratch)
    part_out = scratch[:n * D].reshape(S, H, splits, D)          # views: no allocation
    part_ml = scratch[n * D:n * (D + 2)].reshape(S, H, splits, 2)
    group = H // Hkv
    _kernel("paged_decode_attention")(
        (S * Hkv, splits), (32 * group,),
        (q, k_cache, v_cache, block_tables, context_lens, part_out, part_ml,
         np.int32(H), np.int32(Hkv), np.int32(D), np.int32(P), np.int32(block_tables.shape[1]),
         np.int32(split_len), np.int32(splits), np.float32(1.0 / np.sqrt(D))),
        shared_mem=decode_shared_bytes(D))
    _kernel("merge_attention")((S * H,), (32,), (part_out, part_ml, context_lens, out, np.int32(H),
                                                 np.int32(D), np.int32(split_len),
                                                 np.int32(splits)))
    return out


def prefill_attention(q, k_cache, v_cache, block_tables, token_seq, positions,
                      tile_start=None, tile_count=None, tensor_cores: bool = True, out=None):
    """q [N, H, D] bf16 packed prefill tokens; token n reads the block table row token_seq[n] and
    sees positions 0..positions[n] -> [N, H, D] bf16.
    With the tiles of batch.py and a head dim the WMMA kernel takes (a multiple of 16, <= 128),
    the tensor-core kernel runs (prefill_attention_tc.cu); otherwise, or with
    tensor_cores=False, the plain one (prefill_attention.cu), which it is tested against."""
    if not _on_gpu(q):
        return _twin(ops.prefill_attention(q, k_cache, v_cache, block_tables,
                                           token_seq, positions), out)
    q = _bf16(q)
    N, H, D = q.shape
    P, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert D <= MAX_HEAD_DIM, (
        f"head_dim {D} > {MAX_HEAD_DIM} is not supported by the attention kernels")
    out = _output(out, (N, H, D), np.uint16)
    if N == 0:
        return out
    block_tables = _i32(block_tables)
    scale = np.float32(1.0 / np.sqrt(D))
    if (tensor_cores and tile_start is not None and D % 16 == 0 and D <= TC_MAX_HEAD_DIM
            and _tc_available()):
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
    try:
        _kernel("prefill_attention_tc")
        return True
    except Exception as e:  # cupy's CompileException, or a missing toolkit
        if os.environ.get("QS_REQUIRE_GPU") == "1":
            raise RuntimeError("QS_REQUIRE_GPU=1 and the tensor-core prefill kernel does not "
                               f"compile here ({type(e).__name__}: {str(e)[:300]})") from e
        warnings.warn(f"the tensor-core prefill kernel does not compile here ({type(e).__name__}: "
                      f"{str(e)[:200]}); using the plain prefill kernel")
        return False


def swiglu(gate_up, out=None):
    """[N, 2F] bf16 (gate | up, the fused GEMM's output) -> silu(gate) * up [N, F] bf16"""
    if not _on_gpu(gate_up):
        return _twin(ops.swiglu(gate_up), out)
    gate_up = _bf16(gate_up)
    N, F2 = gate_up.shape
    out = _output(out, (N, F2 // 2), np.uint16)
    if N:
        _kernel("swiglu")(((F2 // 2 + 255) // 256, min(N, MAX_GRID_Y)), (256,),
                          (gate_up, out, np.int32(N), np.int32(F2 // 2)))
    return out


def swiglu_linear(gate_up, w, add_into, act=None):
    """The MLP's down projection, added into the residual stream: add_into [N, C] float32
    += swiglu(gate_up) @ w.T, gate_up [N, 2F] bf16, w [C, F] (ops.swiglu). A decode batch:
    one gemv.cu launch (SwiGLU as its prologue); else swiglu.cu into act [N, F], then the
    GEMM with beta = 1. Returns add_into."""
    if not _on_gpu(w):
        add_into += ops.linear(ops.swiglu(gate_up), w, out_f32=True)
        return add_into
    N, F = gate_up.shape[0], gate_up.shape[1] // 2
    if N == 0:
        return add_into
    if _gemv_fits(N, F):
        assert _f32(add_into).shape == (N, w.shape[0])
        _gemv(w, N, F, x=gate_up, out_f32=add_into, prologue=2, epilogue=2)
        return add_into
    return linear(swiglu(gate_up, out=act), w, add_into=add_into)


def sample(logits, temperature, top_k, top_p, u, out=None):
    """logits [S, V] float32, per-row temperature, top_k, top_p and uniform u [S]
    -> next tokens [S] int32 (on the device: S ids cross to the host, not S * V logits)."""
    if not _on_gpu(logits):
        return _twin(ops.sample(logits, temperature, top_k, top_p, u), out)
    S, V = _f32(logits).shape
    tokens = _output(out, (S,), np.int32)
    if S:
        _kernel("sample")((S,), (256,), (logits, _f32(temperature), _i32(top_k), _f32(top_p),
                                         _f32(u), tokens, np.int32(V)))
    return tokens


def route(logits, k: int, norm: bool):
    """MoE routing, on the host: the router's logits [T, E] (copied back from the device)
    -> each token's top-k experts [T, k] and their weights [T, k] (ops.route)."""
    return ops.route(to_host(logits), k, norm)


def to_host(x) -> np.ndarray:
    """A device array as numpy (a copy from the GPU; the array itself on cpu)."""
    return x if isinstance(x, np.ndarray) else x.get()
