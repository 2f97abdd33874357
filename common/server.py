"""An OpenAI-compatible HTTP server over any engine.

The outer layer of the design: HTTP and JSON in, token ids to the engine, token
ids back, text and JSON out. The engine never sees text and never sees a thread
other than its own:

    HTTP handlers (asyncio)                 engine thread (EngineLoop)
    -----------------------                 --------------------------
    render template, tokenize
    submit(Request) ----- command queue --> engine.add_request()
                                            while engine.has_work():
                                                events = engine.step()
    per-request asyncio.Queue <------------ call_soon_threadsafe(put, event)
    detokenize, stop strings,
    <think>/<tool_call> parsing, SSE
    client gone -> abort(id) -- queue ----> engine.abort()

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /healthz (503 while the model loads, 200 when ready). Errors use OpenAI's
body: {"error": {"message", "type", "param", "code"}}.

Each stage's serve.py only builds its engine and calls main().
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from common.engine import Request, TokenEvent, check_prompt
from common.parsing import Delta, StreamParser, prompt_opens_think
from common.sampling import SamplingParams
from common.stopping import StopChecker

log = logging.getLogger("qwen3-stages.server")


# ============================================================================
# Errors in OpenAI's shape
# ============================================================================
class APIError(Exception):
    """An error the client caused (or a state it must wait out); becomes an HTTP reply."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# ============================================================================
# The engine thread
# ============================================================================
class _Sink:
    """Where one HTTP request's token events go: an asyncio.Queue on the server's
    event loop, filled from the engine thread (call_soon_threadsafe is the only
    safe way to touch an asyncio object from another thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def put(self, item: TokenEvent | Exception) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass      # the event loop is closed: the server is shutting down


class EngineLoop:
    """Owns the engine: every engine call happens on this one thread.

    Handlers hand it work through submit() / abort(), which only append to a
    list under a lock and wake the thread; the thread adds and aborts requests
    between steps, runs step() while the engine has work, and sleeps on the
    condition when it has none."""

    def __init__(self, engine):
        self.engine = engine
        self.cond = threading.Condition()
        self._adds: list[tuple[Request, _Sink]] = []
        self._aborts: list[str] = []
        self._stop = False
        self.sinks: dict[str, _Sink] = {}   # requests in the engine (engine thread only)
        self.busy = False                    # the engine had work after the last step
        self.aborts_sent = 0                 # engine.abort() calls, for tests and logs
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    # ---- called from the HTTP side (any thread) ----
    def submit(self, req: Request, sink: _Sink) -> None:
        with self.cond:
            self._adds.append((req, sink))
            self.cond.notify()

    def abort(self, request_id: str) -> None:
        with self.cond:
            self._aborts.append(request_id)
            self.cond.notify()

    def idle(self) -> bool:
        """No request queued here or in the engine (for tests and /healthz details)."""
        with self.cond:
            return not (self._adds or self._aborts or self.sinks or self.busy)

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify()
        self.thread.join(timeout=10)

    # ---- the engine thread ----
    def _run(self) -> None:
        while True:
            with self.cond:
                while not (self._adds or self._aborts or self._stop or self.busy):
                    self.cond.wait()
                if self._stop:
                    return
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            for req, sink in adds:
                try:
                    self.engine.add_request(req)
                    self.sinks[req.id] = sink
                except Exception as e:       # ValueError: a prompt the engine cannot take
                    sink.put(e)
            for rid in aborts:
                # only requests still in the engine: a finished one has nothing to free
                if self.sinks.pop(rid, None) is not None:
                    self.engine.abort(rid)
                    self.aborts_sent += 1
            try:
                events = self.engine.step() if self.engine.has_work() else []
            except Exception as e:
                # a bug or an out-of-memory in the engine: fail the requests in flight,
                # drop them from the engine, and keep serving
                log.exception("engine step failed")
                for rid, sink in list(self.sinks.items()):
                    sink.put(RuntimeError(f"the engine failed: {type(e).__name__}: {e}"))
                    try:
                        self.engine.abort(rid)
                    except Exception:
                        pass
                self.sinks.clear()
                events = []
            for ev in events:
                sink = self.sinks.get(ev.request_id)
                if sink is None:
                    continue          # aborted by us already: nobody listens
                if ev.finish_reason is not None:
                    del self.sinks[ev.request_id]
                sink.put(ev)
            with self.cond:
                self.busy = self.engine.has_work()


# ============================================================================
# Server state: what the handlers share
# ============================================================================
@dataclass
class ServerState:
    model_name: str                          # the name clients send as "model"
    api_key: str | None = None
    aliases: set[str] = field(default_factory=set)   # other names accepted for the model
    loop: EngineLoop | None = None           # None while loading
    tokenizer: Any = None
    template: Any = None
    folder: Path | None = None
    max_ctx: int = 0
    vocab_size: int = 0
    stop_ids: set[int] = field(default_factory=set)  # ids that end a turn (not answer text)
    load_error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def ready(self) -> bool:
        return self.loop is not None

    def set_ready(self, engine, tokenizer, template, folder, max_ctx: int | None = None) -> None:
        """Called once the engine is built (from the loading thread)."""
        self.tokenizer, self.template, self.folder = tokenizer, template, Path(folder) if folder else None
        self.max_ctx = int(getattr(engine, "max_ctx", 0) or max_ctx)
        if max_ctx:
            self.max_ctx = min(self.max_ctx, max_ctx)
        config = getattr(engine, "config", None)
        self.vocab_size = getattr(config, "vocab_size", 0) or tokenizer.vocab_size
        self.stop_ids = set(tokenizer.eos_token_ids) | set(getattr(config, "eos_token_ids", []) or [])
        self.loop = EngineLoop(engine)

    def check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is None:
            return
        if not isinstance(name, str):
            raise bad_request("'model' must be a string", "model")
        if name != self.model_name and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r} "
                           "(GET /v1/models lists it)", param="model", code="model_not_found")


# ============================================================================
# Request validation (hand-written so every error is an OpenAI error with a clear message)
# ============================================================================
_NUMBER = (int, float)


def _get(body: dict, name: str, kinds: tuple, what: str, default=None):
    """body[name] if present and not null, checked against kinds (bool is never a number)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise bad_request(f"'{name}' must be {what}, got {json.dumps(value)}", name)
    if not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {what}, got {type(value).__name__} {json.dumps(value)[:50]}", name)
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    return stop


def sampling_params(state: ServerState, body: dict, prompt_len: int) -> SamplingParams:
    """The request's sampling fields over the model's generation_config.json defaults."""
    max_tokens = _get(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    room = state.max_ctx - prompt_len
    # without max_tokens, a request may use the rest of the context (as vLLM does);
    # with it, the context still caps the output
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    stop_ids = _get(body, "stop_token_ids", (list,), "a list of token ids", [])
    try:
        return SamplingParams.from_generation_config(
            state.folder,
            temperature=_get(body, "temperature", _NUMBER, "a number"),
            top_p=_get(body, "top_p", _NUMBER, "a number"),
            top_k=_get(body, "top_k", (int,), "an integer"),
            min_p=_get(body, "min_p", _NUMBER, "a number"),
            presence_penalty=_get(body, "presence_penalty", _NUMBER, "a number"),
            frequency_penalty=_get(body, "frequency_penalty", _NUMBER, "a number"),
            repetition_penalty=_get(body, "repetition_penalty", _NUMBER, "a number"),
            seed=_get(body, "seed", (int,), "an integer"),
            ignore_eos=_get(body, "ignore_eos", (bool,), "true or false"),
            max_tokens=max_tokens,
            stop=_stop_strings(body),
            stop_token_ids=list(stop_ids),
        )
    except ValueError as e:
        raise bad_request(str(e)) from None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n choices: n requests, seeds seed+i so each differs yet all are reproducible."""
    out = []
    for i in range(n):
        p = SamplingParams(**{**params.__dict__, "stop": list(params.stop),
                              "stop_token_ids": list(params.stop_token_ids)})
        if p.seed is not None:
            p.seed = p.seed + i
        out.append(p)
    return out


def _n(body: dict) -> int:
    n = _get(body, "n", (int,), "an integer", 1)
    if not 1 <= n <= 64:
        raise bad_request(f"'n' must be between 1 and 64, got {n}", "n")
    return n


def _reject_unsupported(body: dict) -> None:
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("logprobs are not supported by this server; leave 'logprobs' unset", "logprobs")


def _text_content(content, i: int) -> str:
    """A message's content: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                  "are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list of {role, content} objects", "messages")
    if not messages:
        raise bad_request("'messages' is empty: send at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if role == "developer":       # OpenAI's newer name for the system role
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role must be system, user, assistant or tool, got {role!r}",
                              "messages")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"], msg["content"] = role, _text_content(m.get("content"), i)
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be a list on an assistant message", "messages")
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"messages[{i}].tool_calls entries need function.name and "
                                      "function.arguments", "messages")
        out.append(msg)
    return out


def chat_tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if choice is None:
        choice = "auto"
    if choice not in ("none", "auto"):
        raise bad_request("tool_choice must be 'none' or 'auto' (forcing a tool is not supported)",
                          "tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise bad_request("'tools' must be a list of {'type': 'function', 'function': {'name': ...}}", "tools")
    return tools if (tools and choice == "auto") else None


# ============================================================================
# One generation: n engine requests, their text pipelines, one queue
# ============================================================================
class Choice:
    """One engine request: ids -> text (detokenizer) -> text before any stop string."""

    def __init__(self, index: int, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 state: ServerState):
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
    """Submits the choices to the engine loop and yields (choice, new_text) as events arrive."""

    def __init__(self, state: ServerState, prompts: list[list[int]], params: list[SamplingParams]):
        self.state = state
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sink = _Sink(asyncio.get_running_loop(), self.queue)
        base = uuid.uuid4().hex[:16]
        self.choices = [Choice(i, f"{base}-{i}", ids, p, state) for i, (ids, p) in enumerate(zip(prompts, params))]
        self.by_id = {c.id: c for c in self.choices}
        for c in self.choices:
            state.loop.submit(Request(c.id, c.prompt_ids, c.params), self.sink)

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
                # a stop string ended it: the engine would go on, so stop it
                self.state.loop.abort(c.id)
            yield c, text

    def close(self) -> None:
        """The client is gone (or an error): abort what still runs, so nothing leaks."""
        for c in self.choices:
            if not c.done:
                c.finish_reason = "abort"
                self.state.loop.abort(c.id)

    def usage(self) -> dict:
        prompt = sum(len(ids) for ids in dict.fromkeys(tuple(c.prompt_ids) for c in self.choices))
        completion = sum(c.n_tokens for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        cached = getattr(self.state.loop.engine, "num_cached_tokens", None)   # an engine with a prefix cache
        if cached is not None:
            firsts = {tuple(c.prompt_ids): c.id for c in reversed(self.choices)}   # one choice per prompt
            usage["prompt_tokens_details"] = {"cached_tokens": sum(cached(i) for i in firsts.values())}
        return usage


async def _until_disconnect(request) -> None:
    """Returns when the client closes the connection (the body was read already,
    so the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_to_end(gen: Generation, request, on_text: Callable | None = None) -> None:
    """Drive a non-streaming generation; abort it if the client disconnects first."""
    async def drive():
        async for c, text in gen.events():
            if on_text:
                on_text(c, text)

    work = asyncio.ensure_future(drive())
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        finished = work.done()
        work.cancel()
        gen.close()     # aborts whatever has not finished (client gone, or an error in one choice)
    if not finished:
        # nobody reads this reply; it only ends the handler
        raise APIError(400, "the client closed the connection before the answer was ready")
    work.result()    # re-raise an engine error as the reply


class EventStream(StreamingResponse):
    """SSE that notices a client leaving even while no token is ready (a
    queued request in a FIFO engine can wait a long time), and always runs
    on_close so the engine aborts what the client no longer wants."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        async def stream():
            try:
                await self.stream_response(send)
            except OSError:
                pass          # the client closed the socket under a send

        async def listen():
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(stream()), asyncio.ensure_future(listen())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, Exception):
                    log.error("streaming a response failed: %r", result)
            await self.body_iterator.aclose()    # a generator cut short runs its cleanup now
            self.on_close()


class APIKeyGuard:
    """With --api-key, /v1/* needs 'Authorization: Bearer KEY' (/healthz stays open for
    load balancers). A plain ASGI middleware: Starlette's BaseHTTPMiddleware would
    hide client disconnects from streaming responses."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>' with the "
                               "key the server was started with (--api-key)",
                               type="authentication_error", code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ============================================================================
# The app
# ============================================================================
def build_app(state: ServerState):
    app = FastAPI(title="qwen3-stages", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    # ---- errors ----
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind).body(),
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _crash(request, exc):
        log.exception("request failed")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                     type="server_error").body(), status_code=500)

    if state.api_key:
        app.add_middleware(APIKeyGuard, key=state.api_key)

    async def read_body(request: HTTPRequest) -> dict:
        if not state.ready:
            raise APIError(503, state.load_error or "the model is still loading; retry when GET /healthz says 200",
                           type="service_unavailable", code="model_loading")
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        state.check_model(body)
        _reject_unsupported(body)
        return body

    def check_ids(ids: list[int]) -> None:
        try:
            check_prompt(ids, state.max_ctx, state.vocab_size)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None

    # ---- endpoints ----
    @app.get("/healthz")
    async def healthz():
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok", "model": state.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "qwen3-stages",
            "max_model_len": state.max_ctx or None}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        body = await read_body(request)
        messages = chat_messages(body)
        tools = chat_tools(body)
        kwargs = _get(body, "chat_template_kwargs", (dict,), "an object", {})
        kwargs = dict(kwargs)
        clash = {"messages", "tools", "add_generation_prompt"} & set(kwargs)
        if clash:
            raise bad_request(f"chat_template_kwargs may not set {sorted(clash)}", "chat_template_kwargs")
        thinking = kwargs.pop("enable_thinking", True)
        if not isinstance(thinking, bool):
            raise bad_request("chat_template_kwargs.enable_thinking must be true or false", "chat_template_kwargs")
        stream = _get(body, "stream", (bool,), "true or false", False)
        opts = _get(body, "stream_options", (dict,), "an object", {})
        include_usage = bool(opts.get("include_usage"))
        n = _n(body)
        try:
            prompt = state.template.render(messages, add_generation_prompt=True, enable_thinking=thinking,
                                           tools=tools, **kwargs)
        except ValueError as e:       # ChatTemplateError: the template refused these messages
            raise bad_request(str(e), "messages") from None
        ids = state.tokenizer.encode(prompt)
        check_ids(ids)
        params = sampling_params(state, body, len(ids))
        opens_think = thinking and prompt_opens_think(prompt)

        gen = Generation(state, [ids] * n, choice_params(params, n))
        for c in gen.choices:
            c.parser = StreamParser(thinking=thinking, tools=tools is not None, start_in_reasoning=opens_think)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def finish_reason(c: Choice) -> str:
            return "tool_calls" if (c.parser.tool_calls and c.finish_reason == "stop") else c.finish_reason

        if not stream:
            per_choice: dict[int, list[Delta]] = {c.index: [] for c in gen.choices}

            def collect(c: Choice, text: str):
                per_choice[c.index] += c.parser.feed(text)
                if c.done:
                    per_choice[c.index] += c.parser.finish()

            await run_to_end(gen, request, collect)
            choices = []
            for c in gen.choices:
                deltas = per_choice[c.index]
                content = "".join(d.text for d in deltas if d.kind == "content")
                reasoning = "".join(d.text for d in deltas if d.kind == "reasoning") or None
                calls = [d.tool_call for d in deltas if d.kind == "tool_call"]
                message = {"role": "assistant", "content": content if (content or not calls) else None,
                           "reasoning_content": reasoning, "reasoning": reasoning}
                if calls:
                    message["tool_calls"] = calls
                choices.append({"index": c.index, "message": message, "logprobs": None,
                                "finish_reason": finish_reason(c)})
            return {"id": cid, "object": "chat.completion", "created": created, "model": state.model_name,
                    "choices": choices, "usage": gen.usage()}

        def chunk(index: int, delta: dict, finish: str | None = None) -> str:
            obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                   "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        async def sse():
            for c in gen.choices:
                yield chunk(c.index, {"role": "assistant", "content": ""})
            n_calls = {c.index: 0 for c in gen.choices}
            try:
                async for c, text in gen.events():
                    deltas = c.parser.feed(text) + (c.parser.finish() if c.done else [])
                    for d in deltas:
                        if d.kind == "content":
                            yield chunk(c.index, {"content": d.text})
                        elif d.kind == "reasoning":
                            yield chunk(c.index, {"reasoning_content": d.text, "reasoning": d.text})
                        else:
                            yield chunk(c.index, {"tool_calls": [{"index": n_calls[c.index], **d.tool_call}]})
                            n_calls[c.index] += 1
                    if c.done:
                        yield chunk(c.index, {}, finish_reason(c))
            except APIError as e:
                yield _sse(e.body())
            if include_usage:
                yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                            "model": state.model_name, "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"

        return EventStream(sse(), on_close=gen.close)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await read_body(request)
        prompt = body.get("prompt")
        # one prompt (text or ids) or a batch of them
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompt):
            prompts = prompt
        else:
            raise bad_request("'prompt' must be a string, a list of token ids, or a list of those", "prompt")
        if body.get("suffix"):
            raise bad_request("'suffix' is not supported", "suffix")
        echo = _get(body, "echo", (bool,), "true or false", False)
        stream = _get(body, "stream", (bool,), "true or false", False)
        include_usage = bool(_get(body, "stream_options", (dict,), "an object", {}).get("include_usage"))
        n = _n(body)
        all_ids, all_params, echoes = [], [], []
        for p in prompts:
            ids = state.tokenizer.encode(p) if isinstance(p, str) else list(p)
            try:
                check_prompt(ids, state.max_ctx, state.vocab_size)
            except ValueError as e:
                raise bad_request(str(e), "prompt") from None
            params = sampling_params(state, body, len(ids))
            all_ids += [ids] * n
            all_params += choice_params(params, n)
            echoes += [(p if isinstance(p, str) else state.tokenizer.decode(ids)) if echo else ""] * n
        gen = Generation(state, all_ids, all_params)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        if not stream:
            await run_to_end(gen, request)
            choices = [{"index": c.index, "text": echoes[c.index] + c.text, "logprobs": None,
                        "finish_reason": c.finish_reason} for c in gen.choices]
            return {"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": choices, "usage": gen.usage()}

        def chunk(index: int, text: str, finish: str | None = None) -> str:
            obj = {"id": cid, "object": "text_completion", "created": created, "model": state.model_name,
                   "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        async def sse():
            for c in gen.choices:
                if echoes[c.index]:
                    yield chunk(c.index, echoes[c.index])
            try:
                async for c, text in gen.events():
                    if text or c.done:
                        yield chunk(c.index, text, c.finish_reason)
            except APIError as e:
                yield _sse(e.body())
            if include_usage:
                yield _sse({"id": cid, "object": "text_completion", "created": created,
                            "model": state.model_name, "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"

        return EventStream(sse(), on_close=gen.close)

    return app


def create_app(engine, tokenizer, template, model_name: str, folder=None, max_ctx: int | None = None,
               api_key: str | None = None):
    """An app serving `engine` at once (tests run it in-process with any engine).
    app.state.server.loop is the EngineLoop (its .idle() tells when all is settled)."""
    state = ServerState(model_name=model_name, api_key=api_key)
    state.set_ready(engine, tokenizer, template, folder, max_ctx)
    return build_app(state)


# ============================================================================
# Command line
# ============================================================================
def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a Hugging Face model folder, or a known name (default: smollm2-135m)")
    parser.add_argument("--addr", default="127.0.0.1:8000",
                        help="HOST:PORT to listen on (default 127.0.0.1:8000; 0.0.0.0:PORT to accept other machines)")
    parser.add_argument("--max-ctx", type=int, default=4096, help="longest prompt + output per sequence")
    parser.add_argument("--slots", type=int, default=None, help="sequences run together (batching stages)")
    parser.add_argument("--token-budget", type=int, default=None, help="tokens per step (batching stages)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the --model value)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise SystemExit(f"--addr {addr!r} is not HOST:PORT (e.g. 127.0.0.1:8000)")
    return (host.strip("[]") or "127.0.0.1"), int(port)


def main(build_engine: Callable[[Path, argparse.Namespace], Any], argv: list[str] | None = None,
         prog: str | None = None, add_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Parse the command line, bind the socket, load the engine in the background
    (/healthz answers 503 meanwhile), then serve until Ctrl-C.

    build_engine(folder, args) -> Engine is the only stage-specific part;
    add_args(parser) adds the stage's own options."""
    import uvicorn

    from common.chat_template import ChatTemplate
    from common.models import resolve_model
    from common.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible server (chat, completions, models)")
    add_server_args(parser)
    if add_args:
        add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    if args.max_ctx < 2:
        raise SystemExit("--max-ctx must be at least 2")
    host, port = parse_addr(args.addr)

    try:
        folder = Path(resolve_model(args.model))
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot use --model {args.model!r}: {e}") from None
    name = args.served_model_name or args.model or folder.name
    state = ServerState(model_name=name, api_key=args.api_key, aliases={folder.name, str(folder)})

    # bind first, so clients can poll /healthz while the weights load
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror}; pick another --addr") from None
    sock.listen(128)
    bound = sock.getsockname()
    print(f"listening on http://{host}:{bound[1]} (model {name!r} loading from {folder})", flush=True)

    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level=args.log_level, timeout_keep_alive=30))

    def load():
        try:
            # tokenizer and template first: they are quick and fail with the clearest message
            tokenizer, template = Tokenizer(folder), ChatTemplate.from_folder(folder)
            engine = build_engine(folder, args)
            state.set_ready(engine, tokenizer, template, folder, args.max_ctx)
            print(f"ready: http://{host}:{bound[1]}/v1 serves {name!r} (max ctx {state.max_ctx})", flush=True)
        except Exception as e:
            if not isinstance(e, (ValueError, OSError)):   # a bug, not a bad folder: keep the traceback
                log.exception("loading the model failed")
            state.load_error = f"loading the model failed: {type(e).__name__}: {e}"
            server.should_exit = True

    threading.Thread(target=load, name="model-load", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        if state.loop is not None:
            state.loop.stop()
    if state.load_error:
        sys.exit(state.load_error)
