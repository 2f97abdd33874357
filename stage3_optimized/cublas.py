"""cuBLAS's GEMM called through ctypes, on CuPy's own handle: a call a CUDA graph can record.

Changed from stage 2: a new file (stage 2 multiplies with cupy.matmul). CuPy's own cuBLAS
wrapper (cupy.cuda.cublas) refuses to run while a stream is being captured into a CUDA
graph ("calling cuBLAS API during stream capture is currently unsupported"), so a decode
step that calls it can never become a graph. cuBLAS itself has no such rule: the very
same C function, `cublasGemmEx`, called through ctypes on the handle CuPy already made,
with that handle's stream set to the capturing stream, is recorded into the graph like
any kernel launch, and its replays compute `a @ b` exactly (measured on an H200, CuPy 14).

What the handle needs for that:
  * the library CuPy uses: the symbols are looked up through CuPy's own cuBLAS extension
    module (cupy_backends.cuda.libs.cublas), which is linked against the libcublas that
    made the handle. A lookup by name could find another copy first (torch brings a CUDA 12
    libcublas), and that copy's functions cannot use this handle;
  * the stream, set to the current one at every call (eager steps run on CuPy's current
    stream, a capture on its own stream), since CuPy's own routines share the handle;
  * a workspace of our own, set again after every cublasSetStream: cuBLAS's documentation
    says cublasSetStream "unconditionally resets the cuBLAS library workspace back to the
    default workspace pool". With ours, a captured GEMM allocates nothing (a graph must not
    hold an allocation that CuPy's pool and the KV cache's sizing know nothing of);
  * host pointer mode: alpha and beta are read from host memory when the call is made
    (recorded as values into a graph), set at every call for the same reason.
CuPy keeps one handle per thread, so `blas()` keeps one Blas (and one workspace) per thread.
"""
from __future__ import annotations

import ctypes
import threading

CUDA_R_32F, CUDA_R_16BF = 0, 14                 # library_types.h
CUBLAS_COMPUTE_32F = 68                         # cublas_api.h: fp32 products and sums
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0
WORKSPACE_BYTES = 32 * 2**20                    # cuBLAS's own guidance for Hopper: 32 MiB

_P, _I = ctypes.c_void_p, ctypes.c_int
ARGTYPES = {                                    # cublas_api.h's signatures, by symbol
    "cublasSetStream_v2": [_P, _P],                         # handle, stream
    "cublasSetWorkspace_v2": [_P, _P, ctypes.c_size_t],     # handle, workspace, bytes
    "cublasSetPointerMode_v2": [_P, _I],                    # handle, mode
    "cublasGemmEx": [_P, _I, _I, _I, _I, _I,                # handle, transa, transb, m, n, k,
                     _P, _P, _I, _I, _P, _I, _I,            # alpha, A, Atype, lda, B, Btype, ldb,
                     _P, _P, _I, _I, _I, _I],               # beta, C, Ctype, ldc, compute, algo
}


def library_path() -> str:
    """CuPy's cuBLAS extension module: symbols looked up through it come from the libcublas it
    is linked against (dlsym searches a library, then the libraries it needs)."""
    from cupy_backends.cuda.libs import cublas as cupy_cublas   # (imported with CuPy, on the GPU)
    return cupy_cublas.__file__


class Blas:
    """cublasGemmEx on the current thread's CuPy handle, through ctypes."""

    def __init__(self):
        import cupy   # here: the module imports without CuPy (device="cpu")
        self.cupy = cupy
        self.handle = ctypes.c_void_p(cupy.cuda.device.get_cublas_handle())   # this thread's
        self.lib = ctypes.CDLL(library_path())
        self.fn = {}
        for name, argtypes in ARGTYPES.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
            self.fn[name] = fn
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)   # lives with the handle
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)  # alpha, beta (fp32 compute)

    def _call(self, name: str, *args) -> None:
        status = self.fn[name](self.handle, *args)
        if status != 0:
            raise RuntimeError(f"{name} failed with status {status} "
                               f"(cublas_api.h's cublasStatus_t)")

    def gemm(self, transa: int, transb: int, m: int, n: int, k: int, a: int, a_type: int,
             lda: int, b: int, b_type: int, ldb: int, c: int, c_type: int, ldc: int,
             accumulate: bool) -> None:
        """C [m, n] = op(A) [m, k] op(B) [k, n] (+ C when accumulate), column-major, fp32 sums;
        a, b, c are device addresses."""
        # the current stream (a capture's, or the eager one), then our workspace (setting the
        # stream has just reset it), then host scalars: CuPy's own routines share the handle
        self._call("cublasSetStream_v2", self.cupy.cuda.get_current_stream().ptr)
        self._call("cublasSetWorkspace_v2", self.workspace.data.ptr, WORKSPACE_BYTES)
        self._call("cublasSetPointerMode_v2", CUBLAS_POINTER_MODE_HOST)
        alpha, beta = ctypes.byref(self.one), ctypes.byref(self.one if accumulate else self.zero)
        self._call("cublasGemmEx", transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb,
                   beta, c, c_type, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)


_per_thread = threading.local()


def blas() -> Blas:
    """The calling thread's Blas: CuPy's cuBLAS handle (and so the workspace set on it) belongs
    to one thread; the engines use device 0."""
    if getattr(_per_thread, "blas", None) is None:
        _per_thread.blas = Blas()
    return _per_thread.blas
