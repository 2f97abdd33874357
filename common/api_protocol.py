"""The OpenAI API as pydantic models (as vLLM's protocol.py): request and response bodies, errors.

Every supported field is typed with its bounds, strictly ("2" is not an integer, true is
not 1); unknown fields are accepted and ignored, as OpenAI does; what the server does not
support (image parts, logprobs, forcing a tool) is refused with a message. An error's
`param` is pydantic's `loc` as OpenAI writes a field (messages[0].content).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      WrapValidator, field_validator, model_serializer, model_validator)
from pydantic_core import InitErrorDetails, PydanticCustomError

MAX_CHOICES = 64          # n (times the prompts of a /v1/completions batch)
MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 256
# The sampler divides float32 logits by the temperature and the repetition penalty: a
# value that is 0 or inf in float32 makes them NaN and fails the whole engine step,
# every request in the batch. So: OpenAI's temperature range (below 1e-5 is greedy, as
# in vLLM), and a repetition penalty within [1/100, 100].
MAX_TEMPERATURE, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 2.0, 1e-2, 100.0
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "ignore_eos"}


# ---- errors in OpenAI's shape ----
class APIError(Exception):
    """An error the client caused (or a state it must wait out); becomes an HTTP reply."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def param_of(loc) -> str | None:
    """pydantic's loc ('messages', 0, 'content') as OpenAI writes it: messages[0].content.
    A union's branch is tagged in parentheses, "(parts)": it is not part of the field."""
    out = ""
    for key in loc:
        if isinstance(key, str) and key.startswith("("):
            continue
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or None


def invalid_field(err: dict) -> APIError:
    """One pydantic error (an item of ValidationError.errors()) as OpenAI's 400: the one
    place where a `loc` becomes a `param`."""
    param = param_of(err["loc"])
    got = json.dumps(err.get("input"), default=str)[:50] if err["type"] not in ("missing", "model_type") else ""
    return bad_request(f"{param or 'the request body'}: {err['msg']}{', got ' + got if got else ''}", param)


def explained(message: str) -> WrapValidator:
    """Any error inside this value becomes one error at the value itself that says what
    it must be: a bad tool is tools[0], however deep inside it the mistake is."""
    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_value", "{message}", {"message": message}) from None
    return WrapValidator(check)


def unsupported(message: str) -> AfterValidator:
    """A field the server does not support: null (or an empty value) passes, anything else is refused."""
    def check(value):
        if value:
            raise PydanticCustomError("unsupported", "{message}", {"message": message})
        return value
    return AfterValidator(check)


class Strict(BaseModel):
    """A request part: JSON types as written; unknown fields kept aside (extra) and never read."""
    model_config = ConfigDict(strict=True, extra="allow")


# ---- requests ----
class StreamOptions(Strict):
    include_usage: bool = False


class SamplingRequest(Strict):
    """What /v1/chat/completions and /v1/completions share: the model, n, streaming, sampling."""
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1, description="capped to the room the prompt leaves")
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="vLLM extension; 0 or -1 = off")
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM extension")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                             description="vLLM extension; 1 = off")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="choice i of n uses seed + i")
    stop: Annotated[Union[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)],
                          list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]]] | None,
                    Field(max_length=MAX_STOP),
                    explained(f"'stop' must be a string of 1 to {MAX_STOP_CHARS} characters or a list of at "
                              f"most {MAX_STOP} of them")] = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]] | None, Field(max_length=MAX_STOP_TOKEN_IDS),
                              explained(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} "
                                        "non-negative integers")] = None
    ignore_eos: bool | None = Field(None, description="vLLM extension: generate past end-of-sequence ids")
    user: str | None = None
    logprobs: Annotated[bool | int | None, unsupported("logprobs are not supported by this server; leave "
                                                       "'logprobs' unset")] = None
    logit_bias: Annotated[dict[str, float] | None, unsupported(
        "logit_bias is not supported by this server; leave it unset (or {})")] = None

    def sampling(self) -> dict:
        """The sampling fields this request sets (SamplingParams' names; None = the model's default)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return self.model_dump(include=SAMPLING_FIELDS) | dict(stop=stop or [],
                                                               stop_token_ids=self.stop_token_ids or [])


class TextPart(Strict):
    type: Literal["text"]
    text: str


def _content_kind(value) -> str | None:
    return "(text)" if isinstance(value, str) else "(parts)" if isinstance(value, list) else None


Content = Annotated[
    Union[Annotated[str, Tag("(text)")],
          Annotated[list[Annotated[TextPart, explained(
              "only text parts ({'type': 'text', 'text': ...}) are supported")]], Tag("(parts)")]],
    Discriminator(_content_kind, custom_error_type="content_type",
                  custom_error_message="must be a string or a list of text parts")]


class FunctionCall(Strict):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]   # developer: OpenAI's new system
    content: Content | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Annotated[ToolCall, explained(
        "a tool call needs function.name (a string) and function.arguments (a JSON string)")]] | None = None
    reasoning_content: str | None = None     # an earlier answer's thinking, as this server returns it
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
        parts = self.content if isinstance(self.content, list) else None
        m["content"] = "".join(p.text for p in parts) if parts is not None else (self.content or "")
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


class ChatTemplateKwargs(Strict):
    """Variables for the chat template (vLLM extension); any other name is passed on."""
    enable_thinking: bool = True

    @model_validator(mode="after")
    def _names(self):
        keys = set(self.model_extra or {})
        if keys & {"messages", "tools", "add_generation_prompt"} or not all(k.isidentifier() for k in keys):
            raise PydanticCustomError("template_kwargs", "chat_template_kwargs keys must be names other than "
                                      "messages, tools and add_generation_prompt")
        return self


class ChatCompletionRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: Annotated[int | None, unsupported("top_logprobs are not supported by this server")] = None
    tools: list[Annotated[Tool, explained(
        "a tool must be {'type': 'function', 'function': {'name': ...}}")]] | None = None
    tool_choice: Annotated[Literal["none", "auto"] | None, explained(
        "tool_choice must be 'none' or 'auto' (forcing a tool is not supported)")] = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    prompt: Annotated[Union[str, TokenIds, Annotated[list[Union[str, TokenIds]], Field(min_length=1)]],
                      explained("'prompt' must be a string, a list of token ids, or a list of those")]
    echo: bool = False
    suffix: Annotated[str | None, unsupported("'suffix' is not supported")] = None

    @model_validator(mode="after")
    def _choices(self):
        k, n = len(self.prompts()), self.n
        if n * k > MAX_CHOICES:      # an error at "n", where the client can fix it
            raise ValidationError.from_exception_data("CompletionRequest", [InitErrorDetails(
                type=PydanticCustomError("choices", "{k} prompts x n={n} is {total} choices; this server makes at "
                                         "most {max} per request", dict(k=k, n=n, total=n * k, max=MAX_CHOICES)),
                loc=("n",), input=n)])
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)


# ---- responses ----
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict | None = None     # {"cached_tokens": N}, from an engine with a prefix cache


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None          # the <think> part (DeepSeek's and vLLM's name) ...
    reasoning: str | None = None                  # ... and OpenRouter's
    tool_calls: list[dict] | None = None


class ReplyChoice(BaseModel):
    index: int
    logprobs: None = None
    finish_reason: str | None = None


class ChatChoice(ReplyChoice):
    message: ChatMessage


class Reply(BaseModel):
    """What every generation reply and streamed chunk carries."""
    id: str
    created: int
    model: str
    usage: Usage | None = None


class ChatCompletionResponse(Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """What one chunk adds to a streamed message; only the keys it sets are sent."""
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict] | None = None

    @model_serializer(mode="wrap")
    def _set_only(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChunkChoice(ReplyChoice):
    delta: Delta


class ChatCompletionChunk(Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]


class CompletionChoice(ReplyChoice):
    text: str


class CompletionResponse(Reply):
    """A whole answer, and also each streamed chunk (OpenAI uses one shape for both)."""
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "qwen3-stages"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
