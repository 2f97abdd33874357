"""Stage 1 runs on every CPU numba supports: the entry points, compiled from cold for a
generic x86-64 target (NUMBA_CPU_NAME=generic: SSE2 only, no AVX2, no AVX-512), as
on an old or unusual machine, and the answers equal transformers'.

Any x86 host reproduces the crash of a kernel that names an instruction its target
lacks ("LLVM ERROR: Cannot select ... VPDPWSSD"): LLVM aborts the whole process. So
each check is a subprocess with a fresh numba cache (no machine code from a native
run), and must exit 0 with the right tokens. On ARM64 hosts the same runs compile
for the host's own generic target.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench.testbed.models import hf_greedy, make_model

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox jumps over the lazy dog because"
STEPS = 12

pytestmark = pytest.mark.timeout(1500)          # cold numba compiles in every subprocess


@pytest.fixture(scope="module")
def generic_env():
    """A fresh numba cache shared by this module's subprocesses (the first one compiles)."""
    cache = tempfile.mkdtemp(prefix="qs-numba-generic-")
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    env.pop("NUMBA_CPU_FEATURES", None)
    yield env


def run(
    args: list[str], env: dict, stdin: str | None = None, timeout: float = 1200
) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, input=stdin,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (
        f"exit {out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    )
    assert "LLVM ERROR" not in out.stderr
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("quant", ["none", "int8"])
def test_generate_on_a_generic_cpu_gives_transformers_greedy_tokens(generic_env, family, quant):
    folder = make_model(family, tokenizer=True)
    out = run(["-m", "stage1_cpu.generate", "--model", str(folder), "--raw", "--prompt", PROMPT,
               "--temperature", "0", "--ignore-eos", "--max-tokens", str(STEPS), "--quant", quant,
               "--activations", "fp32"], generic_env)
    # the banner names what ran: the fast path's one-region step without any dot-product instruction
    assert "no int8 dot instruction" in out.stderr, out.stderr[-2000:]
    from common.tokenizer import Tokenizer
    tok = Tokenizer(folder)
    ref_ids = hf_greedy(folder, tok.encode(PROMPT), STEPS)
    assert len(set(ref_ids)) > 3, "the reference must vary for the comparison to mean anything"
    if quant == "none":                     # fp32: exactly transformers' greedy continuation
        assert out.stdout.strip() == tok.decode(ref_ids).strip()
    else:                                   # int8: the engine's own output, non-empty and sane
        assert len(out.stdout.strip()) > 0


def test_plain_kernels_on_a_generic_cpu_equal_transformers(generic_env):
    folder = make_model("qwen3", tokenizer=True)
    out = run(["-m", "stage1_cpu.generate", "--model", str(folder), "--raw", "--prompt", PROMPT,
               "--temperature", "0", "--ignore-eos", "--max-tokens", str(STEPS),
               "--kernels", "plain"], generic_env)
    assert "plain kernels" in out.stderr
    from common.tokenizer import Tokenizer
    tok = Tokenizer(folder)
    assert out.stdout.strip() == tok.decode(hf_greedy(folder, tok.encode(PROMPT), STEPS)).strip()


def test_two_turn_chat_on_the_default_model_on_a_generic_cpu(generic_env):
    """The README's first command, on a CPU with none of the fast instructions: two
    turns, greedy, then end of input leaves with 0."""
    from common.models import resolve_model
    resolve_model(None, progress=False)          # fetched and converted once, into the user cache
    out = run(["-m", "stage1_cpu.chat", "--temperature", "0", "--max-tokens", "24"], generic_env,
              stdin="What is the capital of France?\nRepeat the city you just named.\n")
    answers = [a for a in out.stdout.splitlines() if a.strip()]
    assert "Paris" in answers[0], out.stdout
    assert any("Paris" in a for a in answers[1:]), out.stdout


def test_windows_runs_the_plain_kernels(monkeypatch):
    """The one-region step naps with the C library's usleep (fast/sync.py), which Windows lacks:
    where os.name is not "posix", --kernels auto takes the core's kernels and --kernels fast
    says why."""
    from types import SimpleNamespace

    from stage1_cpu import fast
    from stage1_cpu.weights import choose_kernels
    # here, on POSIX: the fast path
    assert choose_kernels("auto", "auto", "int8") is not None
    monkeypatch.setattr(fast, "os", SimpleNamespace(name="nt"))
    assert choose_kernels("auto", "auto", "int8") is None
    with pytest.raises(ValueError, match="usleep"):
        choose_kernels("fast", "auto", "int8")
