"""The terminal chat: a conversation in text on one side, any Engine on the other.

This is the outer layer at work. Each turn:

  1. append the user's message to the conversation (a list of {role, content}),
  2. render the *whole* conversation with the model's chat template and tokenize it,
  3. send Request(id, prompt_ids, params) to the engine and call engine.step()
     until the request finishes,
  4. stream each token's text as it arrives: token ids -> IncrementalDetokenizer
     (never half a UTF-8 character) -> StreamParser (splits <think>...</think>
     reasoning from the answer),
  5. keep the answer in the conversation *as the text the model produced*.

Step 2 re-sends the whole conversation every turn, and yet only the new turn is
prefilled: the stage-1 engine keeps the KV cache of the previous request and
re-uses the longest common prefix of token ids. That only works if turn N's
prompt starts with the exact tokens of turn N-1's prompt + answer, which is why
step 5 stores the raw output (thinking included; the Qwen3 template itself drops
old thinking from the history).

A stage's chat is a few lines: build its engine and call main(), e.g.
stage1_cpu/chat.py. With stdin piped (no terminal) the chat reads one message per
line and prints answers plainly, so it can be scripted:

    printf 'What is the capital of France?\\n' | python -m stage1_cpu.chat --temperature 0
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from common.chat_template import ChatTemplate
from common.engine import Request, TokenEvent
from common.models import resolve_model
from common.parsing import StreamParser, prompt_opens_think
from common.sampling import SamplingParams, generation_defaults
from common.stopping import AnswerText
from common.tokenizer import Tokenizer

HELP = """\
Type a message and press Enter; for several lines (code, a quote), start with \"\"\" and end
with \"\"\", or end each line but the last with a backslash. Commands:
  /think on|off   show (on) or hide (off) the model's thinking; on a Qwen3 template
                  it also switches the template's enable_thinking
  /reset          start a new conversation (forgets the history and the KV cache)
  /help           this help
  /exit, /quit    leave (Ctrl-D, or Ctrl-C at an empty prompt, too)
Ctrl-C while the model answers stops the answer; what it wrote so far stays in
the conversation."""

# env var equivalent of --show-prompt (debugging a chat template)
SHOW_PROMPT_ENV = "QWEN3_STAGES_SHOW_PROMPT"
BANNER_WIDTH = 80       # a terminal's classic width: no line of the banner is longer


# --------------------------------------------------------------------------- stats

@dataclass
class TurnStats:
    prompt_tokens: int           # tokens in the rendered conversation sent to the engine
    cached_tokens: int | None    # of those, how many the engine re-used from its cache (None: not reported)
    generated_tokens: int        # tokens the engine produced (the end-of-turn token included)
    ttft: float                  # seconds from add_request to the first token: the prefill
    decode_time: float           # seconds from the first token to the last
    finish_reason: str           # "stop" | "length" | "abort" | "error"
    speculation: str | None = None   # speculative decoding: "2.6 tokens/step, 61 % of drafts accepted"

    def line(self) -> str:
        """One line for after the answer: sizes, then prefill and decode speed."""
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        parts = [f"{self.prompt_tokens} prompt tokens{cached}", f"{self.generated_tokens} generated"]
        if self.generated_tokens:
            # prefill speed counts only the tokens actually computed (not the cached prefix)
            new = self.prompt_tokens - (self.cached_tokens or 0)
            parts.append(f"prefill {new / max(self.ttft, 1e-9):.1f} tok/s ({self.ttft:.2f} s to first token)")
        if self.generated_tokens > 1:
            # the first token came out of the prefill step; decode made the other n-1
            parts.append(f"decode {(self.generated_tokens - 1) / max(self.decode_time, 1e-9):.1f} tok/s")
        if self.speculation:
            parts.append(self.speculation)
        if self.finish_reason != "stop":
            reasons = {"abort": "stopped", "length": "cut at the token limit",
                       "error": "ended by an engine error (its logits were not finite)"}
            parts.append(reasons.get(self.finish_reason, self.finish_reason))
        return " · ".join(parts)


def _cached_tokens(engine, prompt_tokens: int, request_id: str) -> int | None:
    """How many prompt tokens the engine took from its cache for this request, if it says:
    an engine with a prefix cache counts them (stage 3 and every rung from lesson 01 on:
    `num_cached_tokens(request_id)`); stage 1 reports the tokens it prefilled
    (`last_prefill_tokens`), and the rest were in its cache."""
    if callable(getattr(engine, "num_cached_tokens", None)):
        return engine.num_cached_tokens(request_id)
    computed = getattr(engine, "last_prefill_tokens", None)
    return max(prompt_tokens - computed, 0) if isinstance(computed, int) else None


# --------------------------------------------------------------------------- output

class PlainUI:
    """No terminal: answers go to stdout as plain text (one answer, then a newline),
    everything else (notices, stats) to stderr, so `... | chat > answers.txt` works."""

    def __init__(self, out=None, err=None):
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self._kind = None        # the section being printed: None, "reasoning" or "content"

    def notice(self, text: str):
        print(text, file=self.err, flush=True)

    def error(self, text: str):
        print(f"error: {text}", file=self.err, flush=True)

    def banner(self, text: str):
        self.notice(text)

    def begin_answer(self):
        self._kind = None

    def waiting(self, text: str):
        pass

    def reasoning(self, text: str):
        if self._kind != "reasoning":
            self.out.write("<think>\n")
            self._kind = "reasoning"
        self.out.write(text)
        self.out.flush()

    def content(self, text: str):
        if self._kind == "reasoning":
            self.out.write("\n</think>\n\n")
        self._kind = "content"
        self.out.write(text)
        self.out.flush()

    def end_answer(self, stats: TurnStats | None, note: str | None = None):
        if self._kind == "reasoning":
            self.out.write("\n</think>")
        self.out.write("\n")
        self.out.flush()
        if note:
            self.notice(note)
        if stats is not None:
            self.notice(f"[{stats.line()}]")


class RichUI:
    """A terminal: a spinner while the prompt is read (prefill) or while hidden
    thinking runs, the answer streamed token by token, thinking dimmed, then a stats line."""

    def __init__(self, console=None):
        from rich.console import Console
        self.console = console or Console(highlight=False)
        self._status = None
        self._kind = None

    def notice(self, text: str):
        self.console.print(text, style="dim", markup=False, highlight=False)

    def error(self, text: str):
        self.console.print(text, style="bold red", markup=False, highlight=False)

    def banner(self, text: str):
        self.console.print(text, style="bold", markup=False, highlight=False)

    def begin_answer(self):
        self._kind = None

    def waiting(self, text: str):
        """Show (or update) the spinner; it disappears when text starts to stream."""
        if self._status is None:
            self._status = self.console.status(text, spinner="dots")
            self._status.start()
        else:
            self._status.update(text)

    def _stop_waiting(self):
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _write(self, text: str, style: str | None):
        # soft_wrap: the terminal wraps long lines; rich must not insert newlines
        # into a piece it cannot see the line of
        self.console.print(text, end="", style=style, markup=False, highlight=False, soft_wrap=True)

    def reasoning(self, text: str):
        self._stop_waiting()
        self._kind = "reasoning"
        self._write(text, "dim italic")

    def content(self, text: str):
        self._stop_waiting()
        if self._kind == "reasoning":
            self._write("\n\n", None)
        self._kind = "content"
        self._write(text, None)

    def end_answer(self, stats: TurnStats | None, note: str | None = None):
        self._stop_waiting()
        if self._kind is not None:
            self._write("\n", None)
        if note:
            self.console.print(note, style="yellow", markup=False, highlight=False)
        if stats is not None:       # broken between its parts where the terminal is narrower
            text = "\n".join(fit_lines(stats.line().split(" · "), self.console.width))
            self.console.print(text, style="dim cyan", markup=False, highlight=False)
        self.console.print()


# --------------------------------------------------------------------------- Ctrl-C

class _CtrlC:
    """While generating, Ctrl-C only raises a flag; the step loop sees it between
    two engine steps and aborts the request. (A KeyboardInterrupt raised in the
    middle of a step could leave the engine's KV cache half updated.)"""

    def __init__(self):
        self.hit = False
        self._old = None

    def _handler(self, signum, frame):
        self.hit = True

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGINT, self._handler)
        except ValueError:      # not the main thread (e.g. a test driving run_chat): no handler
            self._old = None
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


# --------------------------------------------------------------------------- the conversation

class Chat:
    """A conversation with one engine: the messages, the /commands, one answer per turn."""

    def __init__(self, engine, tokenizer, template, params: SamplingParams, ui,
                 system: str | None = None, thinking: bool = True, show_prompt: bool = False,
                 max_tokens: int | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.params = params            # sampling for every answer (max_tokens is set per turn)
        self.max_tokens = max_tokens    # cap per answer; None = until the context is full
        self.ui = ui
        self.system = system
        self.thinking = thinking        # /think: show thinking, and (Qwen3) enable_thinking in the template
        self.show_prompt = show_prompt
        self.messages: list[dict] = []
        self._ids = itertools.count(1)
        self.reset(clear_engine=False)

    # ---- commands -----------------------------------------------------------
    def reset(self, clear_engine: bool = True):
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        if clear_engine and hasattr(self.engine, "reset"):
            self.engine.reset()     # drop the KV cache too: nothing of the old conversation remains

    def handle(self, line: str) -> bool:
        """One line from the user: a /command or a message. False = leave the chat."""
        text = line.strip()
        if not text:
            return True
        if not text.startswith("/"):
            self.ask(text)
            return True
        cmd, _, arg = text.partition(" ")
        cmd, arg = cmd.lower(), arg.strip().lower()
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/reset":
            self.reset()
            self.ui.notice("Conversation cleared.")
        elif cmd == "/think":
            if arg in ("on", "off"):
                self.thinking = arg == "on"
            elif arg:
                self.ui.error("usage: /think on|off")
                return True
            state = "on" if self.thinking else "off"
            how = ("the template's enable_thinking follows it" if self.template.has_thinking
                   else "this model's template has no thinking switch; <think> text is shown or hidden")
            self.ui.notice(f"Thinking {state} ({how}).")
        elif cmd == "/help":
            self.ui.notice(HELP)
        else:
            self.ui.error(f"unknown command {cmd}; type /help for the list")
        return True

    # ---- one turn -----------------------------------------------------------
    def render(self) -> str:
        return self.template.render(self.messages, add_generation_prompt=True, enable_thinking=self.thinking)

    def ask(self, text: str) -> TurnStats | None:
        """Send one user message; stream the answer; keep it in the conversation."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.render()
        prompt_ids = self.tokenizer.encode(prompt)
        if self.show_prompt:
            # the exact text and ids the engine gets (for checking a chat template)
            record = {"messages": self.messages, "enable_thinking": self.thinking,
                      "prompt": prompt, "prompt_ids": prompt_ids}
            print("[prompt] " + json.dumps(record, ensure_ascii=False), file=sys.stderr, flush=True)

        # the context holds prompt + answer: with no room for an answer, say so
        room = self.engine.max_ctx - len(prompt_ids)
        if room < 1:
            self.messages.pop()
            self.ui.error(f"The conversation is {len(prompt_ids)} tokens, the context holds "
                          f"{self.engine.max_ctx}: type /reset to start a new conversation "
                          "(or restart with a larger --max-ctx).")
            return None
        max_tokens = room if self.max_tokens is None else min(self.max_tokens, room)
        params = replace(self.params, max_tokens=max_tokens)
        req = Request(id=f"chat-{next(self._ids)}", prompt_ids=prompt_ids, params=params)
        try:
            self.engine.add_request(req)
        except ValueError as e:      # the engine's own message says what to do
            self.messages.pop()
            self.ui.error(f"{e}; type /reset to start a new conversation")
            return None

        answer, stats = self._stream(req, prompt)
        if answer:
            self.messages.append({"role": "assistant", "content": answer})
        else:
            # nothing came out (stopped during the prefill): forget the question too
            self.messages.pop()
        return stats

    def _stream(self, req: Request, prompt: str) -> tuple[str, TurnStats]:
        """Drive the engine until `req` finishes, showing text as it comes."""
        ui = self.ui
        answer = AnswerText(self.tokenizer.detokenizer())   # events -> text, end-of-turn ids left out
        # the parser always recognises <think>; /think decides whether it is shown
        parser = StreamParser(thinking=True, tools=False, start_in_reasoning=prompt_opens_think(prompt))
        n_reasoning, t_first = 0, None

        def show(deltas):
            nonlocal n_reasoning
            for d in deltas:
                if d.kind == "reasoning":
                    if self.thinking:
                        ui.reasoning(d.text)
                    else:
                        n_reasoning += 1
                        ui.waiting(f"thinking (hidden, /think on shows it) · {answer.n_tokens} tokens")
                elif d.kind == "content":
                    ui.content(d.text)

        ui.begin_answer()
        ui.waiting(f"reading the prompt ({len(req.prompt_ids)} tokens)")
        t0 = time.perf_counter()
        with _CtrlC() as ctrl_c:
            aborted = False
            while not answer.done:
                if ctrl_c.hit and not aborted:
                    self.engine.abort(req.id)    # the next step reports it with finish_reason "abort"
                    aborted = True
                if not self.engine.has_work():   # it ended without an event: the same as one
                    show(parser.feed(answer.feed(TokenEvent(req.id, -1, "abort" if aborted else "stop"))))
                    break
                for ev in self.engine.step():
                    if ev.request_id == req.id:
                        if ev.token_id >= 0 and t_first is None:
                            t_first = time.perf_counter()
                        show(parser.feed(answer.feed(ev)))
        t_end = time.perf_counter()
        show(parser.finish())
        finish, n_generated = answer.finish_reason, answer.n_tokens

        t_first = t_first or t_end
        n_prompt = len(req.prompt_ids)
        spec = getattr(self.engine, "last_speculation", None)      # an engine with speculative decoding
        stats = TurnStats(prompt_tokens=n_prompt, cached_tokens=_cached_tokens(self.engine, n_prompt, req.id),
                          generated_tokens=n_generated, ttft=t_first - t0, decode_time=t_end - t_first,
                          finish_reason=finish, speculation=spec.line() if spec else None)
        note = None
        used = n_prompt + n_generated
        if finish == "length" and used >= self.engine.max_ctx:
            note = (f"The context is full ({used} of {self.engine.max_ctx} tokens): "
                    "type /reset to start a new conversation.")
        elif n_reasoning and not self.thinking and not answer.text.strip():
            note = "(the answer was all thinking; /think on shows it)"
        ui.end_answer(stats, note)
        return answer.text, stats


# --------------------------------------------------------------------------- input

PROMPT_TTY = "\001\033[1;32m\002> \001\033[0m\002"   # \001..\002 tell readline the colour codes take no room


def _read_tty() -> Iterator[str]:
    """Lines typed at a terminal, with readline editing and history; ends on
    Ctrl-D, or on Ctrl-C at an empty prompt (Ctrl-C on a half-typed line clears it)."""
    try:
        import readline
    except ImportError:     # Windows: plain input()
        readline = None
    while True:
        try:
            line = input(PROMPT_TTY)
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            typed = readline.get_line_buffer() if readline is not None else ""
            print()
            if typed.strip():
                continue
            return
        yield line


def _read_plain(stream) -> Iterator[str]:
    """One message per line (piped input)."""
    for line in stream:
        yield line.rstrip("\r\n")


FENCE = '"""'


def messages(lines: Iterator[str]) -> Iterator[str]:
    """Lines -> messages: a line is a message, but a message that starts with three double
    quotes runs to the line that ends with them (a code block pasted whole), and a line that
    ends with a backslash goes on with the next (the backslash left out)."""
    lines = iter(lines)
    for line in lines:
        if line.startswith(FENCE):
            body = [line[len(FENCE):]]
            while not body[-1].endswith(FENCE) or len(body) == 1 and body[0] == "":
                body.append(next(lines, FENCE))
            body[-1] = body[-1][:-len(FENCE)]
            yield "\n".join(body).strip("\n")
            continue
        while line.endswith("\\"):
            line = line[:-1] + "\n" + next(lines, "")
        yield line


# --------------------------------------------------------------------------- entry points

def run_chat(engine, tokenizer, template, params: SamplingParams | None = None, *,
             system: str | None = None, thinking: bool = True, show_prompt: bool = False,
             max_tokens: int | None = None, plain: bool | None = None, lines=None,
             console=None, banner: str | None = None) -> int:
    """Chat until /exit, Ctrl-D or the end of the input. Returns the exit code (0).

    plain: None = decide from stdin (a terminal gets the rich UI, a pipe plain text).
    lines: an iterable of input lines instead of stdin (plain mode).
    """
    if plain is None:
        plain = lines is not None or not sys.stdin.isatty()
    ui = PlainUI() if plain else RichUI(console)
    chat = Chat(engine, tokenizer, template, params or SamplingParams(), ui, system=system,
                thinking=thinking, show_prompt=show_prompt, max_tokens=max_tokens)
    if banner and not plain:
        ui.banner("\n".join(fit_lines(banner.split(" · "))))
        sampling = f"Sampling: {describe_sampling(chat.params)}" + (
            f"; answers of at most {max_tokens} tokens." if max_tokens else ".")
        ui.notice("\n".join(fit_lines([sampling, "/help for commands, Ctrl-D to leave."], sep=" ")))
    source = messages(_read_plain(lines if lines is not None else sys.stdin) if plain else _read_tty())
    for line in source:
        if not chat.handle(line):
            break
    return 0


def _warm_up(engine, console, interactive: bool) -> None:
    """A cold start compiles the engine's kernels (stage 1: numba) before the first token:
    do it now, saying so, instead of as a long silent wait after the first question."""
    if not hasattr(engine, "warm_up") or not engine.kernels_cold():
        return
    note = "compiling kernels, first run only …"
    if interactive and hasattr(console, "_live_stack"):
        with console.status(note, spinner="dots"):
            took = engine.warm_up()
    else:
        console.print(note, style="dim", markup=False, highlight=False) if interactive else None
        took = engine.warm_up()
    if took is not None:
        console.print(f"compiled kernels in {took:.1f} s (cached for the next runs)",
                      style="dim", markup=False, highlight=False)


def fit_lines(parts: list[str], width: int = BANNER_WIDTH, sep: str = " · ") -> list[str]:
    """Parts joined by `sep` into lines of at most `width` characters, a new line where the
    next part would pass it (a part longer than the width gets a line of its own): a terminal
    then never breaks a line in the middle of a part."""
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + len(sep) + len(part) <= width:
            lines[-1] += sep + part
        else:
            lines.append(part)
    return lines


def answer_limit(folder: Path | None, args: argparse.Namespace) -> int | None:
    """Tokens per answer at most: --max-tokens, else the model's generation_config.json
    max_new_tokens (common/tiny_model.py writes one: random weights rarely draw the end-of-turn
    token), else None: until the end-of-turn token or a full context, as llama.cpp's and
    ollama's chats do."""
    if args.max_tokens is not None:
        return args.max_tokens
    return generation_defaults(folder).get("max_tokens")


def describe_sampling(p: SamplingParams) -> str:
    """The sampling settings in a few words, for the banner (so nothing is hidden)."""
    if p.temperature == 0:
        parts = ["greedy"]
    else:
        parts = [f"temperature {p.temperature:g}"]
        parts += [f"top-k {p.top_k}"] if p.top_k else []
        parts += [f"top-p {p.top_p:g}"] if p.top_p < 1 else []
        parts += [f"min-p {p.min_p:g}"] if p.min_p else []
        parts += [f"seed {p.seed}"] if p.seed is not None else []
    parts += [f"repetition penalty {p.repetition_penalty:g}"] if p.repetition_penalty != 1 else []
    parts += [f"presence penalty {p.presence_penalty:g}"] if p.presence_penalty else []
    parts += [f"frequency penalty {p.frequency_penalty:g}"] if p.frequency_penalty else []
    return ", ".join(parts)


def chat_sampling(folder: Path | None, args: argparse.Namespace) -> SamplingParams:
    """The chat's sampling: the model's generation_config.json (folder None: none; the
    default model's says greedy with presence penalty 0.5, docs/chat.md tells why),
    then the flags the user gave. The banner prints the result."""
    return SamplingParams.from_generation_config(
        folder, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, seed=args.seed)


def build_parser(prog: str | None = None, add_args: Callable | None = None,
                 description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description or "Chat with a model in the terminal.")
    p.add_argument("--model", default=None, metavar="DIR|NAME",
                   help="a Hugging Face model folder (config.json, *.safetensors, tokenizer.json), "
                        "or a known name; default: SmolLM2-135M-Instruct, fetched and converted once")
    p.add_argument("--max-ctx", type=int, default=4096, metavar="N",
                   help="tokens the conversation may hold, prompt and answers together (default 4096)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message at the start of the conversation")
    p.add_argument("--think", choices=["on", "off"], default="on",
                   help="start with thinking shown / enabled (Qwen3); /think switches it later (default on)")
    s = p.add_argument_group("sampling (defaults: the model's generation_config.json, else temperature 1, "
                             "no top-k / top-p; the default model's: greedy, presence penalty 0.5)")
    s.add_argument("--temperature", type=float, default=None, metavar="T", help="0 = greedy")
    s.add_argument("--top-p", type=float, default=None, metavar="P")
    s.add_argument("--top-k", type=int, default=None, metavar="K")
    s.add_argument("--min-p", type=float, default=None, metavar="P")
    s.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="> 1 discourages every token already seen, the prompt's too")
    s.add_argument("--presence-penalty", type=float, default=None, metavar="A",
                   help="subtracted from the logit of every token the answer already holds")
    s.add_argument("--frequency-penalty", type=float, default=None, metavar="F",
                   help="subtracted once per time the answer already holds the token")
    s.add_argument("--seed", type=int, default=None, metavar="N", help="the same seed gives the same answers")
    s.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="at most N tokens per answer (default: the model's generation_config.json "
                        "max_new_tokens, else until the answer ends or the context is full)")
    # debugging a template: print every prompt (text and ids) sent to the engine, as JSON on stderr
    p.add_argument("--show-prompt", action="store_true", help=argparse.SUPPRESS)
    if add_args is not None:
        add_args(p)     # the stage's own options (e.g. --quant, --threads)
    return p


def main(build_engine: Callable, argv: list[str] | None = None, prog: str | None = None,
         add_args: Callable | None = None, describe: Callable | None = None) -> int:
    """Parse the command line, load the model, chat.

    build_engine(folder, args) -> an Engine (args has max_ctx and the stage's options);
    add_args(parser) adds the stage's options; describe(args) -> a few words for the banner.
    """
    args = build_parser(prog, add_args).parse_args(argv)
    if sys.stdin.isatty():
        # At a terminal, Ctrl-C must reach the chat even when it started with SIGINT ignored: a
        # shell's background job and a CI runner may start it so, and Python keeps what it inherits.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _load_and_chat(build_engine, args, describe)
    except KeyboardInterrupt:      # Ctrl-C while loading: leave without a traceback
        print(file=sys.stderr)
        return 130


def _load_and_chat(build_engine: Callable, args: argparse.Namespace, describe: Callable | None) -> int:
    interactive = sys.stdin.isatty()
    import rich
    from rich.console import Console
    console = Console(highlight=False)
    err = Console(stderr=True, highlight=False)

    def fail(message: str) -> int:
        err.print(f"error: {message}", style="bold red", markup=False, highlight=False, soft_wrap=True)
        return 2

    if args.max_ctx < 2:
        return fail("--max-ctx must be at least 2")
    try:
        params = chat_sampling(None, args)      # the flags checked before anything loads
    except ValueError as e:
        return fail(str(e))
    if args.max_tokens is not None and args.max_tokens < 1:
        return fail("--max-tokens must be at least 1")

    try:
        # None -> the default model; fetching and converting it shows its own progress
        folder = Path(resolve_model(args.model))
        tokenizer = Tokenizer(folder)
        template = ChatTemplate.from_folder(folder)
        params = chat_sampling(folder, args)
        max_tokens = answer_limit(folder, args)
    except (OSError, ValueError, RuntimeError) as e:
        return fail(str(e))

    # a status line while the engine loads (and quantizes) the weights. It lives on
    # rich's global console: a stage's own progress bars use that one too, and rich
    # (>= 14) stacks the two displays instead of letting them overwrite each other.
    t0 = time.perf_counter()
    label = describe(args) if describe is not None else ""
    loading = f"Loading {folder.name}" + (f" ({label})" if label else "") + " …"
    shared = rich.get_console()
    if not interactive:
        status = nullcontext()
    elif hasattr(shared, "_live_stack"):
        status = shared.status(loading, spinner="dots")
    else:       # an older rich allows one live display at a time: a plain line instead
        shared.print(loading, style="dim", markup=False, highlight=False)
        status = nullcontext()
    try:
        with status:
            engine = build_engine(folder, args)
    except (OSError, ValueError, RuntimeError, MemoryError) as e:
        return fail(str(e))
    # the model, the stage's words, the context, then which kernels / instructions the engine chose
    kernels = engine.describe_kernels() if hasattr(engine, "describe_kernels") else ""
    context = f"context {engine.max_ctx} tokens"
    banner = " · ".join(x for x in (folder.name, label, context, kernels) if x)
    if not interactive:     # a log line: one line, however long (soft_wrap: rich breaks none)
        err.print(f"loaded {banner} in {time.perf_counter() - t0:.1f} s", markup=False,
                  highlight=False, soft_wrap=True)
    _warm_up(engine, shared if interactive else err, interactive)

    show_prompt = args.show_prompt or os.environ.get(SHOW_PROMPT_ENV, "") not in ("", "0")
    return run_chat(engine, tokenizer, template, params, system=args.system, thinking=args.think == "on",
                    show_prompt=show_prompt, max_tokens=max_tokens, plain=not interactive,
                    console=console, banner=banner)

