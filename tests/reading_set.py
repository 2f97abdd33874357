"""The stage-1 reading set: every project file that plain stage 1 imports to run a
safetensors folder, with its lines (docstrings and comments included).

    python tests/reading_set.py       # a tiny model (bench/testbed/models.py), then the list

It runs `python -m stage1_cpu.generate --model <folder> --kernels plain --raw` in a fresh
process (stage1_cpu.generate.main with that argv: the prompt as it is, no chat template) and
lists the modules of this repository in sys.modules afterwards. tests/test_reading_set.py keeps
the total under its bound and docs/stage1.md's reading list equal to the set.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOUND = 3000            # DESIGN.md: a weekend's reading, what plain stage 1 imports included

_RUN = r"""
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
sys.argv = ["python -m stage1_cpu.generate", "--model", sys.argv[2], "--kernels", "plain", "--raw",
            "--prompt", "What is the capital of France?", "--max-tokens", "2"]
import stage1_cpu.generate
status = stage1_cpu.generate.main()
packages = ("common", "stage1_cpu", "stage2_batched", "stage3_optimized")
paths = [Path(m.__file__).resolve() for m in list(sys.modules.values())
         if getattr(m, "__file__", None)]
# (the project's own .py files: a virtual environment inside the clone is not the project)
files = {str(p.relative_to(root)) for p in paths if p.suffix == ".py" and p.is_relative_to(root)
         and p.relative_to(root).parts[0] in packages}
print("READING-SET " + json.dumps({"status": status, "files": sorted(files)}))
"""


def reading_set(folder: Path) -> dict[str, int]:
    """{path relative to the repository: lines} of what plain stage 1 imports to run `folder`."""
    out = subprocess.run([sys.executable, "-c", _RUN, str(ROOT), str(folder)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    line = next((x for x in out.stdout.splitlines() if x.startswith("READING-SET ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"stage 1 did not run (exit {out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(line[len("READING-SET "):])
    if result["status"] != 0:
        raise RuntimeError(
            f"stage1_cpu.generate exited with {result['status']}:\n{out.stderr[-3000:]}"
        )
    return {f: len((ROOT / f).read_text().splitlines()) for f in result["files"]}


def main() -> int:
    sys.path.insert(0, str(ROOT))           # run as a script: the repository, for bench.testbed
    from bench.testbed.models import make_model
    files = reading_set(make_model("qwen3", tokenizer=True))
    for f, n in sorted(files.items()):
        print(f"{n:5d}  {f}")
    print(f"{sum(files.values()):5d}  in {len(files)} files (bound {BOUND})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
