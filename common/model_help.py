"""What --model must name, said when it names no model: why a path is not a model folder, and
where to get one. common/models.py loads this only then, so a run with a good folder reads none
of it.
"""
from __future__ import annotations

from pathlib import Path

# what a model folder without tokenizer.json lacks
NO_TOKENIZER = ("the model folder needs the tokenizer.json that comes with the model (download "
                "the whole Hugging Face repository, e.g. `huggingface-cli download Qwen/Qwen3-0.6B "
                "--local-dir DIR`, or pass a folder that has one)")

# what a model folder must hold, said once for every error message
FOLDER_HELP = (
    "A model folder must hold config.json and the weights as model.safetensors (or\n"
    "model.safetensors.index.json with its shards), plus tokenizer.json and "
    "tokenizer_config.json.\n"
    "Get one from the Hugging Face hub, e.g.\n"
    "    huggingface-cli download Qwen/Qwen3-0.6B --local-dir ./Qwen3-0.6B\n"
    "and pass --model ./Qwen3-0.6B, or pass a GGUF file (--model ./model-Q8_0.gguf; architectures\n"
    "llama, qwen2, qwen2moe, qwen3, qwen3moe), or a known name such as the default demo model,\n"
    "smollm2-135m (common/fetch.py: known names need no hub, only PyPI)."
)


def not_a_model(path: Path) -> str:
    """Why `path` (no GGUF model) is not a model folder, then what one must hold."""
    if not path.exists():
        hint = ""
        parts = str(path).split("/")
        if len(parts) == 2 and all(parts) and not str(path).startswith((".", "~")):
            # looks like a hub id such as Qwen/Qwen3-0.6B
            hint = (f"\nIf {str(path)!r} is a Hugging Face model id, download it first:\n"
                    f"    huggingface-cli download {path} --local-dir ./{parts[1]}\n"
                    f"and pass --model ./{parts[1]}")
        return f"model folder {path} does not exist.{hint}\n{FOLDER_HELP}"
    if not path.is_dir():
        return f"{path} is a file, not a model folder or a .gguf file.\n{FOLDER_HELP}"
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        extra = ""
        if ggufs:
            extra = f"\nIt holds {len(ggufs)} GGUF files; pass one of them: --model {ggufs[0]}"
        return (f"{path} has no config.json, so it is not a Hugging Face model folder.{extra}\n"
                f"{FOLDER_HELP}")
    found = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")]
    extra = (f"\nIt has {', '.join(found)}; only .safetensors weights are read "
             "(download the model's safetensors files)." if found else "")
    return f"{path} has config.json but no weights (*.safetensors).{extra}\n{FOLDER_HELP}"
