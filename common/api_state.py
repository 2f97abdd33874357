"""What the routers share: the limits, the server state, and the dependencies of /v1.

    require_api_key   the /v1 router's dependency: 401 with OpenAI's error body
    admitted_body     a generation endpoint's dependency: 503 while loading, 413 before
                      reading a body that is too large, then 429 past --max-concurrent;
                      the request counts until its answer (a stream included) has ended
    prepare()         runs an endpoint's prepare function on a prepare thread
"""
from __future__ import annotations

import asyncio
import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import ClientDisconnect

from common.api_protocol import APIError
from common.engine_loop import EngineLoop
from common.sampling import SamplingParams, generation_defaults


@dataclass
class Limits:
    """What one request may ask for, besides the bounds of the protocol models
    (common/api_protocol.py). Each is checked before the work it protects."""
    max_body_bytes: int = 4 * 2**20    # request body (--max-body-mb); more -> 413 before any parsing
    max_depth: int = 64                # nesting of arrays/objects in the body; deeper -> 400
    max_concurrent: int = 256          # generation requests served at once (--max-concurrent); more -> 429
    prepare_threads: int = 2           # threads that parse, render and tokenize large bodies ...
    small_body_bytes: int = 64 * 2**10  # ... and bodies up to this size have 2 threads of their own, so
                                        # a small request never queues behind large ones

    def __post_init__(self):
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")


@dataclass
class ServerState:
    model_name: str                          # the name clients send as "model"
    api_key: str | None = None
    aliases: set[str] = field(default_factory=set)   # other names accepted for the model
    limits: Limits = field(default_factory=Limits)
    loop: EngineLoop | None = None           # None while loading
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0                       # generation requests being served (event loop only)
    pools: dict[str, ThreadPoolExecutor] = field(default_factory=dict)   # prepare threads: "small", "large"
    # what the server derives from the model folder, all read once in set_ready():
    tokenizer: Any = None
    template: Any = None
    sampling_defaults: dict = field(default_factory=dict)   # generation_config.json's sampling values
    max_ctx: int = 0
    vocab_size: int = 0
    stop_ids: set[int] = field(default_factory=set)  # ids that end a turn (not answer text)
    longest_token: int = 0                   # characters in the longest vocabulary entry (0: unknown)

    @property
    def ready(self) -> bool:
        return self.loop is not None

    @property
    def max_prompt_chars(self) -> int | None:
        """More characters than this can never fit the context, whatever they are.

        A token covers at most `longest_token` characters of the text the tokenizer sees
        (a byte-level vocabulary entry has one character per byte, and a character is at
        least one byte). The tokenizer's normalizer may first compose characters (NFC);
        that shrinks a text by well under half, so twice the bound is safe."""
        if not (self.longest_token and self.max_ctx):
            return None
        return 2 * self.longest_token * self.max_ctx

    def set_ready(self, engine, tokenizer, template, folder, max_ctx: int | None = None) -> None:
        """Called once the engine is built (from the loading thread)."""
        self.tokenizer, self.template = tokenizer, template
        self.sampling_defaults = generation_defaults(Path(folder)) if folder else {}
        SamplingParams(**self.sampling_defaults)        # a bad generation_config.json fails here, not per request
        self.max_ctx = int(getattr(engine, "max_ctx", 0) or max_ctx)
        if max_ctx:
            self.max_ctx = min(self.max_ctx, max_ctx)
        config = getattr(engine, "config", None)
        self.vocab_size = getattr(config, "vocab_size", 0) or tokenizer.vocab_size
        self.stop_ids = set(tokenizer.eos_token_ids) | set(getattr(config, "eos_token_ids", []) or [])
        self.longest_token = longest_token(tokenizer)
        self.loop = EngineLoop(engine)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r} "
                           "(GET /v1/models lists it)", param="model", code="model_not_found")


def longest_token(tokenizer) -> int:
    """Characters in the longest vocabulary entry, added tokens included (Qwen3: 128,
    a run of spaces); 0 when the tokenizer cannot list its vocabulary."""
    id_to_token, size = getattr(tokenizer, "id_to_token", None), getattr(tokenizer, "vocab_size", 0)
    if id_to_token is None or not size:
        return 0
    return max(len(id_to_token(i) or "") for i in range(size))


def server_state(request: Request) -> ServerState:
    return request.app.state.server


_bearer = HTTPBearer(auto_error=False)     # our own 401: FastAPI's would be a 403 {"detail"} on older versions


async def require_api_key(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)):
    key = server_state(request).api_key
    if key and not (credentials and hmac.compare_digest(credentials.credentials.encode(), key.encode())):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' with the key the "
                       "server was started with (--api-key)", type="authentication_error", code="invalid_api_key")


async def admitted_body(request: Request) -> AsyncIterator[bytes]:
    """The body's bytes, refused with 413 as soon as it is known to be too large (from
    Content-Length, or while reading a chunked body), before anything is parsed. Once
    it has arrived the request counts against --max-concurrent (429 past it) until its
    answer has ended: this dependency's exit runs after the response, a stream included
    (FastAPI >= 0.118). A client still sending its body does not count, so stalled
    half-sent connections cannot lock others out. All counting is on the event loop."""
    state = server_state(request)
    if not state.ready:
        raise APIError(503, state.load_error or "the model is still loading; retry when GET /healthz says 200",
                       type="service_unavailable", code="model_loading")
    limit = state.limits.max_body_bytes

    def too_large(size: str) -> APIError:
        return APIError(413, f"the request body is {size} bytes; this server takes at most {limit} "
                        "(--max-body-mb): send a shorter prompt", code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(f"more than {limit}")
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client closed the connection while sending the body") from None
    if state.in_flight >= state.limits.max_concurrent:
        raise APIError(429, f"the server is already serving {state.limits.max_concurrent} requests, its limit "
                       "(--max-concurrent); retry in a moment", type="rate_limit_error", code="too_many_requests")
    state.in_flight += 1
    try:
        yield b"".join(chunks)
    finally:
        state.in_flight -= 1


async def prepare(state: ServerState, fn: Callable[[ServerState, bytes], Any], raw: bytes):
    """fn(state, raw) on a prepare thread: parsing, checking, rendering and tokenizing cost
    time that grows with the body, and the event loop must stay free for everyone else."""
    pool = state.pools["small" if len(raw) <= state.limits.small_body_bytes else "large"]
    return await asyncio.get_running_loop().run_in_executor(pool, fn, state, raw)


def body_schema(model) -> dict:
    """The OpenAPI request body of an endpoint that reads its bytes itself (so that FastAPI
    does not parse them on the event loop): the model's schema, by reference."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}
