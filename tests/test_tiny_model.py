"""The course's small model (common/tiny_model.py): a real Qwen3 folder, and a chat of stage 3
and of a lesson rung on it that shows what the prefix cache saved.

  * transformers loads the folder as it is, and stage 1's fp32 logits equal its logits:
    the folder is a Qwen3 checkpoint, not something only this engine reads;
  * its tokenizer is a byte-level BPE that encodes any text and decodes it back, with
    Qwen3's chat tokens as single tokens; the same seed writes the same bytes;
  * the stage-3 chat on CPU (`--page-size 4`) shows "(N cached)" on a second turn that
    repeats the first, from the engine's own count (num_cached_tokens); so does rung 01,
    the first lesson (the prefix cache), six tokens an answer.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf

from common.tiny_model import write_tiny_model
from common.tokenizer import Tokenizer
from stage1_cpu.engine import LLMEngine

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}
STATS = re.compile(r"(\d+) prompt tokens(?: \((\d+) cached\))? · (\d+) generated")
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_tiny_model_is_a_qwen3_folder_transformers_reads_and_stage1_matches(tiny):
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    ids = Tokenizer(tiny).encode(QUESTION)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()                  # [T, V]
    eng = LLMEngine(str(tiny), quant="none", kernels="plain", progress=False)
    got = eng.model.forward(np.asarray(ids, dtype=np.int64), 0, all_logits=True)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4
    assert ref.std() > 1.0                 # random weights wide enough to move the logits apart


def test_tiny_tokenizer_round_trips_text_and_the_seed_fixes_the_files(tiny, tmp_path):
    tok = Tokenizer(tiny)
    text = "The capital of France is Paris. Ünïcode ✓, 東京, emoji 🙂\n\ttabs"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode())      # merges were learned
    for marker in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert len(tok.encode(marker)) == 1, marker
    again = write_tiny_model(tmp_path / "again")
    for f in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (again / f).read_bytes() == (tiny / f).read_bytes(), f
    other = write_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()


def test_tiny_model_command_refuses_a_folder_that_holds_files(tiny):
    r = subprocess.run([sys.executable, "-m", "common.tiny_model", str(tiny)], capture_output=True,
                       text=True, env=ENV, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and "not an empty folder" in r.stderr
    assert (tiny / "model.safetensors").is_file()                       # nothing was lost


def chat_twice(
    module: str, folder: Path, extra_env: dict | None = None
) -> tuple[list[tuple], float]:
    """The same question twice through `python -m module` on CPU, greedy, pages of 4 positions
    -> (each turn's (prompt tokens, cached or None, generated), seconds)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", module, "--model", str(folder), "--device", "cpu",
                        "--page-size", "4", "--max-tokens", "6", "--temperature", "0"],
                       input=f"{QUESTION}\n{QUESTION}\n", capture_output=True, text=True,
                       env={**ENV, **(extra_env or {})}, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    turns = [(int(a), int(b) if b else None, int(c)) for a, b, c in STATS.findall(r.stderr)]
    assert len(turns) == 2, r.stderr
    return turns, time.perf_counter() - t0


def test_stage3_chat_on_cpu_shows_the_cached_prompt_tokens_of_a_repeated_turn(tiny):
    (p1, c1, g1), (p2, c2, g2) = chat_twice("stage3_optimized.chat", tiny)[0]
    assert c1 is None and g1 == g2 == 6
    # turn 2 re-sends turn 1: at least turn 1's full pages of 4 come from the prefix cache
    assert c2 is not None and p1 // 4 * 4 <= c2 < p2, (p1, c2, p2)


def test_prefix_cache_rung_chats_on_the_tiny_model_bounded_with_cached_tokens(tiny, tmp_path):
    """Rung 02 (stage 2 + the entry points and the prefix cache), as
    docs/lessons/README.md runs it."""
    # as docs/stage3.md says
    r = subprocess.run([sys.executable, "course/series.py", "packages", str(tmp_path / "rungs")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    turns, seconds = chat_twice(
        "rung02.chat", tiny, {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path / 'rungs'}"}
    )
    (p1, c1, g1), (p2, c2, g2) = turns
    assert c1 is None and c2 is not None and p1 // 4 * 4 <= c2 < p2, turns
    # the work is bounded, so it takes seconds on any machine (how many: a busy one decides)
    assert g1 == g2 == 6, turns
