"""Every stage-3 .cu file compiles to a cubin for sm_80 (A100) and sm_90 (H100/H200) with
nvcc, with no register spills and static shared memory within the 48 KiB a block may
declare statically; the report (registers, shared memory per kernel) is printed with -s
and written to the test's tmp folder.

Without a GPU this is what proves that the kernels are CUDA, not just C++ the emulator
accepts: `-Xptxas -v` also shows the register count, which decides occupancy. Skipped
only where nvcc is not installed.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stage3_optimized import kernels

CUDA_DIR = Path(kernels.__file__).parent / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
STATIC_SMEM_LIMIT = 48 * 1024          # bytes of __shared__ a kernel may declare statically
MAX_REGISTERS = 255                    # the hardware limit per thread: above it ptxas spills (checked too)


def ptxas_report(text: str) -> dict[str, dict]:
    """ptxas -v output -> kernel name -> {registers, smem, spill_stores, spill_loads}."""
    out, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = out.setdefault(m.group(1), {"registers": 0, "smem": 0, "spill_stores": 0, "spill_loads": 0})
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(s.group(1)) if s else 0
    return out


def test_every_kernel_file_is_in_the_table():
    assert {p.name for p in SOURCES} == set(kernels.KERNEL_FILES.values())


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cu", SOURCES, ids=[p.name for p in SOURCES])
def test_cubin_compiles_without_spills(cu, arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    r = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", str(cu),
                        "-o", str(tmp_path / (cu.stem + ".cubin"))], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cu.name} does not compile for {arch}:\n{r.stderr}"
    report = ptxas_report(r.stderr + r.stdout)
    names = [n for n, f in kernels.KERNEL_FILES.items() if f == cu.name]
    assert set(report) == set(names), f"kernels in the cubin {sorted(report)}, expected {names}"
    lines = []
    for name, k in sorted(report.items()):
        lines.append(f"{arch} {cu.name:24s} {name:24s} {k['registers']:3d} registers {k['smem']:6d} B smem")
        assert k["spill_stores"] == 0 and k["spill_loads"] == 0, f"{name} spills registers on {arch}: {k}"
        assert k["smem"] <= STATIC_SMEM_LIMIT, f"{name} declares {k['smem']} B of shared memory"
        assert k["registers"] <= MAX_REGISTERS, f"{name} uses {k['registers']} registers"
    (tmp_path / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
