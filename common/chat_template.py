"""ChatTemplate: a list of chat messages -> the prompt text the model was trained on.

Every instruct model ships its prompt format as a Jinja template (in
tokenizer_config.json or chat_template.jinja). We render it the way transformers'
`apply_chat_template(..., tokenize=False)` does, so the prompt is byte-identical:

  * a sandboxed Jinja environment with trim_blocks and lstrip_blocks,
  * `tojson` that keeps non-ASCII text as is (Jinja's own escapes it for HTML),
  * `raise_exception(msg)` and `strftime_now(fmt)`, which templates call,
  * messages with None values dropped, and the reasoning of a message visible
    under each name templates read it by (reasoning_content, thinking, reasoning),
  * the tokenizer's bos_token / eos_token as template variables.

Qwen3's template reads `enable_thinking`: False makes the generation prompt end
with an empty "<think>\\n\\n</think>\\n\\n", so the model answers directly.

A folder without any template gets BUILTIN_CHATML: ChatML with Qwen3's
conventions for system prompts, tools, tool calls and thinking.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.config import gguf_path, read_json
from common.tokenizer import token_text


class ChatTemplateError(ValueError):
    """A chat template that does not compile or fails on the given messages."""


# Our own ChatML template (common/chatml.jinja), for a model without one, with Qwen3's
# conventions. Each turn is
#   <|im_start|>{role}\n{content}<|im_end|>\n
# tools go into the system turn as JSON lines inside <tools></tools>; an assistant's
# tool calls are <tool_call>\n{json}\n</tool_call>; tool results come back as a user
# turn of <tool_response> blocks. Reasoning is kept only for the assistant turns
# after the last real user message (the current tool-calling chain), as Qwen3 does;
# older turns keep just their answer.
BUILTIN_CHATML = (Path(__file__).parent / "chatml.jinja").read_text(encoding="utf-8")


# --- the functions and filters transformers gives templates ---
def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # plain json.dumps: Jinja's built-in tojson escapes <, >, & and ' for HTML,
    # which would change the prompt (tool schemas often contain them)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training
    masks; for rendering it is transparent, but it must parse."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _environment() -> ImmutableSandboxedEnvironment:
    # sandboxed and immutable: a template from a model repo cannot reach Python
    # internals or modify our messages
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _prepare_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template (fresh copies, ours untouched)."""
    prepared = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {i} is a {type(message).__name__}, not a dict "
                                    "with 'role' and 'content'")
        m = dict(message)
        if m.get("content", "") is None:
            # OpenAI clients send content=null next to tool_calls; templates such as
            # Qwen3's concatenate content, so give them "" (transformers drops the
            # key instead, and such templates then fail)
            m["content"] = ""
        # other None values are dropped, as transformers does: templates test for
        # a missing key more often than for none
        m = {k: v for k, v in m.items() if v is not None}
        # a message's reasoning under every name templates read it by
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        prepared.append(m)
    return prepared


class ChatTemplate:
    def __init__(self, template_str: str, bos_token: str | None = "", eos_token: str | None = "",
                 name: str = "chat template"):
        self.source = template_str
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self.name = name     # where the template came from, for error messages
        try:
            self._template = _environment().from_string(template_str)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{name} has a Jinja syntax error at line {e.lineno}: "
                                    f"{e.message}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ChatTemplate":
        """The model's template: chat_template.jinja, else tokenizer_config.json's
        chat_template (a string, or a list of {name, template}: "default" is used),
        else BUILTIN_CHATML. A GGUF file (or a folder holding one): its tokenizer.chat_template."""
        folder = Path(folder)
        g = gguf_path(folder)
        if g is not None:
            from common.gguf import open_gguf    # GGUF code loads only for a GGUF model
            return cls(*open_gguf(g).chat_template(BUILTIN_CHATML))
        cfg_path = folder / "tokenizer_config.json"
        cfg = read_json(cfg_path, ChatTemplateError)
        bos, eos = token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token"))

        jinja_path = folder / "chat_template.jinja"
        if jinja_path.is_file():     # transformers >= 4.50 saves the template on its own
            return cls(jinja_path.read_text(encoding="utf-8"), bos, eos, name=str(jinja_path))
        template = cfg.get("chat_template")
        if isinstance(template, list):   # several named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:
                raise ChatTemplateError(f"{cfg_path} lists chat templates "
                                        f"{sorted(map(str, named))} but none named 'default'")
            template = named["default"]
        if isinstance(template, str) and template.strip():
            return cls(template, bos, eos, name=f"{cfg_path} chat_template")
        return cls(BUILTIN_CHATML, bos, eos, name="built-in ChatML template")

    @property
    def is_builtin(self) -> bool:
        return self.source == BUILTIN_CHATML

    @property
    def has_thinking(self) -> bool:
        """True when the template reacts to enable_thinking (Qwen3 does), so a chat
        UI can offer /think on|off."""
        return "enable_thinking" in self.source

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               enable_thinking: bool = True, tools: list[dict] | None = None, **extra) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        tools: OpenAI-style tool definitions ({"type": "function", "function": {...}}).
        extra: more template variables (documents, a custom flag a template reads ...).
        """
        context = {}
        # the tokenizer's special tokens first, so explicit arguments override them
        if self.bos_token:
            context["bos_token"] = self.bos_token
        if self.eos_token:
            context["eos_token"] = self.eos_token
        context.update(documents=None, enable_thinking=enable_thinking)
        context.update(extra)
        try:
            return self._template.render(messages=_prepare_messages(messages), tools=tools,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:   # includes raise_exception() and undefined variables
            raise ChatTemplateError(f"{self.name} failed on these messages: {e}") from None
        except (TypeError, AttributeError, KeyError, IndexError, ValueError, ArithmeticError) as e:
            # e.g. content given as a list of parts to a template that adds strings
            raise ChatTemplateError(f"{self.name} failed on these messages "
                                    f"({type(e).__name__}: {e}); check that each message has a "
                                    "string 'role' and 'content'") from None
