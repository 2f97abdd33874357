"""The terminal chat (common/chat.py + stage1_cpu/chat.py), driven the way people use it.

  * in a pseudo-terminal (pexpect) with the real default model: a question, a
    follow-up that only makes sense with turn 1, /reset, /think off, Ctrl-C in the
    middle of a long answer, /exit;
  * with piped input on a tiny random Qwen3 folder and the real Qwen3 tokenizer:
    every prompt the engine receives is exactly what transformers'
    apply_chat_template renders (thinking on and off), token for token;
  * in-process with the stage-1 engine on the tiny model: Ctrl-C keeps the partial
    answer in the conversation, a full context says /reset instead of crashing.
"""
from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.testbed.models import make_model

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT), TERM="xterm-256color",
           COLUMNS="200", LINES="50")
PROMPT = "> "                                   # the chat's input prompt (colour codes around it)
# a cold start compiles stage 1's kernels before the banner ("compiling kernels, first run only"):
# minutes on a busy 2-core machine, once per source version
COLD = 900
CURSOR_SHOWN = r"\x1b\[\?25h"                   # rich shows the cursor again when the spinner stops
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def qwen3_folder() -> Path:
    """A tiny random Qwen3 with the real Qwen3 tokenizer and chat template."""
    return make_model("qwen3", tokenizer=True)


@pytest.fixture(scope="module")
def default_model() -> Path:
    """The default model, fetched and converted once into the user cache (the chat
    process started below then finds it there, as a second run would)."""
    from common.models import resolve_model
    return resolve_model(None, progress=False)


def spawn_chat(args: list[str], timeout: float = 120, preexec_fn=None):
    import pexpect
    child = pexpect.spawn(sys.executable, ["-m", "stage1_cpu.chat", *args], cwd=str(ROOT), env=ENV,
                          encoding="utf-8", timeout=timeout, dimensions=(50, 200),
                          preexec_fn=preexec_fn)
    child.logfile_read = io.StringIO()     # the whole session, for the failure message
    return child


def screen(child) -> str:
    return ANSI.sub("", child.logfile_read.getvalue())


# ------------------------------------------------------------------ a person at a terminal

def test_terminal_chat_default_model_multi_turn_reset_think_ctrl_c_exit(default_model):
    pexpect = pytest.importorskip("pexpect")
    child = spawn_chat(["--quant", "int8", "--temperature", "0", "--max-tokens", "200"])
    try:
        child.expect("Ctrl-D to leave", timeout=COLD)
        child.expect_exact(PROMPT, timeout=COLD)

        # turn 1: the answer streams, then the stats line, then a new prompt
        child.sendline("What is the capital of France?")
        child.expect("Paris")
        child.expect(
            r"(\d+) prompt tokens · (\d+) generated · prefill [\d.]+ tok/s .* decode [\d.]+ tok/s"
        )
        first_prompt = int(child.match.group(1))
        child.expect_exact(PROMPT)

        # turn 2 needs turn 1 ("the city you just named"); only the new turn is prefilled
        child.sendline("Repeat the city you just named.")
        child.expect("Paris")
        child.expect(r"(\d+) prompt tokens \((\d+) cached\) · (\d+) generated")
        prompt2, cached2 = int(child.match.group(1)), int(child.match.group(2))
        assert first_prompt < cached2 < prompt2, (
            "turn 2 should re-use turn 1's prompt and answer from the KV cache"
        )
        child.expect_exact(PROMPT)

        # /reset forgets turn 1: the same follow-up no longer knows the city
        child.sendline("/reset")
        child.expect("Conversation cleared")
        child.expect_exact(PROMPT)
        child.sendline("Repeat the city you just named.")
        child.expect_exact("Repeat the city you just named.")        # the terminal's echo
        # no "(… cached)": a fresh conversation
        child.expect(r"(\d+) prompt tokens · (\d+) generated")
        assert "Paris" not in child.before
        assert int(child.match.group(1)) < prompt2
        child.expect_exact(PROMPT)

        child.sendline("/think off")
        child.expect("Thinking off")
        child.expect_exact(PROMPT)

        # Ctrl-C once the answer has started streaming: it stops, the chat stays
        child.sendline("Write a long story about a dragon.")
        child.expect_exact("Write a long story about a dragon.")
        child.expect(CURSOR_SHOWN)           # the prefill spinner is gone: tokens are streaming
        child.sendintr()                     # at once: a fast CPU writes 200 tokens in a second
        child.expect(r"(\d+) generated · .*stopped")
        assert 1 <= int(child.match.group(1)) < 200
        child.expect_exact(PROMPT)

        child.sendline("/exit")
        child.expect(pexpect.EOF)
    except (pexpect.TIMEOUT, pexpect.EOF, AssertionError) as e:
        raise AssertionError(
            f"{type(e).__name__}; the terminal showed:\n{screen(child)[-4000:]}"
        ) from None
    finally:
        child.close()
    assert child.exitstatus == 0, screen(child)[-2000:]


@pytest.mark.parametrize("key", ["ctrl-d", "ctrl-c"])
def test_ctrl_d_or_ctrl_c_at_empty_prompt_leaves_with_exit_code_0(qwen3_folder, key):
    pexpect = pytest.importorskip("pexpect")
    # started with SIGINT ignored, as a shell's background job or a CI runner may start the tests
    # (children inherit it): the chat must still get each Ctrl-C
    child = spawn_chat(["--model", str(qwen3_folder)], timeout=90,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        child.expect("Ctrl-D to leave", timeout=COLD)
        child.expect_exact(PROMPT, timeout=COLD)
        if key == "ctrl-d":
            child.sendeof()
        else:
            child.send("half a line")      # Ctrl-C on a typed line only clears it ...
            child.expect_exact("half a line", timeout=COLD)   # echoed: the line editor has it
            time.sleep(0.3)
            child.sendintr()
            child.expect_exact(PROMPT, timeout=20)
            time.sleep(0.5)
            child.sendintr()               # ... on an empty prompt it leaves
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, screen(child)
    assert "Traceback" not in screen(child)


# ------------------------------------------------------------------ piped input, exact prompts

def test_piped_prompts_are_exactly_the_qwen3_template_rendering_thinking_on_and_off(qwen3_folder):
    from transformers import AutoTokenizer

    lines = ["Hello, who are you?", "/think off", "What is 2+2?", "/think on", "Thanks!"]
    run = subprocess.run(
        [sys.executable, "-m", "stage1_cpu.chat", "--model", str(qwen3_folder),
         "--temperature", "0", "--max-tokens", "6", "--system", "You are terse.", "--show-prompt"],
        input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=COLD, env=ENV,
        cwd=ROOT)
    assert run.returncode == 0, run.stderr
    records = [json.loads(line[len("[prompt] "):]) for line in run.stderr.splitlines()
               if line.startswith("[prompt] ")]
    assert [r["enable_thinking"] for r in records] == [True, False, True]

    # the oracle: transformers renders the same messages with the folder's template
    hf = AutoTokenizer.from_pretrained(qwen3_folder)
    for r in records:
        expected = hf.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True,
                                          enable_thinking=r["enable_thinking"])
        assert r["prompt"] == expected
        assert r["prompt_ids"] == hf(expected, add_special_tokens=False)["input_ids"]

    # the conversation is the system message, the typed lines, and the model's answers
    final = records[-1]["messages"]
    assert [m["role"] for m in final] == ["system", "user", "assistant", "user", "assistant",
                                          "user"]
    assert final[0]["content"] == "You are terse."
    assert [m["content"] for m in final if m["role"] == "user"] == ["Hello, who are you?",
                                                                    "What is 2+2?", "Thanks!"]
    assert all(m["content"] for m in final if m["role"] == "assistant")
    # the answer is kept as the model wrote it: turn 2's prompt extends turn 1's prompt + answer ...
    assert records[1]["prompt_ids"][:len(records[0]["prompt_ids"])] == records[0]["prompt_ids"]
    # ... so the engine re-uses its KV cache for all of it
    stats = [line for line in run.stderr.splitlines() if "prompt tokens" in line]
    assert len(stats) == 3 and "cached" not in stats[0] and "cached" in stats[1]
    # thinking off: Qwen3's template writes an empty think block for the model; on: it does not
    assert records[1]["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert records[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert records[2]["prompt"].endswith("<|im_start|>assistant\n")
    # piped: plain text only, one answer per message
    assert "\x1b[" not in run.stdout and not run.stdout[:1].isspace()
    assert len(run.stdout.strip()) > 0


# ------------------------------------------------------------------ in-process: abort, full context

@pytest.fixture(scope="module")
def tiny_chat_parts(qwen3_folder):
    from common.chat_template import ChatTemplate
    from common.tokenizer import Tokenizer
    return Tokenizer(qwen3_folder), ChatTemplate.from_folder(qwen3_folder)


def stage1_engine(folder, max_ctx):
    from stage1_cpu.engine import LLMEngine
    return LLMEngine(folder, max_ctx=max_ctx, progress=False, use_numba=False)


def test_ctrl_c_mid_answer_aborts_and_keeps_the_partial_answer(
    qwen3_folder, tiny_chat_parts, capsys
):
    from common.chat import run_chat
    from common.sampling import SamplingParams

    tokenizer, template = tiny_chat_parts
    engine = stage1_engine(qwen3_folder, 512)
    produced: list[int] = []
    real_step = engine.step

    def step():
        # a person pressing Ctrl-C after the third token of the first answer
        events = real_step()
        produced.extend(e.token_id for e in events if e.request_id == "chat-1" and e.token_id >= 0)
        if (
            len(produced) == 3
            and events
            and events[0].request_id == "chat-1"
            and events[0].finish_reason is None
        ):
            os.kill(os.getpid(), signal.SIGINT)
        return events

    engine.step = step
    prompts = []
    real_add = engine.add_request
    engine.add_request = lambda req: (prompts.append(req.prompt_ids), real_add(req))[1]
    # random weights: never stop on their own
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    code = run_chat(engine, tokenizer, template, params, max_tokens=50, lines=["first", "second"])
    assert code == 0
    stats = [line for line in capsys.readouterr().err.splitlines() if "prompt tokens" in line]
    assert "3 generated" in stats[0] and "stopped" in stats[0]
    assert "stopped" not in stats[1]
    assert len(produced) == 3                          # the signal stopped it: 3 of 50 tokens
    # turn 2's prompt holds turn 1's partial answer exactly as it was produced
    partial = tokenizer.decode(produced)
    expected = template.render([{"role": "user", "content": "first"},
                                {"role": "assistant", "content": partial},
                                {"role": "user", "content": "second"}])
    assert prompts[1] == tokenizer.encode(expected)
    assert engine.last_prefill_tokens < len(prompts[1])   # and the aborted turn's cache was re-used


def test_banner_says_how_idle_threads_wait_and_who_chose_it(tmp_path):
    """Piped, the chat logs its banner on stderr: with no OMP_WAIT_POLICY set it names the engine's
    choice and its reason (tests/test_wait_policy.py: libgomp reads that choice); with one set,
    the user's."""
    import stage1_cpu
    from common.tiny_model import write_tiny_model
    if importlib.util.find_spec("numba.np.ufunc.omppool") is None:
        pytest.skip("numba has no omp layer here (macOS wheels)")
    folder = write_tiny_model(tmp_path / "tiny")
    how = {"PASSIVE": "sleep", "ACTIVE": "spin"}
    clean = {k: v for k, v in ENV.items() if k != "OMP_WAIT_POLICY"}
    for env, said in ((clean, f"{stage1_cpu.WAIT_POLICY}, chosen: {stage1_cpu.WAIT_WHY}"),
                      (dict(clean, OMP_WAIT_POLICY="ACTIVE"), "ACTIVE, as you set")):
        cmd = [sys.executable, "-m", "stage1_cpu.chat", "--model", str(folder), "--kernels",
               "plain"]
        run = subprocess.run(cmd, input="", capture_output=True, text=True, timeout=COLD, cwd=ROOT,
                             env=dict(env, NUMBA_THREADING_LAYER="omp"))
        assert run.returncode == 0, run.stderr
        banner = next(line for line in run.stderr.splitlines() if line.startswith("loaded "))
        policy = said.split(",")[0]
        assert f" · omp threads {how[policy]} when idle ({said}) in " in banner, banner


def test_full_context_says_reset_instead_of_crashing(qwen3_folder, tiny_chat_parts, capsys):
    from common.chat import run_chat
    from common.sampling import SamplingParams

    tokenizer, template = tiny_chat_parts
    engine = stage1_engine(qwen3_folder, 40)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    # turn 1 (9 prompt tokens) fills the context; turn 2 no longer fits; /reset; turn 3 fits again
    code = run_chat(
        engine, tokenizer, template, params, lines=["hi", "and now?", "/reset", "hello"]
    )
    assert code == 0
    out = capsys.readouterr()
    assert "The context is full (40 of 40 tokens)" in out.err
    assert "the context holds 40: type /reset" in out.err
    assert "Conversation cleared" in out.err
    stats = [line for line in out.err.splitlines() if "prompt tokens" in line]
    assert len(stats) == 2 and all("31 generated" in s for s in stats)
    assert len(out.out.strip().splitlines()) >= 2


class ScriptedEngine:
    """An Engine that answers every request with the same token ids (a model that
    thinks, then answers): checks how the chat shows and keeps thinking."""

    def __init__(self, answer_ids: list[int], max_ctx: int = 4096):
        self.answer_ids, self.max_ctx = answer_ids, max_ctx
        self.prompts: list[list[int]] = []
        self.queue: list = []

    def add_request(self, req):
        self.prompts.append(req.prompt_ids)
        self.queue.append([req.id, 0])

    def abort(self, request_id):
        pass

    def has_work(self):
        return bool(self.queue)

    def step(self):
        from common.engine import TokenEvent
        rid, i = self.queue[0]
        self.queue[0][1] += 1
        last = i + 1 == len(self.answer_ids)
        if last:
            self.queue.pop(0)
        return [TokenEvent(rid, self.answer_ids[i], "stop" if last else None)]


def test_thinking_is_shown_with_think_on_hidden_with_off_and_kept_raw(tiny_chat_parts, capsys):
    from common.chat import run_chat

    tokenizer, template = tiny_chat_parts
    raw = "<think>\nThe capital of France is Paris.\n</think>\n\nParis."
    engine = ScriptedEngine(tokenizer.encode(raw) + [tokenizer.token_to_id("<|im_end|>")])
    assert (
        run_chat(engine, tokenizer, template, lines=["Capital of France?", "/think off", "Again?"])
        == 0
    )
    answers = capsys.readouterr().out
    # think on: the reasoning is printed (marked as such); think off: only the answer
    assert answers == ("<think>\nThe capital of France is Paris.\n</think>\n\nParis.\n"
                       "Paris.\n")
    # the answer went back into the conversation as the model wrote it (the template
    # itself drops old thinking), and the second prompt has thinking off
    expected = template.render([{"role": "user", "content": "Capital of France?"},
                                {"role": "assistant", "content": raw},
                                {"role": "user", "content": "Again?"}], enable_thinking=False)
    assert engine.prompts[1] == tokenizer.encode(expected)
    prompt2 = tokenizer.decode(engine.prompts[1])
    # old thinking dropped by the template
    assert "The capital of France is Paris." not in prompt2
    assert prompt2.count("<think>") == 1 and prompt2.endswith("<think>\n\n</think>\n\n")


def test_a_message_of_several_lines_between_triple_quotes_or_backslashes():
    """A code block pasted whole is one message: from a line that starts with three double quotes
    to the line that ends with them; a line ending in a backslash goes on with the next."""
    from common.chat import messages
    lines = ['hi', '"""Rename result to total:', 'def f(p):', '    result = 0', '    return result',
             '"""', 'one \\', 'two', '"""', 'x', '"""', '"""single"""', 'end']
    assert list(messages(lines)) == ['hi',
                                     'Rename result to total:\ndef f(p):\n    result = 0\n'
                                     '    return result',
                                     'one \ntwo', 'x', 'single', 'end']
    # the input ended first
    assert list(messages(['"""never closed', 'a'])) == ['never closed\na']
