"""Every .cu file of every stage compiles, without a GPU, with both compilers it meets:

- nvcc to a cubin for sm_80 and sm_90 with `-Xptxas -v`, so ptxas allocates registers
  and shared memory as it will on the GPU. A kernel fails here if it spills registers to
  local memory or uses more static shared memory than a block may have (48 KB); the
  registers and shared memory of each kernel are printed in the test summary.
- NVRTC (libnvrtc, what cupy.RawModule compiles with at run time) with the options CuPy
  adds to ours, for an explicit architecture: NVRTC includes no system headers (no
  <math.h>, so INFINITY is an error there and not under nvcc), so a kernel that nvcc
  accepts can still fail on the GPU machine at its first launch.

The .cu files are found per stage (stage*/cuda/*.cu): stage 3's kernels are checked here
as soon as they exist. Both compilers come from the test extra (nvidia-cuda-nvcc,
nvidia-cuda-nvrtc, CUDA 13); on CI a missing compiler fails instead of skipping.
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from bench.testbed import cuda_emulator as emulator
from bench.testbed.cuda_sources import (ARCHS, STATIC_SMEM_LIMIT, cu_files, cu_id, find_nvcc,
                                        find_nvrtc, in_ci)
from test_stage3_cuda_emulated import shimmed_copy

CU_FILES = cu_files()
# what kernels.py passes to cupy.RawModule, then what CuPy adds for NVRTC >= 12
# (cupy/cuda/compiler.py: -ftz=true always, --device-as-default-execution-space, and
# -arch=sm_XX when it builds a cubin directly)
RAWMODULE_OPTIONS = ("--std=c++17",)
CUPY_ADDS = ("-ftz=true", "--device-as-default-execution-space")


def _missing(what: str, how: str):
    if in_ci():
        pytest.fail(f"{what} is not installed on CI: {how}")
    pytest.skip(f"{what} is not installed ({how})")


def emulator_source(cu, folder):
    """The .cu file as the emulator builds it (a tensor-core file with its fragment shim)."""
    if emulator.unsupported(cu.read_text()) is None:
        return cu
    return shimmed_copy(cu, folder / "shimmed")


def test_cu_files_are_found_per_stage():
    stages = {p.parent.parent.name for p in CU_FILES}
    assert "stage2_batched" in stages
    assert len([p for p in CU_FILES if p.parent.parent.name == "stage2_batched"]) >= 8


PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
PTXAS_SPILL = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, dict]:
    """ptxas -v output -> {kernel: {registers, smem, stack, spill_stores, spill_loads}}."""
    kernels, current = {}, None
    for line in log.splitlines():
        if m := PTXAS_ENTRY.search(line):
            current = kernels.setdefault(m.group(1), dict(registers=0, smem=0, stack=0,
                                                          spill_stores=0, spill_loads=0))
        elif current is not None and (m := PTXAS_SPILL.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif current is not None and (m := PTXAS_USED.search(line)):
            current.update(registers=int(m.group(1)), smem=int(m.group(2) or 0))
    return kernels


def test_parse_ptxas_reads_registers_smem_and_spills():
    log = """ptxas info    : Compiling entry function 'k' for 'sm_90'
ptxas info    : Function properties for k
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4128 bytes smem, 400 bytes cmem[0]"""
    assert parse_ptxas(log) == {"k": dict(registers=255, smem=4128, stack=8, spill_stores=4,
                                          spill_loads=12)}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cu", CU_FILES, ids=cu_id)
def test_cu_file_compiles_to_a_cubin_without_spills(cu, arch, tmp_path, request):
    nvcc = find_nvcc()
    if nvcc is None:
        _missing("nvcc", "pip install nvidia-cuda-nvcc, or a CUDA 13 toolkit on the PATH")
    r = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "--std=c++17", "-Xptxas", "-v", str(cu),
                        "-o", str(tmp_path / "out.cubin")],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"{cu_id(cu)} for {arch}:\n{r.stderr}"
    assert (tmp_path / "out.cubin").stat().st_size > 0
    kernels = parse_ptxas(r.stderr)
    assert kernels, f"no kernel in ptxas' report of {cu_id(cu)}:\n{r.stderr}"
    lines = request.config.__dict__.setdefault("_qs_cuda_resources", [])
    for name, k in sorted(kernels.items()):
        lines.append(f"{cu_id(cu):40s} {arch}  {name:28s} {k['registers']:3d} registers  "
                     f"{k['smem']:6d} B static smem  {k['stack']:4d} B stack")
        assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (
            f"{name} ({cu_id(cu)}, {arch}) spills registers to local memory: {k}")
        assert k["smem"] <= STATIC_SMEM_LIMIT, (
            f"{name} ({cu_id(cu)}, {arch}) has {k['smem']} B of static shared memory, more than "
            f"the {STATIC_SMEM_LIMIT} B a block may have; use dynamic shared memory and raise "
            f"max_dynamic_shared_size_bytes")
    if arch == "sm_90" and shutil.which("g++"):
        # the emulator's count of each kernel's static shared memory (what it checks a launch's
        # dynamic part against) is ptxas' own
        emulated = emulator.build([emulator_source(cu, tmp_path)], tmp_path / "emulated")
        counted = {name: kernel.static_smem for name, kernel in emulated.items()}
        assert counted == {name: k["smem"] for name, k in kernels.items()}


def test_a_kernel_over_the_shared_memory_limit_fails_to_compile(tmp_path):
    """The check above is not vacuous: 64 KB of static shared memory is rejected."""
    nvcc = find_nvcc()
    if nvcc is None:
        _missing("nvcc", "pip install nvidia-cuda-nvcc, or a CUDA 13 toolkit on the PATH")
    src = tmp_path / "big.cu"
    src.write_text('extern "C" __global__ void big(float* out)\n'
                   '{ __shared__ float s[16384]; s[threadIdx.x] = 1.0f; __syncthreads();\n'
                   '  out[threadIdx.x] = s[(threadIdx.x + 1) % 16384]; }\n')
    r = subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-Xptxas", "-v", str(src), "-o",
                        str(tmp_path / "big.cubin")], capture_output=True, text=True, timeout=240)
    assert r.returncode != 0 and "shared" in r.stderr.lower(), r.stderr


def nvrtc_compile(lib, source: bytes, name: str, options: tuple[str, ...]) -> tuple[int, str, int]:
    """-> (nvrtc result, log, cubin bytes)"""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, name.encode(), 0, None, None) == 0
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        cubin = ctypes.c_size_t(0)
        if rc == 0:
            assert lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)) == 0
        return rc, log.value.decode(errors="replace"), cubin.value
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cu", CU_FILES, ids=cu_id)
def test_cu_file_compiles_with_nvrtc_like_cupy_does(cu, arch):
    lib = find_nvrtc()
    if lib is None:
        _missing("libnvrtc", "pip install nvidia-cuda-nvrtc (CUDA 13), or set NVRTC_LIB")
    rc, log, cubin = nvrtc_compile(lib, cu.read_bytes(), cu.name,
                                   RAWMODULE_OPTIONS + CUPY_ADDS + (f"-arch={arch}",))
    assert rc == 0, f"{cu_id(cu)} ({arch}) does not compile in cupy.RawModule:\n{log}"
    assert cubin > 0


def test_nvrtc_rejects_what_only_nvcc_accepts():
    """NVRTC really is stricter: INFINITY (from <math.h>, which nvcc includes and NVRTC
    does not) is an error there, which is why the .cu files spell -inf with bits."""
    lib = find_nvrtc()
    if lib is None:
        _missing("libnvrtc", "pip install nvidia-cuda-nvrtc (CUDA 13), or set NVRTC_LIB")
    src = b'extern "C" __global__ void k(float* x) { x[0] = -INFINITY; }\n'
    rc, log, _ = nvrtc_compile(lib, src, "k.cu", RAWMODULE_OPTIONS + CUPY_ADDS + ("-arch=sm_90",))
    assert rc != 0 and "INFINITY" in log


def test_ci_script_sets_ci_and_runs_the_readme_test_command():
    """.ci/run exports CI=1 (a missing compiler fails the tests above instead of skipping them)
    and ends with exactly the README's test command; the slowest tests are printed by
    pyproject's addopts (--durations=25), so both print them."""
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    ci = (root / ".ci" / "run").read_text()
    assert re.search(r"^export CI=1$", ci, re.M)
    readme_cmd = "pip install -e '.[test]' && python -m pytest -q"
    assert readme_cmd in (root / "README.md").read_text() and readme_cmd in ci
    assert "--durations=25" in (root / "pyproject.toml").read_text()
