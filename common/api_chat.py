"""POST /v1/chat/completions: messages -> the chat template -> token ids -> an answer whose
<think> part is reasoning_content and whose <tool_call> blocks are tool_calls."""
import functools

from fastapi import APIRouter, Depends, Request

from common.api_protocol import (ChatCompletionRequest, ChatMessage, ChatTemplateKwargs, Delta,
                                 Reply, ReplyChoice, bad_request, parse_request)
from common.api_state import Choice, Generation, ServerState, admitted_body, body_schema, stream
from common.parsing import StreamParser, prompt_opens_think

router = APIRouter()

def prepare_chat(state: ServerState, raw: bytes) -> Generation:
    """Body bytes -> a Generation: checked, the template rendered and tokenized once (a prepare
    thread)."""
    req = parse_request(ChatCompletionRequest, raw, state.limits.max_depth)
    state.check_model(req.model)
    kwargs = req.chat_template_kwargs or ChatTemplateKwargs()
    tools = ([t.model_dump(exclude_none=True) for t in req.tools]
             if req.tools and req.tool_choice != "none" else None)
    try:
        prompt = state.template.render([m.for_template() for m in req.messages],
                                       add_generation_prompt=True,
                                       enable_thinking=kwargs.enable_thinking, tools=tools,
                                       **kwargs.model_extra)
    except (ValueError, RecursionError, TypeError, AttributeError, LookupError) as e:
        # the template refused these messages (ChatTemplateError), or got a value of a type it does
        # not expect
        raise bad_request(f"the chat template cannot render these messages: {e}",
                          "messages") from None
    return Generation(state, req, {"messages": prompt},
                      req.max_completion_tokens or req.max_tokens, "chatcmpl",
                      functools.partial(
                          StreamParser, thinking=kwargs.enable_thinking, tools=tools is not None,
                          start_in_reasoning=kwargs.enable_thinking and prompt_opens_think(prompt)))

def finish_reason(c: Choice) -> str:
    return "tool_calls" if (c.parser.tool_calls and c.finish_reason == "stop") else c.finish_reason

def deltas(c: Choice, text: str) -> list:
    return c.parser.feed(text) + (c.parser.finish() if c.done else [])

def chunk_delta(c: Choice, d) -> Delta:
    """A parser delta as a chunk's; a tool call's index is its place among the choice's calls."""
    if d.kind == "tool_call":
        return Delta(tool_calls=[{"index": c.parser.tool_calls.index(d.tool_call), **d.tool_call}])
    return (Delta(content=d.text) if d.kind == "content"
            else Delta(reasoning_content=d.text, reasoning=d.text))

def message(parts: list) -> ChatMessage:
    """A whole answer's deltas as one message."""
    content, reasoning = ("".join(d.text for d in parts if d.kind == kind)
                          for kind in ("content", "reasoning"))
    calls = [d.tool_call for d in parts if d.kind == "tool_call"] or None
    return ChatMessage(content=content if (content or not calls) else None,
                       reasoning_content=reasoning or None,
                       reasoning=reasoning or None, tool_calls=calls)

@router.post("/chat/completions", response_model=Reply,
             openapi_extra=body_schema(ChatCompletionRequest),
             summary="A chat answer; with stream: true, chat.completion.chunk events (SSE)")
async def chat_completions(request: Request, raw: bytes = Depends(admitted_body)):
    gen = await Generation.start(request, raw, prepare_chat)
    if not gen.stream:
        got = {c.index: [] for c in gen.choices}
        await gen.run_to_end(request, lambda c, text: got[c.index].extend(deltas(c, text)))
        return gen.reply("chat.completion", usage=gen.usage(), choices=[ReplyChoice(
            index=c.index, message=message(got[c.index]), finish_reason=finish_reason(c))
            for c in gen.choices])

    def chunk(c: Choice, delta: Delta, finish: str | None = None) -> Reply:
        return gen.reply("chat.completion.chunk", choices=[ReplyChoice(index=c.index, delta=delta,
                                                                       finish_reason=finish)])

    def pieces(c: Choice, text: str) -> list[Reply]:
        return [chunk(c, chunk_delta(c, d)) for d in deltas(c, text)] + (
            [chunk(c, Delta(), finish_reason(c))] if c.done else [])

    return stream(gen, "chat.completion.chunk",
                  [chunk(c, Delta(role="assistant", content="")) for c in gen.choices], pieces)
