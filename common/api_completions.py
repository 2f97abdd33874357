"""POST /v1/completions: a prompt (text or token ids, or a batch of them) -> its continuation."""
from fastapi import APIRouter, Depends, Request

from common.api_protocol import (MAX_CHOICES, CompletionRequest, Reply, ReplyChoice, bad_request,
                                 parse_request)
from common.api_state import Generation, ServerState, admitted_body, body_schema, stream

router = APIRouter()

def prepare_completion(state: ServerState, raw: bytes) -> Generation:
    """Body bytes -> a Generation: checked, each prompt tokenized once (a prepare thread)."""
    req = parse_request(CompletionRequest, raw, state.limits.max_depth)
    # one prompt (a text or token ids) or a list of them; each has n choices of its own
    prompt = req.prompt
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    if req.n * len(prompts) > MAX_CHOICES:       # an error at "n", where the client can fix it
        raise bad_request(f"n: {len(prompts)} prompts x n={req.n} is {req.n * len(prompts)} "
                          f"choices; this server makes at most {MAX_CHOICES} per request", "n")
    state.check_model(req.model)
    return Generation(state, req,
                      {"prompt" if len(prompts) == 1 else f"prompt[{k}]": p
                       for k, p in enumerate(prompts)},
                      req.max_tokens, "cmpl", echo=req.echo)

@router.post("/completions", response_model=Reply, openapi_extra=body_schema(CompletionRequest),
             summary="A completion; with stream: true, text_completion events (SSE)")
async def completions(request: Request, raw: bytes = Depends(admitted_body)):
    gen = await Generation.start(request, raw, prepare_completion)

    def answer(choices: list[tuple], usage=None) -> Reply:    # (choice, text, finish_reason)
        return gen.reply("text_completion", usage=usage, choices=[
            ReplyChoice(index=c.index, text=text, finish_reason=finish)
            for c, text, finish in choices])

    if not gen.stream:
        await gen.run_to_end(request)
        return answer([(c, c.echo + c.text, c.finish_reason) for c in gen.choices], gen.usage())
    return stream(gen, "text_completion",
                  [answer([(c, c.echo, None)]) for c in gen.choices if c.echo],
                  lambda c, text: ([answer([(c, text, c.finish_reason)])]
                                   if (text or c.done) else []))
