"""What both generation endpoints share: a Job (made on a prepare thread), a Generation that
submits it to the engine loop and yields (choice, new text), and stream(), their SSE answer."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from common.api_protocol import APIError, Usage, bad_request
from common.engine import Request, TokenEvent
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
    parser: Callable[[], StreamParser] | None = None   # chat: a <think>/<tool_call> parser per choice
    echoes: list[str] = field(default_factory=list)   # completions: text to put before each choice


class Choice:
    """One engine request: ids -> text (detokenizer) -> text before any stop string."""

    def __init__(self, index: int, request_id: str, prompt_ids: list[int], params: SamplingParams, state, parser):
        self.index, self.id, self.prompt_ids, self.params = index, request_id, prompt_ids, params
        self.detok, self.stopper = state.tokenizer.detokenizer(), StopChecker(params.stop)
        self.stop_ids = set(params.stop_token_ids) | state.stop_ids
        self.n_tokens, self.finish_reason, self.text = 0, None, ""   # text: all returned so far
        self.parser: StreamParser | None = parser() if parser else None

    done = property(lambda self: self.finish_reason is not None)

    def on_event(self, ev: TokenEvent) -> str:
        """One engine event -> the new text that is safe to return."""
        text = ""
        if ev.token_id >= 0:
            self.n_tokens += 1
            if not (ev.finish_reason == "stop" and ev.token_id in self.stop_ids):   # <|im_end|> is no text
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
        self.state, self.job, self.id = state, job, f"{prefix}-{uuid.uuid4().hex}"
        self.queue: asyncio.Queue = asyncio.Queue()
        loop, base = asyncio.get_running_loop(), uuid.uuid4().hex[:16]

        def sink(item):      # called on the engine thread: call_soon_threadsafe is the safe way in
            with contextlib.suppress(RuntimeError):       # the event loop is closed: shutting down
                loop.call_soon_threadsafe(self.queue.put_nowait, item)

        self.choices = [Choice(i, f"{base}-{i}", ids, p, state, job.parser)
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

    def usage(self) -> Usage:      # a prompt shared by n choices counts once
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


def stream(gen: Generation, first: Iterable[BaseModel], pieces: Callable[[Choice, str], Iterable[BaseModel]],
           usage_chunk: Callable[[Usage], BaseModel]) -> EventStream:
    """An SSE answer: the `first` chunks, then pieces(choice, new_text) as text arrives, the usage
    chunk when asked for, and [DONE]. An engine error ends it as an error event."""
    async def events():
        for chunk in first:
            yield f"data: {chunk.model_dump_json()}\n\n"
        try:
            async for c, text in gen.events():
                for chunk in pieces(c, text):
                    yield f"data: {chunk.model_dump_json()}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body, ensure_ascii=False)}\n\n"
        if gen.job.include_usage:
            yield f"data: {usage_chunk(gen.usage()).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    return EventStream(events(), media_type="text/event-stream", background=BackgroundTask(gen.close),
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class EventStream(StreamingResponse):
    """SSE that notices a client leaving even while no token is ready (a queued request can wait
    long), and always runs its background task (gen.close: the engine aborts what nobody wants)."""

    async def __call__(self, scope, receive, send):
        try:
            sent = await until_disconnect(self.stream_response(send), receive)
            error = None if sent.cancelled() else sent.exception()
            if error is not None and not isinstance(error, OSError):   # OSError: the client closed the socket
                log.error("streaming a response failed: %r", error)
        finally:
            await self.body_iterator.aclose()    # a generator cut short runs its cleanup now
            await self.background()
