"""POST /v1/chat/completions: messages -> the chat template -> token ids -> an answer whose
<think> part is reasoning_content and whose <tool_call> blocks are tool_calls."""
from __future__ import annotations

import functools
import time

from fastapi import APIRouter, Depends, Request

from common.api_generation import Choice, Generation, Job, stream
from common.api_protocol import ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, \
    ChatMessage, ChatTemplateKwargs, ChunkChoice, Delta, bad_request, parse_request
from common.api_state import ServerState, admitted_body, body_schema, server_state
from common.parsing import StreamParser, prompt_opens_think

router = APIRouter()


def prepare_chat(state: ServerState, raw: bytes) -> Job:
    """Body bytes -> a Job: checked, the template rendered and tokenized once (a prepare thread)."""
    req = parse_request(ChatCompletionRequest, raw, state.limits.max_depth)
    state.check_model(req.model)
    kwargs = req.chat_template_kwargs or ChatTemplateKwargs()
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
    try:
        prompt = state.template.render([m.for_template() for m in req.messages], add_generation_prompt=True,
                                       enable_thinking=kwargs.enable_thinking, tools=tools, **kwargs.model_extra)
    except (ValueError, RecursionError, TypeError, AttributeError, LookupError) as e:
        # the template refused these messages (ChatTemplateError), or got a value of a type it does not expect
        raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from None
    if not isinstance(prompt, str):
        raise bad_request("the chat template did not render text for these messages", "messages")
    ids = state.prompt_ids(prompt, "messages")
    think = kwargs.enable_thinking
    return Job([ids] * req.n, state.choice_params(req, req.max_completion_tokens or req.max_tokens, len(ids)),
               req.stream, bool(req.stream_options and req.stream_options.include_usage),
               functools.partial(StreamParser, thinking=think, tools=tools is not None,
                                 start_in_reasoning=think and prompt_opens_think(prompt)))


def finish_reason(c: Choice) -> str:
    return "tool_calls" if (c.parser.tool_calls and c.finish_reason == "stop") else c.finish_reason


def deltas(c: Choice, text: str) -> list:
    return c.parser.feed(text) + (c.parser.finish() if c.done else [])


@router.post("/chat/completions", response_model=ChatCompletionResponse, openapi_extra=body_schema(
    ChatCompletionRequest), summary="A chat answer; with stream: true, chat.completion.chunk events (SSE)")
async def chat_completions(request: Request, raw: bytes = Depends(admitted_body)):
    state = server_state(request)
    job = await state.prepare(prepare_chat, raw)
    gen, created = Generation(state, job, "chatcmpl"), int(time.time())
    if not job.stream:
        got = {c.index: [] for c in gen.choices}
        await gen.run_to_end(request, lambda c, text: got[c.index].extend(deltas(c, text)))
        choices = []
        for c in gen.choices:
            content = "".join(d.text for d in got[c.index] if d.kind == "content")
            reasoning = "".join(d.text for d in got[c.index] if d.kind == "reasoning") or None
            calls = [d.tool_call for d in got[c.index] if d.kind == "tool_call"] or None
            message = ChatMessage(content=content if (content or not calls) else None, reasoning_content=reasoning,
                                  reasoning=reasoning, tool_calls=calls)
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason(c)))
        return ChatCompletionResponse(id=gen.id, created=created, model=state.model_name, choices=choices,
                                      usage=gen.usage())

    def chunk(c: Choice | None, delta: Delta | None = None, finish: str | None = None, usage=None):
        choices = [ChunkChoice(index=c.index, delta=delta, finish_reason=finish)] if c else []
        return ChatCompletionChunk(id=gen.id, created=created, model=state.model_name, choices=choices, usage=usage)

    calls_sent = {c.index: 0 for c in gen.choices}

    def pieces(c: Choice, text: str) -> list[ChatCompletionChunk]:
        out = []
        for d in deltas(c, text):
            if d.kind == "content":
                out.append(chunk(c, Delta(content=d.text)))
            elif d.kind == "reasoning":
                out.append(chunk(c, Delta(reasoning_content=d.text, reasoning=d.text)))
            else:
                out.append(chunk(c, Delta(tool_calls=[{"index": calls_sent[c.index], **d.tool_call}])))
                calls_sent[c.index] += 1
        return out + ([chunk(c, Delta(), finish_reason(c))] if c.done else [])

    first = [chunk(c, Delta(role="assistant", content="")) for c in gen.choices]
    return stream(gen, first, pieces, lambda usage: chunk(None, usage=usage))
