"""Broken model files, fuzzed: tests/model_fuzz.py mutates a tiny model of every architecture,
as a Hugging Face folder and as a GGUF file, and each mutant must end in a clean error or a run.

QS_FUZZ_MUTANTS sets the mutants per input (default 20) and QS_FUZZ_SEED the seed (default 0):
raise the count to hunt longer, e.g.
    QS_FUZZ_MUTANTS=400 python -m pytest -q tests/test_model_fuzz.py -s
prints the outcome table of 4,400 mutants (11 inputs: five architectures as a folder and as
a GGUF file, and a folder in shards).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.testbed.models import make_model
from common.chat_template import BUILTIN_CHATML
from common.gguf_write import write_gguf
from common.tiny_model import build_tokenizer
from model_fuzz import describe, format_table, inputs_in

FAMILIES = ("qwen3", "qwen3_moe", "llama", "qwen2", "qwen2_moe")
# rows of 128 (multiples of Q8_0's 32), as tests/test_gguf.py writes its files
SHAPES = {"qwen3": {}, "llama": {}, "qwen2": {}, "qwen3_moe": dict(moe_intermediate_size=64),
          "qwen2_moe": dict(moe_intermediate_size=64, shared_expert_intermediate_size=96)}
MUTANTS = int(os.environ.get("QS_FUZZ_MUTANTS", "20"))
SEED = int(os.environ.get("QS_FUZZ_SEED", "0"))
FUZZ = Path(__file__).resolve().parent / "model_fuzz.py"
ROOT = FUZZ.parent.parent


def write_inputs(out: Path) -> list[Path]:
    """A tiny model of each family as a folder (transformers' weights, a small real BPE
    tokenizer with a chat template) and as a Q8_0 GGUF file of that folder; and a Qwen3
    folder in shards (model.safetensors.index.json)."""
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(512)

    def folder(src: Path, name: str) -> Path:
        dst = out / name
        dst.mkdir()
        for f in src.iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
        tok.save(str(dst / "tokenizer.json"))
        (dst / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
             "chat_template": BUILTIN_CHATML}))
        return dst

    made = []
    for family in FAMILIES:
        hf = folder(make_model(family, hidden_size=128, **SHAPES[family]), f"{family}-hf")
        made += [hf, write_gguf(hf, out / f"{family}.gguf", "Q8_0")]
    return made + [folder(make_model("qwen3", sharded=True, hidden_size=128), "qwen3-sharded-hf")]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-inputs")
    write_inputs(root)
    return root


def run_fuzz(inputs: Path, out: Path) -> dict:
    """tests/model_fuzz.py in a subprocess under a 4 GiB address-space cap; a hang or a death of
    that process fails the test, naming the last mutant it started."""
    cmd = [sys.executable, str(FUZZ), str(inputs), "--count", str(MUTANTS), "--seed", str(SEED),
           "--json", str(out), "--mem-gb", "4", "--log"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    limit = 120 + MUTANTS * 6                  # 11 inputs, a few tens of ms each on a CPU
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=limit)
    except subprocess.TimeoutExpired as e:
        log = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"the fuzz run hung; the last mutant started: {log.strip().splitlines()[-1:]}")
    if not out.is_file():
        pytest.fail(f"the fuzz process died (exit {r.returncode}): a crash; its last lines:\n"
                    f"{r.stderr[-2000:]}")
    return json.loads(out.read_text())


@pytest.mark.timeout(300 + MUTANTS * 6)
def test_every_mutant_of_every_architecture_is_a_clean_error_or_a_run(inputs, tmp_path, capsys):
    """Byte flips, huge and zeroed fields and truncation of the GGUF header, config.json, the
    tokenizer files, generation_config.json and the safetensors headers, and NaN weights: each
    mutant ends in one of the project's errors naming the broken file, or in tokens (or an
    "error" event for non-finite logits); never a traceback, a hang or a crash."""
    n_inputs = len(inputs_in(inputs))
    result = run_fuzz(inputs, tmp_path / "fuzz.json")
    with capsys.disabled():
        print(f"\n[model fuzz] {MUTANTS} mutants of each of {n_inputs} inputs (seed {SEED}), "
              f"{result['seconds']} s\n{format_table(result['table'])}")
    assert not result["failures"], "\n\n".join(map(describe, result["failures"][:10]))
    table = result["table"]
    assert sum(sum(c.values()) for c in table.values()) == MUTANTS * n_inputs == 11 * MUTANTS
    for kind, counts in table.items():        # both kinds of outcome, from both kinds of input
        assert counts.get("clean", 0) > 0 and counts.get("ran", 0) > 0, (kind, counts)
    assert sum(c.get("non-finite", 0) for c in table.values()) > 0
