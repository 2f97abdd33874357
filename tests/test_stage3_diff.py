"""Stage 3 reads as a diff of stage 2 (STYLE.md 1 and 5): the same file names, a
"Changed from stage 2" docstring in every module, and the functions a lesson does not
touch are stage 2's, compared as parsed code (with the package name normalised)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
S2, S3 = ROOT / "stage2_batched", ROOT / "stage3_optimized"

# functions and methods that no stage-3 lesson changes
UNCHANGED = {
    "scheduler.py": ["Scheduler.add", "Scheduler.has_work", "Scheduler.find", "Scheduler.finish",
                     "Scheduler._preempt"],
    "block_manager.py": ["BlockManager.pages_for"],
    "engine.py": ["array_module", "LLMEngine.add_request", "LLMEngine.abort", "LLMEngine.has_work",
                  "LLMEngine.num_free_pages", "LLMEngine.num_total_pages"],
    "sequence.py": ["Sequence.from_request", "Sequence.prompt_ids", "Sequence.output_ids",
                    "Sequence.num_uncomputed"],
    "ops.py": ["rope_tables", "rope", "store_kvcache", "_gather_pages", "_attend", "silu_mul",
               "residual_add", "softmax", "route"],
    "kernels.py": ["route"],                   # MoE routing: one function, as stage 1's kern.route
    "kv_cache.py": ["KVCache.keys", "KVCache.values"],
}


def functions(path: Path) -> dict[str, str]:
    """'Class.method' or 'function' -> its parsed body, docstrings dropped, stage names
    normalised."""
    tree = ast.parse(path.read_text().replace("stage3_optimized", "stage2_batched"))
    out = {}

    def strip(fn):
        body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(
            getattr(fn.body[0], "value", None),
            ast.Constant) and isinstance(fn.body[0].value.value, str) else fn.body
        return ast.dump(ast.Module(body=body, type_ignores=[]))

    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = strip(node)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = strip(item)
    return out


def test_stage3_has_every_stage2_file():
    assert {p.name for p in S2.glob("*.py")} <= {p.name for p in S3.glob("*.py")}


@pytest.mark.parametrize("name", sorted(p.name for p in S3.glob("*.py") if p.name != "__init__.py"))
def test_every_module_says_what_changed(name):
    doc = ast.get_docstring(ast.parse((S3 / name).read_text())) or ""
    assert "Changed from stage" in doc, (f"{name}: the docstring should say what changed from "
                                         "stage 2")


@pytest.mark.parametrize("name", sorted(UNCHANGED))
def test_untouched_functions_are_stage2s(name):
    two, three = functions(S2 / name), functions(S3 / name)
    for fn in UNCHANGED[name]:
        assert fn in two and fn in three, f"{name}: {fn} is missing"
        assert two[fn] == three[fn], f"{name}: {fn} differs from stage 2's"


def test_every_cu_file_is_in_the_kernel_table():
    """Every stage-3 .cu file is launched from kernels.py (tests/test_cuda_compile.py compiles
    them all; tests/test_stage3_cuda_emulated.py runs them)."""
    from stage3_optimized import kernels
    assert {p.name for p in (S3 / "cuda").glob("*.cu")} == set(kernels.KERNEL_FILES.values())
