"""Where the CUDA sources and the CUDA 13 compilers are, for the compile tests, the
emulator and bench/gpu_check.sh.

Every stage keeps its kernels in `<stage>/cuda/*.cu`; a stage is found by its folder
(stage1_cpu has none, stage2_batched has one, stage3_optimized gets one when its
kernels land), so a new stage's kernels are compiled and checked without editing a test.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# per-block limits of the targets we compile for (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability"): static __shared__ is capped at 48 KB on every
# architecture; dynamic shared memory can be raised per kernel (cudaFuncSetAttribute /
# RawKernel.max_dynamic_shared_size_bytes) up to the opt-in limit, minus the static part
STATIC_SMEM_LIMIT = 48 * 1024
OPTIN_SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
ARCHS = tuple(OPTIN_SMEM_LIMIT)


def cuda_dirs() -> list[Path]:
    """[stage2_batched/cuda, stage3_optimized/cuda, ...]: every stage folder with a cuda/."""
    return sorted(p for p in ROOT.glob("stage*/cuda") if p.is_dir())


def cu_files() -> list[Path]:
    """Every .cu file of every stage, sorted by stage then name."""
    return [f for d in cuda_dirs() for f in sorted(d.glob("*.cu"))]


def cu_id(path: Path) -> str:
    """'stage2_batched/rmsnorm.cu': the test id of a .cu file."""
    return f"{path.parent.parent.name}/{path.name}"


def in_ci() -> bool:
    """True on a CI runner (GitHub Actions, GitLab, ... set CI): there a missing compiler is
    a failure, not a skip, since the test extra installs it."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def _wheel_roots() -> list[Path]:
    """site-packages/nvidia/cu13 (the layout of the CUDA 13 wheels: nvidia-cuda-nvcc,
    nvidia-cuda-nvrtc, ...), and the CUDA 12 layout as a fallback, for every installed
    distribution of NVIDIA's."""
    roots = []
    for dist in metadata.distributions():
        if (dist.metadata["Name"] or "").lower().startswith("nvidia-"):
            base = Path(dist.locate_file("nvidia"))
            roots += [base / "cu13", base / "cuda_nvcc", base / "cuda_nvrtc"]
    return [r for r in dict.fromkeys(roots) if r.is_dir()]          # in order, each once


def find_nvcc() -> str | None:
    """$NVCC, nvcc on the PATH (a CUDA toolkit), or the nvidia-cuda-nvcc wheel's."""
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"),
                 *(str(r / "bin" / "nvcc") for r in _wheel_roots())):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def find_nvrtc() -> ctypes.CDLL | None:
    """libnvrtc, the compiler cupy.RawModule uses: $NVRTC_LIB, the nvidia-cuda-nvrtc wheel
    (CUDA 13 first), or the system's. None where absent."""
    candidates = [os.environ.get("NVRTC_LIB")]
    for root in _wheel_roots():
        candidates += sorted(str(p) for p in (root / "lib").glob("libnvrtc.so*")
                             if "builtins" not in p.name)
    candidates += [ctypes.util.find_library("nvrtc")]
    for path in filter(None, candidates):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None
