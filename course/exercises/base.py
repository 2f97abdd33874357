"""The exercise framework: what an exercise is, the marked region it rewrites, the
workspace a student writes it in, and the helpers its check uses.

An exercise is a region of the reference code itself, between two one-line comments:

    # exercise 1.3 begin          (// exercise 2.4 begin in a .cu file)
    ...the reference body...
    # exercise 1.3 end

`start` copies the exercise's file (and the files it `needs`) into a workspace,
paths kept, and replaces the region by a stub: in Python a
`raise NotImplementedError("exercise 1.3: <title>")`, in a .cu file nothing (a body
that writes nothing). The markers stay, so the student sees where to write.

`check` imports the workspace's copies (Workspace.module): the workspace's file comes
first, the installed package supplies the rest, under a package name of the
workspace's own, so that neither the real modules nor another workspace are touched.
A check raises CheckFailed naming the first mismatch in words.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import itertools
import re
import shutil
import sys
import time
import traceback
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent.parent     # the installed package's root
DIFFICULTIES = ("easy", "medium", "hard")


class CheckFailed(Exception):
    """A check's verdict on wrong code; the message names the first mismatch in words."""


@dataclass(frozen=True)
class Exercise:
    id: str                      # "STAGE.N", e.g. "1.3"
    title: str                   # what the student writes, in a few words
    section: str                 # the chapter section to read first: "docs/stage1.md#rmsnorm"
    difficulty: str              # easy | medium | hard
    file: str                    # repo-relative file that holds the marked region
    needs: tuple[str, ...] = ()  # other repo-relative files copied into the workspace
    check: Callable[["Workspace"], None] = field(default=None, kw_only=True)  # raises CheckFailed

    def __post_init__(self):
        if not re.fullmatch(r"[123]\.[1-9][0-9]*", self.id):
            raise ValueError(f"exercise id {self.id!r} is not STAGE.N (e.g. 1.3)")
        if self.difficulty not in DIFFICULTIES:
            raise ValueError(f"exercise {self.id}: difficulty {self.difficulty!r} is not one of "
                             f"{DIFFICULTIES}")
        if self.check is None:
            raise ValueError(f"exercise {self.id} has no check")

    @property
    def stub_message(self) -> str:
        return f"exercise {self.id}: {self.title}"


# ---------------------------------------------------------------------------
# Markers
# ---------------------------------------------------------------------------

def _comment(path: str | Path) -> str:
    return "//" if str(path).endswith((".cu", ".cuh", ".h", ".cpp")) else "#"


def find_region(lines: Sequence[str], ex_id: str, path: str | Path) -> tuple[int, int, str]:
    """-> (index of the begin line, index of the end line, indentation) of exercise ex_id's
    region in lines (no line ends). Raises ValueError when the markers are missing,
    doubled, out of order or at different indentations."""
    c = re.escape(_comment(path))
    begin = re.compile(rf"^(\s*){c} exercise {re.escape(ex_id)} begin$")
    end = re.compile(rf"^(\s*){c} exercise {re.escape(ex_id)} end$")
    b = [(i, m.group(1)) for i, ln in enumerate(lines) if (m := begin.match(ln))]
    e = [(i, m.group(1)) for i, ln in enumerate(lines) if (m := end.match(ln))]
    if len(b) != 1 or len(e) != 1:
        raise ValueError(f"{path}: expected one '{_comment(path)} exercise {ex_id} begin' and one "
                         f"'... end' line, found {len(b)} and {len(e)}")
    (bi, ind), (ei, ind2) = b[0], e[0]
    if ei <= bi or ind != ind2:
        raise ValueError(f"{path}: the markers of exercise {ex_id} are out of order or not at "
                         "one indentation")
    return bi, ei, ind


def region_text(text: str, ex_id: str, path: str | Path) -> list[str]:
    """The lines strictly between exercise ex_id's markers."""
    lines = text.split("\n")
    bi, ei, _ = find_region(lines, ex_id, path)
    return lines[bi + 1:ei]


def replace_region(text: str, ex_id: str, path: str | Path, body: list[str]) -> str:
    """text with exercise ex_id's region replaced by body (lines), the markers kept."""
    lines = text.split("\n")
    bi, ei, _ = find_region(lines, ex_id, path)
    return "\n".join(lines[:bi + 1] + list(body) + lines[ei:])


def stub_lines(ex: Exercise) -> list[str]:
    """What start puts in the region: a raise in Python, nothing in a .cu file."""
    if _comment(ex.file) == "//":
        return []
    lines = (REPO / ex.file).read_text().split("\n")
    _, _, indent = find_region(lines, ex.id, ex.file)
    return [f"{indent}raise NotImplementedError({ex.stub_message!r})"]


def reference_region(ex: Exercise) -> list[str]:
    """The reference body of ex, as the installed file holds it."""
    return region_text((REPO / ex.file).read_text(), ex.id, ex.file)


def is_stub(ex: Exercise, ws: "Workspace") -> bool:
    """True while the workspace's region is still the stub that start wrote."""
    try:
        body = region_text(ws.path(ex.file).read_text(), ex.id, ex.file)
    except (OSError, ValueError):
        return False
    return [ln.strip() for ln in body if ln.strip()] == [ln.strip() for ln in stub_lines(ex)]


# ---------------------------------------------------------------------------
# Workspaces
# ---------------------------------------------------------------------------

def start(ex: Exercise, folder: str | Path) -> "Workspace":
    """Create the workspace for ex in folder (absent or empty): the stubbed copy of ex.file
    and copies of ex.needs, repo-relative paths kept."""
    root = Path(folder)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"{root} exists and is not empty: choose a new folder (or "
                              "empty this one)")
    text = (REPO / ex.file).read_text()
    stubbed = replace_region(text, ex.id, ex.file, stub_lines(ex))
    for rel in ex.needs:
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / rel, dst)
    dst = root / ex.file
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(stubbed)
    return Workspace(root)


def put_back_reference(ex: Exercise, ws: "Workspace") -> None:
    """Write the reference body into the workspace's region (the tests' "solution")."""
    p = ws.path(ex.file)
    p.write_text(replace_region(p.read_text(), ex.id, ex.file, reference_region(ex)))


_serial = itertools.count()
_ROOTS: dict[str, Path] = {}        # a workspace's package prefix -> its folder


class _Finder:
    """Finds a workspace package's modules on its __path__ (workspace first, then the installed
    package) and loads them so that the numba kernels defined in a workspace file cache their
    machine code in the workspace (DIR/.numba-cache), away from the stage's own cache, while
    the installed files' kernels use the stage's cache as the real modules do."""

    @staticmethod
    def find_spec(name, path, target=None):
        root = _ROOTS.get(name.split(".")[0])
        if root is None or path is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None and spec.origin:
            in_ws = Path(spec.origin).resolve().is_relative_to(root)
            spec.loader = _Loader(spec.loader, str(root / ".numba-cache") if in_ws else None)
        return spec


class _Loader:
    def __init__(self, inner, cache_dir: str | None):
        self._inner, self._cache_dir = inner, cache_dir

    def __getattr__(self, name):             # get_source, get_filename, ... (linecache, inspect)
        return getattr(self._inner, name)

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        if self._cache_dir is None:
            return self._inner.exec_module(module)
        import numba
        old = numba.config.CACHE_DIR
        # numba picks a kernel's cache folder at its decoration
        numba.config.CACHE_DIR = self._cache_dir
        try:
            self._inner.exec_module(module)
        finally:
            numba.config.CACHE_DIR = old


def _install_finder() -> None:
    if _Finder not in sys.meta_path:
        sys.meta_path.insert(0, _Finder)


class Workspace:
    """A student's folder. module() imports its copies under a package name of its own
    (_qs_exercise_N.stage1_cpu, ...), whose search path is [workspace dir, installed dir]:
    relative imports find the workspace's files first, then the installed package's."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.prefix = f"_qs_exercise_{next(_serial)}"

    def path(self, rel: str) -> Path:
        """The workspace copy of a repo-relative file."""
        return self.root / rel

    def module(self, rel: str) -> types.ModuleType:
        """Import the workspace copy of the repo-relative .py file rel (it must exist)."""
        if not self.path(rel).is_file():
            raise CheckFailed(f"{self.path(rel)} is missing: make the folder with "
                              f"`python -m course.exercises start ID {self.root}`")
        parts = Path(rel).with_suffix("").parts
        self._package(parts[:-1])
        importlib.invalidate_caches()            # files written a moment ago must be seen
        name = ".".join((self.prefix,) + parts)
        if name in sys.modules:
            return sys.modules[name]
        return self._import(name)

    def _package(self, pkg: tuple[str, ...]) -> None:
        """Make the synthetic packages prefix, prefix.pkg[0], prefix.pkg[0].pkg[1], ..."""
        if self.prefix not in sys.modules:
            self._new_package(self.prefix, [str(self.root)], None)
        for i in range(1, len(pkg) + 1):
            name = ".".join((self.prefix,) + pkg[:i])
            if name in sys.modules:
                continue
            real_name = ".".join(pkg[:i])
            # its __init__ runs once, as a real import would
            real = importlib.import_module(real_name)
            installed = list(getattr(real, "__path__", []))
            self._new_package(name, [str(self.root.joinpath(*pkg[:i]))] + installed, real)

    def _new_package(self, name: str, path: list[str], real: types.ModuleType | None) -> None:
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = path
        mod = importlib.util.module_from_spec(spec)
        mod.__path__ = path
        if real is not None:
            # the real package's own names (stage1_cpu.WAIT_POLICY, ...), not its submodules:
            # `from . import kernels` must import the workspace's kernels.py when there is one
            for key, value in vars(real).items():
                if not key.startswith("__") and not isinstance(value, types.ModuleType):
                    setattr(mod, key, value)
        sys.modules[name] = mod
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, mod)

    def _import(self, name: str) -> types.ModuleType:
        _install_finder()
        _ROOTS[self.prefix] = self.root
        return importlib.import_module(name)

    def close(self) -> None:
        """Drop this workspace's modules from sys.modules (objects already made keep working)."""
        for name in [n for n in sys.modules if n == self.prefix or n.startswith(self.prefix + ".")]:
            del sys.modules[name]
        _ROOTS.pop(self.prefix, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------
# Running a check
# ---------------------------------------------------------------------------

@dataclass
class Outcome:
    passed: bool
    message: str         # "pass", or why it failed
    seconds: float


def run_check(ex: Exercise, ws: Workspace) -> Outcome:
    """Run ex's check on the workspace's code. Anything but a clean return is a failure:
    a CheckFailed (its message), the stub's NotImplementedError ("not written yet"), a
    missing package or file, any other exception (its type, message and the workspace
    line it came from), and a test framework's skip."""
    t0 = time.perf_counter()
    if not ws.path(ex.file).is_file():
        return Outcome(False, f"{ws.path(ex.file)} is missing: make the workspace with "
                              f"`python -m course.exercises start {ex.id} {ws.root}`", 0.0)
    try:
        ex.check(ws)
    except CheckFailed as e:
        msg = str(e)
    except NotImplementedError as e:
        msg = f"not written yet: {e} (write it in {ws.path(ex.file)})"
    except ModuleNotFoundError as e:
        msg = (f"this check needs the package {e.name!r}, which is not installed: "
               "pip install -e '.[test]' (from the repository's root)")
    except KeyboardInterrupt:
        raise
    except BaseException as e:           # pytest's Skipped and friends derive from BaseException
        kind = type(e).__name__
        if "skip" in kind.lower():
            msg = f"the check skipped ({e}): a skipped check is a failure; it needs what it names"
        else:
            msg = f"{kind}: {_first_lines(str(e))}{_where(e, ws)}"
        if ex.stub_message in str(e):
            msg = f"not written yet: {ws.path(ex.file)} still holds the stub ({msg})"
    else:
        return Outcome(True, "pass", time.perf_counter() - t0)
    finally:
        ws.close()
    if is_stub(ex, ws) and not msg.startswith("not written yet"):
        # a .cu stub writes nothing, so its check fails on a wrong value, not on a raise
        msg = f"not written yet: {ws.path(ex.file)} still holds the stub ({msg})"
    return Outcome(False, msg, time.perf_counter() - t0)


def _first_lines(s: str, n: int = 12) -> str:
    lines = s.strip().split("\n")
    return "\n".join(lines[:n]) + ("\n..." if len(lines) > n else "")


def _where(e: BaseException, ws: Workspace) -> str:
    """' (at FILE:LINE)' for the innermost traceback frame inside the workspace."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if str(f.filename).startswith(str(ws.root))]
    return f"\n  at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else ""


# ---------------------------------------------------------------------------
# Helpers for checks
# ---------------------------------------------------------------------------

def _index_words(idx: tuple, axes_names: Sequence[str]) -> str:
    names = list(axes_names) + [f"axis {i}" for i in range(len(axes_names), len(idx))]
    return ", ".join(f"{names[i]} {int(v)}" for i, v in enumerate(idx)) or "the value"


def which_mistake(got, mistakes: Sequence[tuple[str, object]], atol: float, rtol: float) -> str:
    """The words of the first known mistake whose result `got` is (within the tolerance), else "".
    A check names a mistake only when the student's numbers are exactly what it computes."""
    got = np.asarray(got, dtype=np.float64)
    for words, result in mistakes:
        result = np.asarray(result, dtype=np.float64)
        if result.shape == got.shape and np.allclose(got, result, rtol=rtol, atol=atol):
            return words
    return ""


def assert_close(name: str, got, want, atol: float = 1e-5, rtol: float = 1e-4,
                 axes_names: Sequence[str] = ("token", "head", "dim"), hint: str = "",
                 mistakes: Sequence[tuple[str, object]] = ()) -> None:
    """Raise CheckFailed unless got matches want within atol + rtol |want| everywhere,
    naming the first index that does not (in axes_names' words) and what was expected.
    mistakes: (words, the result that mistake gives); when got is one of them, its words
    replace the hint, so the message points at that mistake and no other."""
    got = np.asarray(got)
    want = np.asarray(want)
    hint = f" ({hint})" if hint else ""
    if got.shape != want.shape:
        raise CheckFailed(f"{name}: shape {list(got.shape)}, expected {list(want.shape)}{hint}")
    g, w = got.astype(np.float64), want.astype(np.float64)
    bad = ~np.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    if not bad.any():
        return
    named = which_mistake(g, mistakes, atol, rtol)
    hint = f" ({named})" if named else hint
    idx = tuple(np.argwhere(bad)[0])
    n = int(bad.sum())
    raise CheckFailed(f"{name}: at {_index_words(idx, axes_names)}: expected {w[idx]:.6g}, got "
                      f"{g[idx]:.6g} ({n} of {bad.size} values differ; tolerance {atol:g} + "
                      f"{rtol:g} x |expected|){hint}")


def assert_equal(name: str, got, want, axes_names: Sequence[str] = ("row",), hint: str = "",
                 show: Callable | None = None, mistakes: Sequence[tuple[str, object]] = ()) -> None:
    """Raise CheckFailed unless got equals want exactly (shape, then values); show(v) formats
    a value for the message; mistakes as assert_close's, compared exactly."""
    got = np.asarray(got)
    want = np.asarray(want)
    hint = f" ({hint})" if hint else ""
    if got.shape != want.shape:
        raise CheckFailed(f"{name}: shape {list(got.shape)}, expected {list(want.shape)}{hint}")
    bad = got != want
    if bad.dtype != bool or not bad.any():
        return
    named = next((words for words, result in mistakes if np.array_equal(got, result)), "")
    hint = f" ({named})" if named else hint
    idx = tuple(np.argwhere(bad)[0])
    fmt = show or (lambda v: repr(v.item()) if hasattr(v, "item") else repr(v))
    raise CheckFailed(f"{name}: at {_index_words(idx, axes_names)}: expected {fmt(want[idx])}, got "
                      f"{fmt(got[idx])} ({int(bad.sum())} of {bad.size} values differ){hint}")


def require(ok: bool, message: str) -> None:
    """A check's own condition: CheckFailed(message) unless ok."""
    if not ok:
        raise CheckFailed(message)


_models: dict = {}


def tiny_model(family: str = "qwen3", **overrides) -> Path:
    """A tiny random transformers model saved to a folder (real architecture, real file
    layout), built once per process and shared by every check that asks for it: the
    oracle the project's tests use (bench/testbed/models.py builds the same kind). Needs torch
    and transformers (pip install -e '.[test]')."""
    key = (family, repr(sorted(overrides.items())))
    if key in _models:
        return _models[key][0]
    import atexit
    import json
    import tempfile

    import torch
    import transformers as tf

    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512,
              rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
    if family == "qwen3":
        cfg_cls, model_cls = tf.Qwen3Config, tf.Qwen3ForCausalLM
    elif family == "qwen3_moe":
        kw.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        cfg_cls, model_cls = tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(f"tiny_model knows qwen3 and qwen3_moe, not {family!r}")
    kw.update(overrides)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers' MoE init ignores initializer_range
            if "experts" in name and p.std() < 0.05:
                p.normal_(0.0, kw["initializer_range"])
    folder = Path(tempfile.mkdtemp(prefix=f"qs-exercise-{family}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}))
    _models[key] = (folder, model)
    return folder


def hf_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """transformers' logits [T, V] (float32) of every position of ids, for a tiny_model folder."""
    import torch
    model = next(m for f, m in _models.values() if f == folder)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()
