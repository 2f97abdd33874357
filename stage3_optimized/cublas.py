"""cuBLAS's GEMM called through ctypes, on CuPy's own handle: a call a CUDA graph can record.

Changed from stage 2: a new file (stage 2 multiplies with cupy.matmul). CuPy's own cuBLAS
wrapper (cupy.cuda.cublas) refuses to run while a stream is being captured into a CUDA
graph ("calling cuBLAS API during stream capture is currently unsupported"), so a decode
step that calls it can never become a graph. cuBLAS itself has no such rule: the very
same C function, `cublasGemmEx`, called through ctypes on the handle CuPy already made,
with that handle's stream set to the capturing stream, is recorded into the graph like
any kernel launch, and its replays compute `a @ b` exactly (measured on an H200, CuPy 14).

What the handle needs for that, set once here:
  * the library: the libcublas CuPy loaded, found in /proc/self/maps, so that ctypes
    gets the same copy (and the handle belongs to it); the soname otherwise;
  * host pointer mode: alpha and beta are read from host memory when the call is made
    (recorded as values into a graph); set again at every call, since CuPy's own routines
    share the handle;
  * a workspace of our own (cublasSetWorkspace), allocated before any capture, so cuBLAS
    never allocates one in the middle of a capture;
  * the stream, set to the current one at every call (eager steps run on CuPy's current
    stream, a capture on its own stream).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

CUDA_R_32F, CUDA_R_16BF = 0, 14                 # library_types.h
CUBLAS_COMPUTE_32F = 68                         # cublas_api.h: fp32 products and sums
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0
WORKSPACE_BYTES = 32 * 2**20                    # cuBLAS's own guidance for Hopper: 32 MiB


def loaded_library(stem: str = "libcublas.so") -> str:
    """The path of the libcublas this process has loaded (CuPy loads it for its handle), from
    /proc/self/maps; the soname when the maps cannot tell (ctypes then finds it by name)."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if Path(path).name.startswith(stem):
                return path
    except OSError:
        pass
    return stem


class Blas:
    """cublasGemmEx on CuPy's handle of the current device, through ctypes."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.handle = ctypes.c_void_p(cupy.cuda.device.get_cublas_handle())   # loads libcublas too
        self.lib = ctypes.CDLL(loaded_library())
        self.gemm_ex = self.lib.cublasGemmEx
        self.gemm_ex.restype = ctypes.c_int
        self.gemm_ex.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)      # kept alive with the handle
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                   ctypes.c_size_t(WORKSPACE_BYTES)), "SetWorkspace")
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)     # alpha, beta (fp32 compute)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cublas{what} failed with status {status} (cublas_api.h's cublasStatus_t)")

    def gemm(self, transa: int, transb: int, m: int, n: int, k: int, a: int, a_type: int, lda: int,
             b: int, b_type: int, ldb: int, c: int, c_type: int, ldc: int, accumulate: bool) -> None:
        """C [m, n] = op(A) [m, k] op(B) [k, n] (+ C when accumulate), column-major, fp32 sums;
        a, b, c are device addresses."""
        # the current stream (a capture's, or the eager one) and host scalars, at every call: CuPy's
        # own routines share the handle and set both their way
        stream = self.cupy.cuda.get_current_stream().ptr
        self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "SetStream")
        self._check(self.lib.cublasSetPointerMode_v2(self.handle, CUBLAS_POINTER_MODE_HOST), "SetPointerMode")
        self._check(self.gemm_ex(self.handle, transa, transb, m, n, k, ctypes.byref(self.one), a, a_type, lda,
                                 b, b_type, ldb, ctypes.byref(self.one if accumulate else self.zero), c, c_type,
                                 ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "GemmEx")


@functools.cache
def blas() -> Blas:
    """One Blas per process (CuPy's handle is per device; the engines use device 0)."""
    return Blas()
