"""What the routers share: the limits, the server state (all read from the model folder once),
and the dependencies of /v1: the API key, and a body under the size limit counted against
--max-concurrent."""
from __future__ import annotations

import asyncio
import dataclasses
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

from common.api_protocol import APIError, SamplingRequest, bad_request
from common.engine import check_prompt
from common.engine_loop import EngineLoop
from common.sampling import SamplingParams, generation_defaults


class Limits(BaseModel, strict=True):
    """What one request may ask for besides the protocol's bounds; each is checked before the work it protects."""
    max_body_bytes: PositiveInt = 4 * 2**20    # request body (--max-body-mb); more -> 413 before any parsing
    max_depth: PositiveInt = 64                # nesting of arrays/objects in the body; deeper -> 400
    max_concurrent: PositiveInt = 256          # generation requests served at once (--max-concurrent); more -> 429
    prepare_threads: PositiveInt = 2           # threads that parse, render and tokenize large bodies; bodies up
    small_body_bytes: PositiveInt = 64 * 2**10  # to this size have 2 of their own, never queued behind large ones


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
    tokenizer: Any = None                    # the rest is read from the model folder, once, in set_ready()
    template: Any = None
    sampling_defaults: dict = field(default_factory=dict)   # generation_config.json's sampling values
    max_ctx: int = 0
    vocab_size: int = 0
    stop_ids: set[int] = field(default_factory=set)  # ids that end a turn (not answer text)
    longest_token: int = 0                   # characters in the longest vocabulary entry (0: unknown)
    max_prompt_chars: int | None = None      # a longer text cannot fit the context (None: unknown)

    def set_ready(self, engine, tokenizer, template, folder, max_ctx: int | None = None) -> None:
        """Called once the engine is built (from the loading thread)."""
        self.tokenizer, self.template = tokenizer, template
        self.sampling_defaults = generation_defaults(Path(folder)) if folder else {}
        SamplingParams(**self.sampling_defaults)        # a bad generation_config.json fails here, not per request
        self.max_ctx = min(x for x in (getattr(engine, "max_ctx", 0), max_ctx) if x)
        config = getattr(engine, "config", None)
        self.vocab_size = getattr(config, "vocab_size", 0) or tokenizer.vocab_size
        self.stop_ids = set(tokenizer.eos_token_ids) | set(getattr(config, "eos_token_ids", []) or [])
        if getattr(tokenizer, "id_to_token", None) and tokenizer.vocab_size and self.max_ctx:
            # a token covers at most its longest entry's characters (added tokens included: Qwen3's is 128),
            # and the NFC a tokenizer may apply first shrinks a text by well under half, hence 2x
            self.longest_token = max(len(tokenizer.id_to_token(i) or "") for i in range(tokenizer.vocab_size))
            self.max_prompt_chars = 2 * self.longest_token * self.max_ctx
        self.loop = EngineLoop(engine)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r} "
                           "(GET /v1/models lists it)", param="model", code="model_not_found")

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """A prompt's token ids, or a 400 at `param` if it cannot fit: a text from its length before tokenizing."""
        if isinstance(prompt, str) and self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
            raise bad_request(f"the prompt has {len(prompt)} characters; a context of {self.max_ctx} tokens holds at "
                              f"most {self.max_prompt_chars} (a token covers at most {self.longest_token} characters); "
                              "shorten the prompt or start the server with a larger --max-ctx", param)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        try:
            check_prompt(ids, self.max_ctx, self.vocab_size)
        except ValueError as e:
            raise bad_request(str(e), param) from None
        return ids

    def choice_params(self, req: SamplingRequest, max_tokens: int | None, prompt_len: int) -> list[SamplingParams]:
        """req.n choices of one prompt: the request's fields over generation_config.json's; max_tokens at most
        the room the prompt leaves (all of it when unset, as in vLLM); seeds seed+i, each reproducible."""
        room = self.max_ctx - prompt_len
        p = SamplingParams.from_defaults(self.sampling_defaults, max_tokens=min(max_tokens or room, room),
                                         **req.sampling())
        return [dataclasses.replace(p, seed=None if p.seed is None else p.seed + i) for i in range(req.n)]

    async def prepare(self, fn: Callable[[ServerState, bytes], Any], raw: bytes):
        """fn(self, raw) on a prepare thread: its time grows with the body, and the event loop stays free."""
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
    """The body's bytes: 503 while loading, 413 as soon as it is known to be too large, before parsing.
    Once it has arrived it counts against --max-concurrent (429 past it) until its answer has ended,
    a stream included (FastAPI >= 0.118); a client still sending does not count, so half-sent
    connections cannot lock others out."""
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
    """The OpenAPI request body of an endpoint that reads its own bytes (not on the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}
