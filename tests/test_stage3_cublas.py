"""stage3_optimized/cublas.py's real `Blas`, off the GPU, against a stand-in libcublas.

The stand-in is a small C library (STANDIN_C below, compiled here with gcc) that exports the
cuBLAS functions Blas calls and records each call with its arguments as C received them. It
is found the way Blas finds cuBLAS on a GPU: through a stand-in of CuPy's cuBLAS extension
module (a shared library linked against it, whose path the fake module
`cupy_backends.cuda.libs.cublas` gives as its __file__). A second copy of the stand-in,
named like torch's CUDA 12 libcublas and loaded first, must receive no call.

Checked: each GEMM sets the stream, then the workspace (cublasSetStream resets it to
cuBLAS's default pool), then host pointer mode, then calls cublasGemmEx; every argument
arrives as the C signature declares it (pointers whole, alpha and beta as floats in host
memory, sizes as size_t); each thread gets its own Blas on its own handle.
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

from stage3_optimized import cublas

STANDIN_C = r"""
#include <stddef.h>
#include <string.h>
typedef struct { int what; unsigned long long v[19]; double alpha, beta; } Call;
static Call calls[64];
static int count;
int standin_count(void) { return count; }
Call* standin_calls(void) { return calls; }
static Call* next(int what)
{ Call* c = &calls[count++ % 64]; memset(c, 0, sizeof *c); c->what = what; return c; }
int cublasSetStream_v2(void* h, void* s)
{ Call* c = next(1); c->v[0] = (size_t)h; c->v[1] = (size_t)s; return 0; }
int cublasSetWorkspace_v2(void* h, void* ws, size_t bytes)
{ Call* c = next(2); c->v[0] = (size_t)h; c->v[1] = (size_t)ws; c->v[2] = bytes; return 0; }
int cublasSetPointerMode_v2(void* h, int mode)
{ Call* c = next(3); c->v[0] = (size_t)h; c->v[1] = (unsigned long long)(long long)mode; return 0; }
int cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* A,
                 int at, int lda, const void* B, int bt, int ldb, const void* beta, void* C, int ct,
                 int ldc, int compute, int algo)
{
    Call* c = next(4);
    long long ints[] = {ta, tb, m, n, k, at, lda, bt, ldb, ct, ldc, compute, algo};
    c->v[0] = (size_t)h; c->v[1] = (size_t)A; c->v[2] = (size_t)B; c->v[3] = (size_t)C;
    for (int i = 0; i < 13; i++) c->v[4 + i] = (unsigned long long)ints[i];
    c->alpha = *(const float*)alpha; c->beta = *(const float*)beta;
    return 0;
}
"""
EXTENSION_C = ("int cublasSetStream_v2(void*, void*);\n"
               "int extension_uses_cublas(void) { return cublasSetStream_v2(0, 0); }\n")
NAMES = {1: "SetStream", 2: "SetWorkspace", 3: "SetPointerMode", 4: "GemmEx"}


class Call(ctypes.Structure):
    _fields_ = [("what", ctypes.c_int), ("v", ctypes.c_ulonglong * 19), ("alpha", ctypes.c_double),
                ("beta", ctypes.c_double)]


def _gcc(args: list[str]) -> None:
    r = subprocess.run(["gcc", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def calls_of(lib) -> list[tuple]:
    """The stand-in's recorded calls: (name, values...) with GemmEx's alpha and beta."""
    lib.standin_calls.restype = ctypes.POINTER(Call)
    recorded = lib.standin_calls()
    out = []
    for i in range(lib.standin_count()):
        c = recorded[i]
        n = {1: 2, 2: 3, 3: 2, 4: 17}[c.what]
        out.append((NAMES[c.what], *list(c.v)[:n]) + ((c.alpha, c.beta) if c.what == 4 else ()))
    return out


class FakeStream:
    def __init__(self, ptr):
        self.ptr = ptr


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """-> the libcublas stand-in that CuPy's module links, the decoy, the module, the fake cupy."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    for folder in ("cu13", "cu12", "ext"):
        (tmp_path / folder).mkdir()
    (tmp_path / "standin.c").write_text(STANDIN_C)
    (tmp_path / "ext.c").write_text(EXTENSION_C)
    lib13, lib12 = tmp_path / "cu13" / "libcublas.so.13", tmp_path / "cu12" / "libcublas.so.12"
    for lib in (lib13, lib12):
        _gcc(["-shared", "-fPIC", "-o", str(lib), f"-Wl,-soname,{lib.name}",
              str(tmp_path / "standin.c")])
    ext = tmp_path / "ext" / "cublas.cpython-311-x86_64-linux-gnu.so"
    _gcc(["-shared", "-fPIC", "-o", str(ext), str(tmp_path / "ext.c"), "-Wl,--no-as-needed",
          f"-L{lib13.parent}", f"-l:{lib13.name}", f"-Wl,-rpath,{lib13.parent}"])
    decoy = ctypes.CDLL(str(lib12), mode=ctypes.RTLD_GLOBAL)   # torch's CUDA 12 copy, loaded first
    module = types.ModuleType("cupy_backends.cuda.libs.cublas")
    module.__file__ = str(ext)
    for name in ("cupy_backends", "cupy_backends.cuda", "cupy_backends.cuda.libs"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "cupy_backends.cuda.libs.cublas", module)
    sys.modules["cupy_backends.cuda.libs"].cublas = module
    workspace = np.zeros(16, np.uint8)                                  # any address: never written
    cp = types.ModuleType("cupy")
    cp.uint8 = np.uint8
    cp.empty = lambda n, dtype: types.SimpleNamespace(
        data=types.SimpleNamespace(ptr=workspace.ctypes.data), nbytes=n, keep=workspace)
    stream, handles = {"now": FakeStream(0x5000_0000_0001)}, {}

    def handle():                                                       # CuPy's: one per thread
        return handles.setdefault(threading.get_ident(), 0x7F00_0000_1000 + 16 * len(handles))
    cp.cuda = types.SimpleNamespace(device=types.SimpleNamespace(get_cublas_handle=handle),
                                    get_current_stream=lambda: stream["now"])
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(cublas, "_per_thread", threading.local(), raising=False)
    lib = ctypes.CDLL(str(lib13))
    return types.SimpleNamespace(lib=lib, decoy=decoy, module=module, cupy=cp, stream=stream,
                                 workspace=workspace.ctypes.data)


def test_blas_finds_cublas_through_cupys_module_and_sets_stream_then_workspace_then_gemm(standin):
    b = cublas.blas()
    assert b.lib._name == standin.module.__file__
    handle = b.handle.value
    A, B, C = 0x7A00_0000_0010, 0x7B00_0000_0020, 0x7C00_0000_0030    # over 2**32: whole pointers?
    bf16, f32 = cublas.CUDA_R_16BF, cublas.CUDA_R_32F
    b.gemm(cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, 40, 3, 64, A, bf16, 64, B, bf16, 64, C, f32, 40,
           accumulate=False)
    standin.stream["now"] = FakeStream(0x5000_0000_0002)             # a capture's stream
    b.gemm(cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, 40, 3, 64, A, bf16, 64, B, bf16, 64, C, f32, 40,
           accumulate=True)
    gemm_args = [1, 0, 40, 3, 64, 14, 64, 14, 64, 0, 40, 68, 2**64 - 1]   # compute 32F, algo -1
    expect = []
    for stream, beta in ((0x5000_0000_0001, 0.0), (0x5000_0000_0002, 1.0)):
        expect += [("SetStream", handle, stream),
                   ("SetWorkspace", handle, standin.workspace, 32 * 2**20),
                   ("SetPointerMode", handle, 0),
                   ("GemmEx", handle, A, B, C, *gemm_args, 1.0, beta)]
    assert calls_of(standin.lib) == expect
    assert standin.decoy.standin_count() == 0, "a call went to the other libcublas"
    assert all(fn.argtypes is not None for fn in b.fn.values())


def test_each_thread_gets_its_own_blas_on_its_own_handle(standin):
    here = cublas.blas()
    assert cublas.blas() is here
    there = []
    t = threading.Thread(target=lambda: there.append(cublas.blas()))
    t.start()
    t.join()
    assert there[0] is not here and there[0].handle.value != here.handle.value
