"""The floors of the project, read from the source with `ast` (DESIGN.md, "Floors").

common/ is the ground floor and imports no stage; each stage imports common/ and its own
files, never another stage; the course's tooling (course/) and bench/ stand on the stages;
tests/ stands on everything. And no import circle anywhere. Every import statement counts,
at the top of a module or inside a function, because a function-level import is a
dependency too; only an import under `if TYPE_CHECKING:` (a type annotation) does not.
Outside tests/ a module imports by name only: none changes sys.path, which would hide an
import from this scan (bench/testbed/ is the package bench and the tests share).
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("stage1_cpu", "stage2_batched", "stage3_optimized")
# what each top-level folder may import besides itself (tests/: anything)
MAY_IMPORT = {
    "common": (),
    **{stage: ("common",) for stage in STAGES},
    "course": ("common", *STAGES),
    "bench": ("common", *STAGES),
}
FOLDERS = (*MAY_IMPORT, "tests")


def module_files(root: Path) -> dict[str, tuple[Path, str]]:
    """module name -> (file, its top-level folder), for every .py file of the project's folders.
    tests/ is on sys.path when the tests run, so its files are top-level modules (`reading_set`)."""
    found = {}
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / "tests" if folder == "tests" else root)
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = (path, folder)
    return found


def _ancestors(node: ast.AST, parents: dict):
    while node in parents:
        node = parents[node]
        yield node


def imports(root: Path) -> list[tuple[str, str, int, bool]]:
    """Every import of one project module by another: (importer, imported, line, inside a
    function). `from package import name` is an import of the submodule when `name` is one,
    else of the package. An import under `if TYPE_CHECKING:` is left out."""
    modules = module_files(root)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = []
    for module, (path, _) in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1]
                                    + ([base] if base else []))
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else known(base)
                    for a in node.names
                ]
            else:
                continue
            above = list(_ancestors(node, parents))
            if any(isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test) for p in above):
                continue
            in_function = any(isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)) for p in above)
            for target in sorted({t for t in targets if t and t != module}):
                edges.append((module, target, node.lineno, in_function))
    return edges


def cycles(edges) -> list[list[str]]:
    """The import circles: every strongly connected group of two or more modules (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b, _, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def floor_breaks(root: Path, edges) -> list[str]:
    """Imports that go up or sideways: common/ importing a stage, a stage importing another
    stage or the tooling above it, anything but tests/ and bench/ importing tests/."""
    folder = {m: f for m, (_, f) in module_files(root).items()}
    return [f"{a} (line {line}{', in a function' if in_function else ''}) imports {b}"
            for a, b, line, in_function in edges
            if folder[a] != "tests" and folder[b] != folder[a]
            and folder[b] not in MAY_IMPORT[folder[a]]]


def test_no_import_circle_among_the_project_modules():
    edges = imports(ROOT)
    assert len(edges) > 300, "the import graph is nearly empty: the scan is broken"
    assert cycles(edges) == []


def test_common_imports_no_stage_and_no_stage_imports_another():
    edges = imports(ROOT)
    assert any(a.startswith("stage1_cpu") and b.startswith("common") for a, b, _, _ in edges)
    assert floor_breaks(ROOT, edges) == []


def path_changes(root: Path) -> list[str]:
    """Every use of sys.path outside tests/: an import through it is one this scan cannot see."""
    found = []
    for module, (path, folder) in module_files(root).items():
        if folder == "tests":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
                found.append(f"{module} (line {node.lineno})")
    return found


def test_outside_tests_every_import_is_by_name():
    assert path_changes(ROOT) == []


def test_bench_and_the_tests_import_the_testbed_by_name():
    edges = {(a, b) for a, b, _, _ in imports(ROOT)}
    assert ("bench.lessons", "bench.testbed.cuda_emulator") in edges
    assert ("bench.serve", "bench.testbed.serve_load") in edges
    assert ("bench.testbed.serve_load", "bench.testbed.models") in edges       # a relative import
    assert ("test_stage1_model", "bench.testbed.models") in edges


# --- the checks above catch what they are for: planted in a copy of the tree ---

@pytest.fixture
def tree(tmp_path) -> Path:
    for folder in FOLDERS:
        shutil.copytree(
            ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "data")
        )
    return tmp_path


def _plant(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code + "\n")


def test_a_circle_through_a_function_level_import_is_found(tree):
    assert cycles(imports(tree)) == []
    # engine.py imports sampling.py at the top; sampling.py imports engine.py inside a function
    _plant(tree / "common" / "engine.py", "from common.sampling import SamplingParams  # noqa")
    _plant(
        tree / "common" / "sampling.py",
        "def planted():\n    from common import engine\n    return engine",
    )
    assert cycles(imports(tree)) == [["common.engine", "common.sampling"]]


def test_a_type_only_import_is_no_edge(tree):
    _plant(tree / "common" / "engine.py", "from common.sampling import SamplingParams  # noqa")
    _plant(tree / "common" / "sampling.py",
           "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
           "    from common.engine import Request  # noqa")
    assert cycles(imports(tree)) == []


def test_common_importing_a_stage_in_a_function_is_found(tree):
    assert floor_breaks(tree, imports(tree)) == []
    path = tree / "common" / "stopping.py"
    _plant(path, "def planted():\n    from stage1_cpu import ops\n    return ops")
    line = path.read_text().split("\n").index("    from stage1_cpu import ops") + 1
    assert floor_breaks(tree, imports(tree)) == [
        f"common.stopping (line {line}, in a function) imports stage1_cpu.ops"
    ]


def test_a_circle_through_the_testbed_is_found(tree):
    planted = "def planted():\n    from bench import lessons\n    return lessons"
    _plant(tree / "bench" / "testbed" / "models.py", planted)
    assert ["bench.lessons", "bench.testbed.models"] in cycles(imports(tree))


def test_bench_importing_a_test_module_or_changing_sys_path_is_found(tree):
    path = tree / "bench" / "testbed" / "serve_load.py"
    _plant(path, "import sys\nsys.path.insert(0, 'tests')\nimport test_stage3_engine  # noqa")
    line = path.read_text().split("\n").index("import test_stage3_engine  # noqa") + 1
    assert floor_breaks(tree, imports(tree)) == [
        f"bench.testbed.serve_load (line {line}) imports test_stage3_engine"]
    assert path_changes(tree) == [f"bench.testbed.serve_load (line {line - 1})"]
