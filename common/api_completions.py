"""POST /v1/completions: a prompt (text or token ids, or a batch of them) -> its continuation."""
from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request

from common.api_generation import Generation, Job, stream
from common.api_protocol import CompletionChoice, CompletionRequest, CompletionResponse, parse_request
from common.api_state import ServerState, admitted_body, body_schema, server_state

router = APIRouter()


def prepare_completion(state: ServerState, raw: bytes) -> Job:
    """Body bytes -> a Job: checked, each prompt tokenized once (a prepare thread)."""
    req = parse_request(CompletionRequest, raw, state.limits.max_depth)
    state.check_model(req.model)
    prompts = req.prompts()
    job = Job([], [], req.stream, bool(req.stream_options and req.stream_options.include_usage))
    for k, p in enumerate(prompts):
        ids = state.prompt_ids(p, "prompt" if len(prompts) == 1 else f"prompt[{k}]")
        job.prompts += [ids] * req.n
        job.params += state.choice_params(req, req.max_tokens, len(ids))
        job.echoes += [(p if isinstance(p, str) else state.tokenizer.decode(ids)) if req.echo else ""] * req.n
    return job


@router.post("/completions", response_model=CompletionResponse, openapi_extra=body_schema(CompletionRequest),
             summary="A completion; with stream: true, text_completion events (SSE)")
async def completions(request: Request, raw: bytes = Depends(admitted_body)):
    state = server_state(request)
    job = await state.prepare(prepare_completion, raw)
    gen, created = Generation(state, job, "cmpl"), int(time.time())

    def answer(choices: list[tuple], usage=None) -> CompletionResponse:    # (index, text, finish_reason)
        return CompletionResponse(id=gen.id, created=created, model=state.model_name, usage=usage, choices=[
            CompletionChoice(index=i, text=text, finish_reason=finish) for i, text, finish in choices])

    if not job.stream:
        await gen.run_to_end(request)
        return answer([(c.index, job.echoes[c.index] + c.text, c.finish_reason) for c in gen.choices], gen.usage())
    first = [answer([(c.index, job.echoes[c.index], None)]) for c in gen.choices if job.echoes[c.index]]
    return stream(gen, first, lambda c, text: [answer([(c.index, text, c.finish_reason)])] if (text or c.done) else [],
                  lambda usage: answer([], usage))
