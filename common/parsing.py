"""Qwen3 output parsing: split generated text into content, reasoning and tool calls.

Qwen3 writes its thinking between <think> and </think>, then the answer; a tool
call is a JSON object between <tool_call> and </tool_call>:

    <think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n
    {"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>

The same parser serves the HTTP server (streaming and not) and the terminal chat.
It is fed text as it is detokenized, so a tag may arrive in pieces ("<too" then
"l_call>"): a tail that could still become a tag is held back until the next
piece decides it.

Some templates open <think> in the prompt itself, so the output starts inside the
thinking and only shows </think>. Pass start_in_reasoning=True for those
(prompt_opens_think() tells from the rendered prompt); parse_output() detects it
from the whole text.

Whitespace that only separates sections ("</think>\n\n", the newline around a
tool call) is dropped, so neither reasoning nor content starts or ends with it.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Delta:
    kind: str                        # "content" | "reasoning" | "tool_call"
    text: str = ""                   # the new text (content / reasoning)
    tool_call: dict | None = None    # {"id", "type": "function", "function": {"name", "arguments"}}


def new_tool_call_id() -> str:
    """An id in the OpenAI style; the client echoes it back in the tool result message."""
    return "call_" + secrets.token_hex(12)


def make_tool_call(body: str) -> dict | None:
    """The JSON body of a <tool_call> block -> an OpenAI tool call, or None if it is not one.

    The arguments become a JSON *string* (that is what the OpenAI API sends)."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        # the model already wrote a string: keep it as is if it holds JSON, else wrap it
        try:
            json.loads(args)
        except json.JSONDecodeError:
            args = json.dumps(args, ensure_ascii=False)
    else:
        args = json.dumps(args, ensure_ascii=False)
    return {"id": new_tool_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": args}}


def prompt_opens_think(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open <think> block, so the
    model's output begins as reasoning."""
    i = prompt.rfind(THINK_OPEN)
    return i >= 0 and prompt.find(THINK_CLOSE, i) < 0


def _partial_tag_len(text: str, tags: list[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of one of tags
    (so it must be held back: the next piece may complete the tag)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class StreamParser:
    """Incremental parser: feed() text pieces, get Deltas; finish() at the end.

    thinking: recognise <think>...</think> (False: a thinking-off request, all text is content)
    tools:    recognise <tool_call>...</tool_call> (False: no tools were offered)
    start_in_reasoning: the prompt already opened <think>, so output starts as reasoning
    """

    def __init__(self, thinking: bool = True, tools: bool = True, start_in_reasoning: bool = False):
        self.thinking = thinking
        self.tools = tools
        self.mode = "reasoning" if (thinking and start_in_reasoning) else "content"
        self.thought = self.mode == "reasoning"   # <think> is recognised once, before any answer
        self.buf = ""           # text received but not yet emitted
        self.at_start = True    # at the start of a section: leading whitespace is dropped
        self.tool_calls: list[dict] = []

    # ---- public API ---------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Delta]:
        """The end of the output: whatever is held back is settled."""
        out: list[Delta] = []
        while self._step(out, final=True):
            pass
        if self.mode == "tool":
            # an unclosed tool call (the output hit max_tokens): a call if its JSON is whole
            call = make_tool_call(self.buf.strip())
            if call is not None:
                self.tool_calls.append(call)
                out.append(Delta("tool_call", tool_call=call))
            else:
                self._emit(out, "content", TOOL_OPEN + self.buf)
            self.buf, self.mode = "", "content"
        elif self.buf:
            self._emit(out, self.mode, self.buf.rstrip())
            self.buf = ""
        return out

    # ---- internals ----------------------------------------------------------
    def _tags(self) -> list[str]:
        """The tags that change the mode from the current one."""
        if self.mode == "reasoning":
            return [THINK_CLOSE]
        tags = []
        if self.thinking and not self.thought:
            tags.append(THINK_OPEN)
        if self.tools:
            tags.append(TOOL_OPEN)
        return tags

    def _emit(self, out: list[Delta], kind: str, text: str):
        """Emit text of a section; whitespace at the start of a section is dropped,
        trailing whitespace is held back (a closing tag may follow it)."""
        if self.at_start:
            text = text.lstrip()
        if not text:
            return
        self.at_start = False
        if out and out[-1].kind == kind:
            out[-1].text += text
        else:
            out.append(Delta(kind, text))

    def _step(self, out: list[Delta], final: bool) -> bool:
        """Consume as much of buf as can be decided; True if the mode changed (run again)."""
        if self.mode == "tool":
            end = self.buf.find(TOOL_CLOSE)
            if end < 0:
                return False      # keep buffering the call's JSON
            body, self.buf = self.buf[:end], self.buf[end + len(TOOL_CLOSE):]
            call = make_tool_call(body.strip())
            if call is None:
                # malformed: hand it to the user as plain text rather than fail
                self._emit(out, "content", TOOL_OPEN + body + TOOL_CLOSE)
            else:
                self.tool_calls.append(call)
                out.append(Delta("tool_call", tool_call=call))
            self.mode, self.at_start = "content", True
            return True

        tags = self._tags()
        hits = [(self.buf.find(t), t) for t in tags]
        hits = [(i, t) for i, t in hits if i >= 0]
        if hits:
            i, tag = min(hits)
            before, self.buf = self.buf[:i], self.buf[i + len(tag):]
            self._emit(out, self.mode, before.rstrip())
            if tag == THINK_OPEN:
                self.mode, self.thought = "reasoning", True
            elif tag == THINK_CLOSE:
                self.mode = "content"
            else:
                self.mode = "tool"
            self.at_start = True
            return True

        if final:
            return False
        # no tag yet: emit all but a tail that may start a tag or is trailing whitespace
        hold = _partial_tag_len(self.buf, tags)
        ready = self.buf[:len(self.buf) - hold]
        stripped = ready.rstrip()
        # trailing whitespace waits: if a tag follows it, it is dropped
        self._emit(out, self.mode, stripped)
        if self.at_start and not stripped:
            # still only whitespace at a section start: nothing to keep
            self.buf = self.buf[len(ready):]
        else:
            self.buf = self.buf[len(stripped):]
        return False


def parse_output(text: str, thinking: bool = True,
                 tools: bool = True) -> tuple[str, str, list[dict]]:
    """A whole output -> (content, reasoning, tool_calls).

    An output with </think> but no <think> before it started inside the thinking
    (the template opened <think> in the prompt): everything before </think> is reasoning."""
    close = text.find(THINK_CLOSE)
    starts_inside = thinking and close >= 0 and text.find(THINK_OPEN, 0, close) < 0
    parser = StreamParser(thinking=thinking, tools=tools, start_in_reasoning=starts_inside)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.text for d in deltas if d.kind == "content")
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    calls = [d.tool_call for d in deltas if d.kind == "tool_call"]
    return content, reasoning, calls
