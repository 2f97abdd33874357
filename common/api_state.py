"""What the routers share: the limits, the server state, and the dependencies of /v1
(the API key; a generation's body under the size limit, counted against --max-concurrent)."""
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
from pydantic import BaseModel, PositiveInt
from starlette.requests import ClientDisconnect

from common.api_protocol import APIError
from common.engine_loop import EngineLoop
from common.sampling import SamplingParams, generation_defaults


class Limits(BaseModel, strict=True):
    """What one request may ask for, besides the bounds of the protocol models; each is
    checked before the work it protects."""
    max_body_bytes: PositiveInt = 4 * 2**20    # request body (--max-body-mb); more -> 413 before any parsing
    max_depth: PositiveInt = 64                # nesting of arrays/objects in the body; deeper -> 400
    max_concurrent: PositiveInt = 256          # generation requests served at once (--max-concurrent); more -> 429
    prepare_threads: PositiveInt = 2           # threads that parse, render and tokenize large bodies ...
    small_body_bytes: PositiveInt = 64 * 2**10  # ... and bodies up to this size have 2 threads of their own,
                                                # so a small request never queues behind large ones


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
    def max_prompt_chars(self) -> int | None:
        """More characters than this never fit the context: a token covers at most
        `longest_token` characters (a byte-level entry has one per byte), and the NFC a
        tokenizer may apply first shrinks a text by well under half, hence the factor 2."""
        return 2 * self.longest_token * self.max_ctx if self.longest_token and self.max_ctx else None

    def set_ready(self, engine, tokenizer, template, folder, max_ctx: int | None = None) -> None:
        """Called once the engine is built (from the loading thread)."""
        self.tokenizer, self.template = tokenizer, template
        self.sampling_defaults = generation_defaults(Path(folder)) if folder else {}
        SamplingParams(**self.sampling_defaults)        # a bad generation_config.json fails here, not per request
        self.max_ctx = min(x for x in (getattr(engine, "max_ctx", 0), max_ctx) if x)
        config = getattr(engine, "config", None)
        self.vocab_size = getattr(config, "vocab_size", 0) or tokenizer.vocab_size
        self.stop_ids = set(tokenizer.eos_token_ids) | set(getattr(config, "eos_token_ids", []) or [])
        if getattr(tokenizer, "id_to_token", None) and tokenizer.vocab_size:   # added tokens included (Qwen3: 128)
            self.longest_token = max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size))
        self.loop = EngineLoop(engine)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r} "
                           "(GET /v1/models lists it)", param="model", code="model_not_found")

    async def prepare(self, fn: Callable[[ServerState, bytes], Any], raw: bytes):
        """fn(self, raw) on a prepare thread: parsing, rendering and tokenizing take time that
        grows with the body, and the event loop must stay free for everyone else."""
        pool = self.pools["small" if len(raw) <= self.limits.small_body_bytes else "large"]
        return await asyncio.get_running_loop().run_in_executor(pool, fn, self, raw)


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def require_api_key(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(
        HTTPBearer(auto_error=False))):      # our own 401: older FastAPI would answer 403 {"detail"}
    key = server_state(request).api_key
    if key and not (credentials and hmac.compare_digest(credentials.credentials.encode(), key.encode())):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' with the key the "
                       "server was started with (--api-key)", type="authentication_error", code="invalid_api_key")


async def admitted_body(request: Request) -> AsyncIterator[bytes]:
    """The body's bytes: 503 while loading, 413 as soon as the body is known to be too large
    (from Content-Length, or while reading it), before anything is parsed. Once it has
    arrived, the request counts against --max-concurrent (429 past it) until its answer has
    ended, a stream included (this exit runs after the response, FastAPI >= 0.118); a client
    still sending does not count, so half-sent connections cannot lock others out."""
    state = server_state(request)
    if state.loop is None:
        raise APIError(503, state.load_error or "the model is still loading; retry when GET /healthz says 200",
                       type="service_unavailable", code="model_loading")
    limit, declared, chunks, size = state.limits.max_body_bytes, request.headers.get("content-length", ""), [], 0

    def too_large(size: str) -> APIError:
        return APIError(413, f"the request body is {size} bytes; this server takes at most {limit} "
                        "(--max-body-mb): send a shorter prompt", code="request_too_large")

    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
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


def body_schema(model) -> dict:
    """The OpenAPI request body of an endpoint that reads its bytes itself (so that FastAPI
    does not parse them on the event loop): the model's schema, by reference."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}
