"""The project's Python within 100 columns and free of pyflakes' findings (unused imports,
undefined names): `ruff check` with pyproject.toml's [tool.ruff], as a reader's editor runs it."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is in the test extra: pip install -e '.[test]'"
    out = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
