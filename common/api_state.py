"""What the routers share: the limits, the server state (read from the model folder once), the
dependencies of /v1 (the API key; a body under the size limit, counted against --max-concurrent),
and a generation: its choices (made on a prepare thread) submitted to the engine loop, yielding
(choice, new text), answered whole or as SSE by stream()."""
import asyncio
import contextlib
import functools
import hmac
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Any, AsyncIterator, Callable, Iterable

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, PositiveInt
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse

from common.api_protocol import APIError, Reply, SamplingRequest, Usage, bad_request
from common.engine import Request as EngineRequest, check_prompt
from common.engine_loop import EngineLoop
from common.parsing import StreamParser
from common.sampling import SamplingParams, generation_defaults
from common.stopping import AnswerText

class Limits(BaseModel, strict=True):
    """What one request may ask for besides the protocol's bounds; each is checked before the work
    it protects."""
    # request body (--max-body-mb); more -> 413 before any parsing
    max_body_bytes: PositiveInt = 4 * 2**20
    # nesting of arrays/objects in the body; deeper -> 400
    max_depth: PositiveInt = 64
    # generation requests served at once (--max-concurrent); more -> 429
    max_concurrent: PositiveInt = 256
    # threads that parse, render and tokenize large bodies; bodies up to small_body_bytes have
    # 2 of their own, never queued behind large ones
    prepare_threads: PositiveInt = 2
    small_body_bytes: PositiveInt = 64 * 2**10

@dataclass
class ServerState:
    model_name: str                          # the name clients send as "model"
    api_key: str | None = None
    aliases: set[str] = field(default_factory=set)   # other names accepted for the model
    limits: Limits = field(default_factory=Limits)
    # None while loading; with --engine-process an EngineProcess
    loop: EngineLoop | None = None
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0                       # generation requests being served (event loop only)
    # prepare threads: "small", "large"
    pools: dict[str, ThreadPoolExecutor] = field(default_factory=dict)
    # the rest is read from the model folder, once, in set_ready()
    tokenizer: Any = None
    template: Any = None
    # generation_config.json's sampling values
    sampling_defaults: dict = field(default_factory=dict)
    max_ctx: int = 0
    vocab_size: int = 0
    # characters in the longest vocabulary entry (0: unknown)
    longest_token: int = 0
    max_prompt_chars: int | None = None      # a longer text cannot fit the context (None: unknown)

    def set_ready(self, engine, tokenizer, template, folder, max_ctx: int | None = None) -> None:
        """Called once the engine is built (from the loading thread)."""
        self.tokenizer, self.template = tokenizer, template
        self.sampling_defaults = generation_defaults(folder)     # {} without a folder or its file
        # a bad generation_config.json fails here, not per request
        SamplingParams(**self.sampling_defaults)
        self.max_ctx = min(x for x in (getattr(engine, "max_ctx", 0), max_ctx) if x)
        self.vocab_size = (getattr(getattr(engine, "config", None), "vocab_size", 0)
                           or tokenizer.vocab_size)
        if getattr(tokenizer, "id_to_token", None) and tokenizer.vocab_size and self.max_ctx:
            # a token covers at most its longest entry's characters (added tokens included: Qwen3's
            # is 128), and the NFC a tokenizer may apply first shrinks a text by well under half,
            # hence 2x
            self.longest_token = max(len(tokenizer.id_to_token(i) or "")
                                     for i in range(tokenizer.vocab_size))
            self.max_prompt_chars = 2 * self.longest_token * self.max_ctx
        # an EngineProcess is one already
        self.loop = engine if hasattr(engine, "submit") else EngineLoop(engine)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r} (GET /v1/models lists it)", param="model",
                           code="model_not_found")

async def require_api_key(request: Request,
                          credentials: HTTPAuthorizationCredentials | None = Depends(
                              # our own 401: older FastAPI would answer 403 {"detail"}
                              HTTPBearer(auto_error=False))):
    key = request.app.state.server.api_key
    if key and not (credentials and hmac.compare_digest(credentials.credentials.encode(),
                                                        key.encode())):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' with "
                       "the key the server was started with (--api-key)",
                       type="authentication_error", code="invalid_api_key")

async def admitted_body(request: Request) -> AsyncIterator[bytes]:
    """The body's bytes (503 while loading; 413 as soon as it is known to be too large). Once it has
    arrived it counts against --max-concurrent (429) until its answer has ended, a stream included
    (FastAPI >= 0.118)."""
    state = request.app.state.server
    if state.loop is None:
        raise APIError(503, state.load_error
                       or "the model is still loading; retry when GET /healthz says 200",
                       type="service_unavailable", code="model_loading")
    limit, declared, body = (state.limits.max_body_bytes, request.headers.get("content-length", ""),
                             bytearray())
    def too_large(size: str) -> APIError:
        return APIError(413, f"the request body is {size} bytes; this server takes at most {limit} "
                        "(--max-body-mb): send a shorter prompt", code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large(f"more than {limit}")
    except ClientDisconnect:
        raise APIError(400, "the client closed the connection while sending the body") from None
    if state.in_flight >= state.limits.max_concurrent:
        raise APIError(429, f"the server is already serving {state.limits.max_concurrent} "
                       "requests, its limit (--max-concurrent); retry in a moment",
                       type="rate_limit_error", code="too_many_requests")
    state.in_flight += 1
    try:
        yield bytes(body)
    finally:
        state.in_flight -= 1

def body_schema(model) -> dict:
    """The OpenAPI request body of an endpoint that reads its own bytes (not on the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}

class Choice(AnswerText):
    """One engine request of a generation: its prompt and sampling, and its answer so far
    (AnswerText)."""
    def __init__(self, index: int, prompt_ids: list[int], params: SamplingParams, tokenizer,
                 parser, echo: str):
        super().__init__(tokenizer.detokenizer(), params.stop)
        self.index, self.id, self.prompt_ids, self.params = (index, uuid.uuid4().hex,
                                                             prompt_ids, params)
        self.parser: StreamParser | None = parser() if parser else None
        self.echo = echo                     # completions: the text shown before the answer

class Generation:
    """A request's choices (made on a prepare thread); start() submits them, events() yields
    (choice, new text)."""
    def __init__(self, state: ServerState, req: SamplingRequest,
                 prompts: dict[str, str | list[int]], max_tokens: int | None, prefix: str,
                 parser: Callable[[], StreamParser] | None = None, echo: bool = False):
        """req.n choices per prompt ({param: text or ids}), each tokenized once; a 400 at its param
        if it cannot fit (a text judged by its length first). Sampling: the request's SamplingParams
        fields over generation_config.json's; max_tokens at most the room the prompt leaves
        (unset: generation_config.json's max_new_tokens, else all of the room, as vLLM); seeds
        seed+i, reproducible."""
        self.state, self.stream, self.choices = state, req.stream, []
        self.include_usage = bool(req.stream_options and req.stream_options.include_usage)
        self.id, self.created, self.queue = (f"{prefix}-{uuid.uuid4().hex}", int(time.time()),
                                             asyncio.Queue())
        asked = req.model_dump(include={f.name for f in fields(SamplingParams)} - {"max_tokens"})
        for param, prompt in prompts.items():
            if (isinstance(prompt, str) and state.max_prompt_chars is not None
                    and len(prompt) > state.max_prompt_chars):
                raise bad_request(f"the prompt has {len(prompt)} characters; a context of "
                                  f"{state.max_ctx} tokens holds at most {state.max_prompt_chars} "
                                  f"(a token covers at most {state.longest_token} characters); "
                                  "shorten the prompt or start the server with a larger --max-ctx",
                                  param)
            ids = state.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            try:
                check_prompt(ids, state.max_ctx, state.vocab_size)
            except ValueError as e:
                raise bad_request(str(e), param) from None
            room = state.max_ctx - len(ids)
            # the request's max_tokens, else the model's max_new_tokens, else the room
            wanted = max_tokens or state.sampling_defaults.get("max_tokens") or room
            p = SamplingParams.from_defaults(state.sampling_defaults, max_tokens=min(wanted, room),
                                             **asked)
            shown = ((prompt if isinstance(prompt, str) else state.tokenizer.decode(ids))
                     if echo else "")
            self.choices += [Choice(len(self.choices) + i, ids,
                                    replace(p, seed=None if p.seed is None else p.seed + i),
                                    state.tokenizer, parser, shown) for i in range(req.n)]

    @classmethod
    async def start(cls, request: Request, raw: bytes,
                    prepare: Callable[[ServerState, bytes], "Generation"]) -> "Generation":
        """prepare(state, raw) on a prepare thread (its time grows with the body; the event loop
        stays free), then its choices submitted, each with a sink that puts (choice, event) on the
        queue."""
        state, loop = request.app.state.server, asyncio.get_running_loop()
        pool = state.pools["small" if len(raw) <= state.limits.small_body_bytes else "large"]
        gen = await loop.run_in_executor(pool, prepare, state, raw)

        # called on the engine thread: call_soon_threadsafe is the safe way in
        def sink(c: Choice, item):
            with contextlib.suppress(RuntimeError):       # the event loop is closed: shutting down
                loop.call_soon_threadsafe(gen.queue.put_nowait, (c, item))

        for c in gen.choices:
            state.loop.submit(EngineRequest(c.id, c.prompt_ids, c.params),
                              functools.partial(sink, c))
        return gen

    # a reply or chunk of this generation (its "object")
    def reply(self, kind: str, **fields) -> Reply:
        return Reply(id=self.id, object=kind, created=self.created, model=self.state.model_name,
                     **fields)

    async def events(self):
        while not all(c.done for c in self.choices):
            c, item = await self.queue.get()
            if isinstance(item, APIError):
                raise item
            if isinstance(item, ValueError):
                raise bad_request(str(item))
            if isinstance(item, Exception):
                raise APIError(500, str(item), type="server_error")
            if not c.done:
                text = c.feed(item)
                if c.done and item.finish_reason is None:
                    self.state.loop.abort(c.id)   # a stop string ended it: the engine would go on
                yield c, text

    def close(self) -> None:
        """The client is gone (or an error): abort what still runs, so nothing leaks."""
        for c in self.choices:
            if not c.done:
                c.finish_reason = "abort"
                self.state.loop.abort(c.id)

    def usage(self) -> Usage:
        # a prompt of n choices counts once
        firsts = {tuple(c.prompt_ids): c for c in reversed(self.choices)}
        prompt, completion = sum(map(len, firsts)), sum(c.n_tokens for c in self.choices)
        usage = Usage(prompt_tokens=prompt, completion_tokens=completion,
                      total_tokens=prompt + completion)
        # an engine with a prefix cache
        cached = getattr(self.state.loop.engine, "num_cached_tokens", None)
        if cached is not None:
            usage.prompt_tokens_details = {
                "cached_tokens": sum(cached(c.id) for c in firsts.values())}
        # an engine with speculative decoding
        spec = getattr(self.state.loop.engine, "speculation", None)
        if spec is not None and (runs := [s for s in map(spec, (c.id for c in self.choices))
                                          if s is not None]):
            usage.speculative_decoding = sum(runs[1:], runs[0]).usage()
        return usage

    async def run_to_end(self, request: Request, on_text: Callable = lambda c, text: None) -> None:
        """Drive a non-streaming generation; a disconnect first ends it with an error nobody
        reads."""
        async def watch():       # the body was read, so the next message is the disconnect
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.queue.put_nowait((None, APIError(
                400, "the client closed the connection before the answer was ready")))

        watcher = asyncio.ensure_future(watch())
        try:
            async for c, text in self.events():
                on_text(c, text)
        finally:
            watcher.cancel()
            # aborts whatever has not finished (client gone, or an error in one choice)
            self.close()

def stream(gen: Generation, kind: str, first: Iterable[Reply],
           pieces: Callable[[Choice, str], Iterable[Reply]]) -> StreamingResponse:
    """An SSE answer of `kind` chunks: the `first` ones, then pieces(choice, new_text) as text
    arrives, the usage chunk when asked for, and [DONE]; an engine error ends it as an error event.
    Starlette cancels it when the client disconnects, even while no token is ready (it listens under
    uvicorn's ASGI 2.3); gen.close() aborts the rest."""
    async def events():
        try:
            for chunk in first:
                yield f"data: {chunk.model_dump_json()}\n\n"
            try:
                async for c, text in gen.events():
                    for chunk in pieces(c, text):
                        yield f"data: {chunk.model_dump_json()}\n\n"
            except APIError as e:
                yield f"data: {json.dumps(e.body, ensure_ascii=False)}\n\n"
            if gen.include_usage:
                yield ("data: "
                       f"{gen.reply(kind, choices=[], usage=gen.usage()).model_dump_json()}\n\n")
            yield "data: [DONE]\n\n"
        finally:
            gen.close()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
