"""Which dot-product instructions the fast path may use: decided here, in Python,
from the features numba compiles for, before any kernel that names one is compiled.

numba hands LLVM a target: a CPU name and a feature list (NUMBA_CPU_NAME and
NUMBA_CPU_FEATURES, or the host's own). An instruction outside that list is not
"slow" there, it is impossible: LLVM aborts the whole process ("Cannot select
... VPDPWSSD"). So simd.py asks this module which instruction to emit, and a
kernel that needs one is only compiled when the answer is not None.

    INT8   "vnni": vpdpbusd / vpdpwssd (AVX-512 VNNI with VL, or AVX-VNNI): one
                   instruction per 32 int8 (16 int16) multiply-adds into int32
           "avx2": vpmaddubsw + vpmaddwd, the same sums in two instructions
                   (what llama.cpp uses on AVX2 CPUs)
           "sdot": ARM64 with the dotprod feature (Apple M1 on, Graviton 2 on,
                   Raspberry Pi 5): sdot, 16 int8 multiply-adds into 4 int32
           None:   no integer dot product (generic x86-64, an ARM64 core without
                   dotprod such as the Cortex-A53 / A72): the core's float kernels
    BF16   True where vdpbf16ps exists (AVX-512 BF16): the bf16 prefill GEMM
    INT16_GEMM  True where the int16 prefill GEMM pays (x86: vpmaddwd multiplies 16 int16
           pairs, twice the fp32 FMA's lanes); ARM64 has no int16 dot product (smlal
           does 4 multiply-adds, fmla's rate), so there prefill stays on BLAS sgemm

QS_FAST_ISA=avx2 or =none lowers the choice (to measure or test the AVX2 code on a
VNNI machine); it never raises it above what the target has.
"""
from __future__ import annotations

import os
import platform

import llvmlite.binding as llvm
from numba.core import config as numba_config


def target_features() -> set[str]:
    """The feature names numba compiles for ("avx2", "avx512vnni", ...)."""
    # exactly what numba passes to LLVM: NUMBA_CPU_FEATURES if set ("" for NUMBA_CPU_NAME=generic),
    # else the host's features, even with another NUMBA_CPU_NAME (so NUMBA_CPU_NAME=haswell alone
    # on an AVX-512 host still allows AVX-512: a faithful stand-in sets NUMBA_CPU_FEATURES too)
    if numba_config.CPU_FEATURES is not None:
        flat = numba_config.CPU_FEATURES
    else:
        try:
            flat = llvm.get_host_cpu_features().flatten()
        # LLVM cannot tell on this OS: numba compiles for no extra feature
        except RuntimeError:
            flat = ""
    return {f[1:] for f in flat.split(",") if f.startswith("+")}


def target_name() -> str:
    return (numba_config.CPU_NAME if numba_config.CPU_NAME not in (None, "host")
            else llvm.get_host_cpu_name())


def _choose_int8(features: set[str]) -> str | None:
    if "avxvnni" in features or {"avx512vnni", "avx512vl"} <= features:
        choice = "vnni"
    elif "avx2" in features:
        choice = "avx2"
    elif "dotprod" in features and ARM64:
        choice = "sdot"
    else:
        choice = None
    lower = os.environ.get("QS_FAST_ISA", "").lower()
    if lower in ("none", "plain"):
        return None
    if lower == "avx2" and choice == "vnni":
        return "avx2"
    return choice


FEATURES = target_features()
X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
ARM64 = platform.machine().lower() in ("aarch64", "arm64")
INT8 = _choose_int8(FEATURES) if X86 or ARM64 else None
INT16_GEMM = INT8 in ("vnni", "avx2")
BF16 = (X86 and {"avx512bf16", "avx512f"} <= FEATURES
        and os.environ.get("QS_FAST_ISA", "").lower() in ("", "vnni"))


def instructions() -> str:
    """What the fast path uses here, for the banner: e.g. "int8 dot: vpdpbusd (AVX-512 VNNI)"."""
    parts = []
    if INT8 == "vnni":
        parts.append("int8 dot: vpdpbusd/vpdpwssd (VNNI)")
    elif INT8 == "avx2":
        parts.append("int8 dot: vpmaddubsw+vpmaddwd (AVX2)")
    elif INT8 == "sdot":
        parts.append("int8 dot: sdot (ARM dotprod)")
    else:
        parts.append("no int8 dot instruction")
    if BF16:
        parts.append("bf16 prefill: vdpbf16ps (AVX-512 BF16)")
    return ", ".join(parts)
