"""What both generation endpoints share: a Job (token ids + SamplingParams per choice, made
on a prepare thread); a Generation, which submits them to the engine loop and yields
(choice, new text); and stream(), the SSE answer of both endpoints.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from common.api_protocol import APIError, SamplingRequest, Usage, bad_request
from common.engine import Request, TokenEvent, check_prompt
from common.parsing import StreamParser
from common.sampling import SamplingParams
from common.stopping import StopChecker

log = logging.getLogger("qwen3-stages.server")


@dataclass
class Job:
    """A request ready for the engine: token ids and sampling parameters per choice."""
    prompts: list[list[int]]                 # the token ids of each choice's prompt
    params: list[SamplingParams]             # one per choice
    stream: bool = False
    include_usage: bool = False
    thinking: bool = True                    # chat: the <think> parser is on
    tools: list[dict] | None = None          # chat: tools given, so <tool_call> is parsed
    opens_think: bool = False                # chat: the prompt ends inside <think>
    echoes: list[str] = field(default_factory=list)   # completions: text to put before each choice


def prompt_ids(state, prompt: str | list[int], param: str) -> list[int]:
    """A prompt's token ids, refused (400 at `param`) if it cannot fit the context: a text
    from its length alone before it is tokenized, then its ids."""
    bound = state.max_prompt_chars
    if isinstance(prompt, str) and bound is not None and len(prompt) > bound:
        raise bad_request(f"the prompt has {len(prompt)} characters; a context of {state.max_ctx} tokens holds at "
                          f"most {bound} (a token covers at most {state.longest_token} characters); shorten the "
                          "prompt or start the server with a larger --max-ctx", param)
    ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    try:
        check_prompt(ids, state.max_ctx, state.vocab_size)
    except ValueError as e:
        raise bad_request(str(e), param) from None
    return ids


def choice_params(state, req: SamplingRequest, max_tokens: int | None, prompt_len: int) -> list[SamplingParams]:
    """req.n choices of one prompt: the request's sampling fields over generation_config.json's
    defaults (read once, at start-up); max_tokens at most the room the prompt leaves (all of it
    when unset, as in vLLM); seeds seed+i, so each choice differs yet all are reproducible."""
    room = state.max_ctx - prompt_len
    p = SamplingParams.from_defaults(state.sampling_defaults, max_tokens=min(max_tokens or room, room),
                                     **req.sampling())
    return [dataclasses.replace(p, seed=None if p.seed is None else p.seed + i) for i in range(req.n)]


class Choice:
    """One engine request: ids -> text (detokenizer) -> text before any stop string."""

    def __init__(self, index: int, request_id: str, prompt_ids: list[int], params: SamplingParams, state):
        self.index, self.id, self.prompt_ids, self.params = index, request_id, prompt_ids, params
        self.detok = state.tokenizer.detokenizer()
        self.stopper = StopChecker(params.stop)
        self.stop_ids = set(params.stop_token_ids) | state.stop_ids
        self.n_tokens = 0
        self.finish_reason: str | None = None
        self.text = ""              # all text returned so far (for non-streaming replies)
        self.parser: StreamParser | None = None   # chat only

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def on_event(self, ev: TokenEvent) -> str:
        """One engine event -> the new text that is safe to return."""
        text = ""
        if ev.token_id >= 0:
            self.n_tokens += 1
            # the id that ended the turn (<|im_end|>) is not answer text
            if not (ev.finish_reason == "stop" and ev.token_id in self.stop_ids):
                text = self.detok.add(ev.token_id)
        if ev.finish_reason is not None:
            text += self.detok.flush()
        out = self.stopper.feed(text)
        if self.stopper.stopped:
            self.finish_reason = "stop"
        elif ev.finish_reason is not None:
            out += self.stopper.flush()
            self.finish_reason = ev.finish_reason
        self.text += out
        return out


class Generation:
    """Submits a job's choices to the engine loop and yields (choice, new_text) as events arrive."""

    def __init__(self, state, job: Job, prefix: str):
        self.state, self.job = state, job
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(item):      # called on the engine thread: call_soon_threadsafe is the safe way in
            with contextlib.suppress(RuntimeError):       # the event loop is closed: shutting down
                loop.call_soon_threadsafe(self.queue.put_nowait, item)

        base = uuid.uuid4().hex[:16]
        self.choices = [Choice(i, f"{base}-{i}", ids, p, state)
                        for i, (ids, p) in enumerate(zip(job.prompts, job.params))]
        self.by_id = {c.id: c for c in self.choices}
        for c in self.choices:
            state.loop.submit(Request(c.id, c.prompt_ids, c.params), sink)

    async def events(self):
        while not all(c.done for c in self.choices):
            item = await self.queue.get()
            if isinstance(item, ValueError):
                raise bad_request(str(item))
            if isinstance(item, Exception):
                raise APIError(500, str(item), type="server_error")
            c = self.by_id.get(item.request_id)
            if c is None or c.done:
                continue
            text = c.on_event(item)
            if c.stopper.stopped and item.finish_reason is None:
                self.state.loop.abort(c.id)   # a stop string ended it: the engine would go on
            yield c, text

    def close(self) -> None:
        """The client is gone (or an error): abort what still runs, so nothing leaks."""
        for c in self.choices:
            if not c.done:
                c.finish_reason = "abort"
                self.state.loop.abort(c.id)

    def usage(self) -> Usage:
        prompt = sum(len(ids) for ids in dict.fromkeys(tuple(c.prompt_ids) for c in self.choices))
        completion = sum(c.n_tokens for c in self.choices)
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        cached = getattr(self.state.loop.engine, "num_cached_tokens", None)   # an engine with a prefix cache
        if cached is not None:
            firsts = {tuple(c.prompt_ids): c.id for c in reversed(self.choices)}   # one choice per prompt
            usage.prompt_tokens_details = {"cached_tokens": sum(cached(i) for i in firsts.values())}
        return usage

    async def run_to_end(self, request, on_text: Callable | None = None) -> None:
        """Drive a non-streaming generation; abort it if the client disconnects first."""
        async def drive():
            async for c, text in self.events():
                if on_text:
                    on_text(c, text)
        try:
            work = await until_disconnect(drive(), request.receive)
        finally:
            self.close()     # aborts whatever has not finished (client gone, or an error in one choice)
        if work.cancelled():     # nobody reads this reply; it only ends the handler
            raise APIError(400, "the client closed the connection before the answer was ready")
        work.result()        # re-raise an engine error as the reply


async def until_disconnect(work, receive) -> asyncio.Task:
    """Runs `work` until it ends or the client disconnects (then it is cancelled); its task."""
    async def disconnected():    # the body was read, so the next message is the disconnect
        while (await receive())["type"] != "http.disconnect":
            pass

    tasks = task, _ = [asyncio.ensure_future(work), asyncio.ensure_future(disconnected())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return task


# ---- streaming: one helper for both endpoints ----
def _sse(obj: BaseModel | dict) -> str:
    text = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj, ensure_ascii=False)
    return f"data: {text}\n\n"


def stream(gen: Generation, first: Iterable[BaseModel], pieces: Callable[[Choice, str], Iterable[BaseModel]],
           usage_chunk: Callable[[Usage], BaseModel]) -> "EventStream":
    """An SSE answer: the `first` chunks, then pieces(choice, new_text) as text arrives,
    the usage chunk when asked for, and [DONE]. An engine error ends it as an error event."""
    async def events():
        for chunk in first:
            yield _sse(chunk)
        try:
            async for c, text in gen.events():
                for chunk in pieces(c, text):
                    yield _sse(chunk)
        except APIError as e:
            yield _sse(e.body())
        if gen.job.include_usage:
            yield _sse(usage_chunk(gen.usage()))
        yield "data: [DONE]\n\n"

    return EventStream(events(), background=BackgroundTask(gen.close))


class EventStream(StreamingResponse):
    """SSE that notices a client leaving even while no token is ready (a queued request in a
    FIFO engine can wait a long time), and always runs its background task (gen.close: the
    engine aborts what the client no longer wants)."""

    def __init__(self, content, background: BackgroundTask):
        super().__init__(content, media_type="text/event-stream", background=background,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        try:
            sent = await until_disconnect(self.stream_response(send), receive)
            error = None if sent.cancelled() else sent.exception()
            if error is not None and not isinstance(error, OSError):   # OSError: the client closed the socket
                log.error("streaming a response failed: %r", error)
        finally:
            await self.body_iterator.aclose()    # a generator cut short runs its cleanup now
            await self.background()
