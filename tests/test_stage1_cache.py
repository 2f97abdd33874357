"""numba's disk cache after an edit: a kernel that inlines a function from another file
is recompiled when that file changes (stage1_cpu/jit/numba_stamps.py; numba alone runs stale
machine code then), and the warm-up mark follows the kernel files' contents, not those
of files without kernels (stage1_cpu/jit/numba_cache.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

HELPER = "from numba import njit\n\n@njit(inline='always')\ndef value():\n    return {}\n"
KERNEL = ("{setup}from numba import njit\nfrom helper import value\n\n"
          "@njit(cache=True)\ndef kernel():\n    return value() * 10\n\nprint(kernel())\n")
DEPEND = ("import sys\nsys.path.insert(0, {root!r})\nfrom pathlib import Path\n"
          "from stage1_cpu.jit import numba_stamps\nhere = Path(__file__).parent\n"
          "numba_stamps.depend([here / 'kernel.py'], on=[here / 'helper.py'])\n")


def run_kernel(folder: Path, cache: Path) -> str:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(folder))
    out = subprocess.run([sys.executable, str(folder / "kernel.py")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.parametrize("with_depend", [True, False])
def test_an_edit_to_an_inlined_helper_recompiles_the_kernel_that_depends_on_it(
    tmp_path, with_depend
):
    (tmp_path / "helper.py").write_text(HELPER.format(1))
    setup = DEPEND.format(root=str(ROOT)) if with_depend else ""
    (tmp_path / "kernel.py").write_text(KERNEL.format(setup=setup))
    cache = tmp_path / "cache"
    assert run_kernel(tmp_path, cache) == "10"
    (tmp_path / "helper.py").write_text(HELPER.format(2))          # kernel.py itself is unchanged
    # numba alone finds kernel.py unchanged and loads the machine code that inlined value() == 1
    assert run_kernel(tmp_path, cache) == ("20" if with_depend else "10")


def test_warm_mark_follows_the_kernel_files_only(tmp_path):
    from stage1_cpu.jit import numba_cache
    a, b = tmp_path / "kernels.py", tmp_path / "ops.py"
    a.write_text("x = 1\n")
    b.write_text("y = 1\n")
    mark = numba_cache.warm_mark(str(tmp_path), [a], "int8", "plain")
    b.write_text("y = 2\n")                                         # a file without kernels
    assert numba_cache.warm_mark(str(tmp_path), [a], "int8", "plain") == mark
    a.write_text("x = 2\n")                                         # a kernel file: warm up again
    assert numba_cache.warm_mark(str(tmp_path), [a], "int8", "plain") != mark
    assert numba_cache.warm_mark(str(tmp_path), [a], "int4", "plain") != numba_cache.warm_mark(
        str(tmp_path), [a], "int8", "plain")


def test_stage1_keys_each_path_on_the_files_it_compiles():
    from stage1_cpu.jit import numba_cache, numba_stamps
    from stage1_cpu import fast
    from stage1_cpu.fast import decode_step  # noqa: F401  (its kernels are defined, so stamped)
    names = {p.name for p in numba_cache.KERNEL_FILES}
    # ops.py, chat.py hold no numba code
    assert names == {"norms.py", "kernels.py", "matmul.py"}
    fp = fast.FastPath("int8", "fp32")
    assert set(numba_cache.KERNEL_FILES) <= set(fp.files())
    assert ({"decode_step.py", "simd.py", "kernels.py", "plan.py", "blocks.py"}
            <= {p.name for p in fast.FILES})
    def group(name):
        return {p.name if p.parent.name == "stage1_cpu" else "fast/" + p.name
                for p in numba_stamps._GROUPS[str((ROOT / "stage1_cpu/fast" / name).resolve())]}
    # the one-region step's halves call each other through a function pointer, so each is
    # stamped with the files it inlines: an RMSNorm edit recompiles the worker, not the matrix
    # phases; an int8 matmul edit the matrix phases, not the worker
    assert ({"norms.py", "kernels.py", "fast/sync.py", "fast/decode_step.py"}
            <= group("decode_step.py"))
    assert ("matmul.py" not in group("decode_step.py")
            and "fast/matvec.py" not in group("decode_step.py"))
    assert ({"matmul.py", "fast/blocks.py", "fast/kernels.py", "fast/simd.py", "fast/matvec.py"}
            <= group("matvec.py"))
    assert not {"norms.py", "kernels.py"} & group("matvec.py")
    # the rest of fast/ keeps the stamp of every stage-1 kernel file
    assert {p.name for p in numba_cache.KERNEL_FILES} <= group("attention.py")
    # the core's own files keep numba's per-file stamp
    assert str((ROOT / "stage1_cpu/kernels.py").resolve()) not in numba_stamps._GROUPS


def test_warm_up_runs_once_per_mark_and_forgets_the_cache(tmp_path):
    from stage1_cpu.jit import numba_cache
    kernel = tmp_path / "kernels.py"
    kernel.write_text("x = 1\n")

    class Engine(numba_cache.WarmUp):
        max_ctx, fed, resets, key = 100, [], 0, (str(tmp_path), [kernel], "int8", "plain")
        model = type(
            "M", (), {"forward": lambda self, tokens, pos: Engine.fed.append((len(tokens), pos))}
        )()

        def warm_key(self):
            return self.key

        def reset(self):
            Engine.resets += 1

    e = Engine()
    assert e.kernels_cold()
    assert e.warm_up() is not None
    assert Engine.fed == [(1, 0), (2, 1), (8, 3), (64, 11)] and Engine.resets == 1
    assert not e.kernels_cold() and e.warm_up() is None and Engine.resets == 1   # the mark is there
    kernel.write_text("x = 2\n")                                    # an edit: warm up again
    assert e.kernels_cold()
    e.key = None                                                    # no numba code: never cold
    assert not e.kernels_cold() and e.warm_up() is None
