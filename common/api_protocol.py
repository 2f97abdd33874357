"""The OpenAI API as pydantic models (as vLLM's protocol.py), errors, and a body's bytes -> a model.
Fields are strict ("2" is not an integer) and bounded; unknown fields are ignored, as OpenAI does;
what the server does not support is refused with a message. docs/server.md lists every limit."""
import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      WrapValidator, field_validator, model_serializer, model_validator)
from pydantic_core import PydanticCustomError

# n (x prompts); stop strings, and their length
MAX_CHOICES, MAX_STOP, MAX_STOP_CHARS = 64, 16, 256

class APIError(Exception):
    """An error the client caused (or a state it must wait out), with OpenAI's error body."""
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, {"error": {"message": message, "type": type,
                                                    "param": param, "code": code}}

def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)

def param_of(loc) -> str | None:
    """pydantic's loc ('messages', 0, 'content') in OpenAI's form, messages[0].content, less union
    tags ("(parts)")."""
    out = ""
    for key in loc:
        if not (isinstance(key, str) and key.startswith("(")):
            out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or None

def invalid_field(err: dict) -> APIError:
    """One pydantic error (of ValidationError.errors()) as a 400: the one place a loc becomes a
    param."""
    # not UTF-8, a syntax error, an integer of more than 4300 digits
    if err["type"] == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {err['ctx']['error']}")
    param = param_of(err["loc"])
    got = (json.dumps(err.get("input"), default=str)[:50]
           if err["type"] not in ("missing", "model_type") else "")
    return bad_request(f"{param or 'the request body'}: {err['msg']}"
                       f"{', got ' + got if got else ''}", param)

def explained(message: str) -> WrapValidator:
    """Any error inside this value becomes one error at the value (tools[0]), saying what it must
    be."""
    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_value", "{message}", {"message": message}) from None
    return WrapValidator(check)

def unsupported(what: str) -> WrapValidator:     # on a field that takes only null or an empty value
    return explained(f"{what} not supported by this server; leave it unset")

# a request part: unknown fields kept aside, never read
class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

Penalty = Annotated[float | None, Field(ge=-2, le=2)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Ids = Annotated[list[int], Field(min_length=1)]

class StreamOptions(Strict):
    include_usage: bool = False

class SamplingRequest(Strict):
    """What /v1/chat/completions and /v1/completions share: the model, n, streaming, sampling."""
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, description="capped to the room the prompt leaves")
    temperature: float | None = Field(None, ge=0, le=2, description="below 1e-5: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM extension; 0 or -1 = off")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM extension")
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: float | None = Field(None, ge=1e-2, le=100,
                                             description="vLLM extension; 1 = off")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="choice i of n uses seed + i")
    stop: Annotated[StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None,
                    explained(f"'stop' must be a string of 1 to {MAX_STOP_CHARS} characters "
                              f"or a list of at most {MAX_STOP}")] = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]] | None, Field(max_length=256),
                              explained("'stop_token_ids' must be a list of at most 256 "
                                        "non-negative integers")] = None
    ignore_eos: bool | None = Field(
        None, description="vLLM extension: generate past end-of-sequence ids")
    user: str | None = None
    logprobs: Annotated[Literal[False, 0] | None, unsupported("logprobs are")] = None
    logit_bias: Annotated[Annotated[dict, Field(max_length=0)] | None,
                          unsupported("logit_bias is")] = None

class TextPart(Strict):
    type: Literal["text"]
    text: str

Content = Annotated[
    Union[Annotated[str, Tag("(text)")], Annotated[list[Annotated[TextPart, explained(
        "only text parts ({'type': 'text', 'text': ...}) are supported")]], Tag("(parts)")]],
    Discriminator(lambda v: ("(text)" if isinstance(v, str)
                             else "(parts)" if isinstance(v, list) else None),
                  custom_error_type="content_type",
                  custom_error_message="must be a string or a list of text parts")]

class FunctionCall(Strict):
    name: str
    arguments: str | dict[str, Any] = ""

class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

class Message(Strict):
    # developer: OpenAI's new system
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Annotated[ToolCall, explained(
        "a tool call needs function.name (a string) and function.arguments "
        "(a JSON string)")]] | None = None
    # an earlier answer's thinking, as this server returns it
    reasoning_content: str | None = None
    reasoning: str | None = None
    thinking: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _only_on_assistant(cls, calls, info):
        if calls is not None and info.data.get("role") != "assistant":
            raise PydanticCustomError("tool_calls", "tool_calls belong on an assistant message")
        return calls

    def for_template(self) -> dict:
        """The message as the chat template reads it: text content, system for developer."""
        m = self.model_dump(exclude_none=True)
        m["content"] = ("".join(p.text for p in self.content) if isinstance(self.content, list)
                        else self.content or "")
        m["role"] = "system" if self.role == "developer" else self.role
        return m

class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None     # a JSON schema, rendered into the prompt
    strict: bool | None = None

class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef

# the chat template's variables (vLLM); other names passed on
class ChatTemplateKwargs(Strict):
    enable_thinking: bool = True

    @model_validator(mode="after")
    def _names(self):
        keys = set(self.model_extra or {})
        if (keys & {"messages", "tools", "add_generation_prompt"}
                or not all(k.isidentifier() for k in keys)):
            raise PydanticCustomError("template_kwargs", "chat_template_kwargs keys must be names "
                                      "other than messages, tools and add_generation_prompt")
        return self

class ChatCompletionRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: Annotated[Literal[0] | None, unsupported("top_logprobs are")] = None
    tools: list[Annotated[Tool, explained(
        "a tool must be {'type': 'function', 'function': {'name': ...}}")]] | None = None
    tool_choice: Annotated[Literal["none", "auto"] | None, explained(
        "tool_choice must be 'none' or 'auto' (forcing a tool is not supported)")] = None
    chat_template_kwargs: ChatTemplateKwargs | None = None

class CompletionRequest(SamplingRequest):
    prompt: Annotated[Union[str, Ids, Annotated[list[Union[str, Ids]], Field(min_length=1)]],
                      explained("'prompt' must be a string, a list of token ids, "
                                "or a list of those")]
    echo: bool = False
    suffix: Annotated[Literal[""] | None, unsupported("'suffix' is")] = None

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # {"cached_tokens": N}, from an engine with a prefix cache
    prompt_tokens_details: dict | None = None
    # an extension: drafts made and accepted (stage 1 --speculative)
    speculative_decoding: dict | None = None

class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # the <think> part (DeepSeek's and vLLM's name) ...
    reasoning_content: str | None = None
    reasoning: str | None = None                  # ... and OpenRouter's
    tool_calls: list[dict] | None = None

# what a chunk adds to a message: only the keys it sets
class Delta(ChatMessage):
    role: Literal["assistant"] | None = None

    @model_serializer(mode="wrap")
    def _set_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}

# a choice of any reply: message, delta (a chunk's) or text
class ReplyChoice(BaseModel):
    index: int
    logprobs: None = None
    finish_reason: str | None = None
    message: ChatMessage | None = None
    delta: Delta | None = None
    text: str | None = None

    @model_serializer(mode="wrap")
    def _set_only(self, handler):                 # of message, delta and text only the one given
        return {k: v for k, v in handler(self).items() if k not in ("message", "delta", "text") or
                k in self.model_fields_set}

# every generation reply and streamed chunk (as OpenAI)
class Reply(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk", "text_completion"]
    created: int
    model: str
    choices: list[ReplyChoice]
    usage: Usage | None = None

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "qwen3-stages"
    max_model_len: int | None = None

class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

# ---- bytes -> a model: a scan of the raw bytes first, for what pydantic's parser would refuse with
# no field to name (lone surrogates, deep nesting) or read as a number (NaN); docs/server.md ----
_SURROGATE = re.compile("[\ud800-\udfff]")
# as an escape, or as UTF-8 bytes
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
# strings (whole), brackets, commas
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]|NaN|-?Infinity')

def parse_request(model: type[Strict], raw: bytes, max_depth: int) -> Strict:
    """The body as `model`, or a 400 that names the field (on a prepare thread). The scan first
    follows the keys down the raw bytes, so also past Python's recursion limit (100,000 '[' cost 65
    steps): a 400 naming the field for a container deeper than max_depth, a lone surrogate, or NaN;
    then pydantic validates."""
    # per open container: its index, or its key (None: the next string is the key)
    keys: list = []
    for t in _TOKEN.findall(raw):
        if t in (b"[", b"{"):
            # named by its first four keys; the path shown is cut at 80 characters
            if len(keys) >= max_depth:
                path = ["?" if key is None else key for key in keys]
                field = param_of(path[:4]) if path and isinstance(path[0], str) else None
                full = param_of(path) or ""
                at = f" (at {full[:80]}{'...' if len(full) > 80 else ''})" if full != field else ""
                raise bad_request(f"{field or 'the request body'} nests arrays/objects more than "
                                  f"{max_depth} levels deep{at}; send a flatter structure", field)
            keys.append(None if t == b"{" else 0)
        elif t in (b"]", b"}"):
            del keys[-1:]
        elif t == b",":
            if keys:
                keys[-1] = keys[-1] + 1 if isinstance(keys[-1], int) else None
        elif not t.startswith(b'"'):
            raise bad_request(f"the request body is not valid JSON: {t.decode()} is not valid "
                              "JSON (JSON has no NaN or Infinity); send a number or null",
                              param_of(keys))
        elif (is_key := bool(keys) and keys[-1] is None) or _ESCAPED_SURROGATE.search(t):
            # a key (the one its object waits for), or a value that may hold a lone surrogate
            try:
                text = json.loads(t) if b"\\" in t else t[1:-1].decode("utf-8", "surrogatepass")
            except ValueError:      # a bad escape, or not UTF-8: pydantic's error says so
                continue
            if s := _SURROGATE.search(text):
                where = param_of(keys[:-1] if is_key else keys)
                raise bad_request(f"{where or 'the request body'} "
                                  f"{'has a key with' if is_key else 'contains'} "
                                  f"a lone UTF-16 surrogate (\\u{ord(s.group()):04x} at character "
                                  f"{s.start()}), which is not valid Unicode; send the character "
                                  "as a surrogate pair, or leave it out", where)
            if is_key:
                keys[-1] = text
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise invalid_field(e.errors(include_url=False)[0]) from None
