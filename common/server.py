"""An OpenAI-compatible HTTP server over any engine.

The outer layer of the design: HTTP and JSON in, token ids to the engine, token
ids back, text and JSON out. The engine never sees text and never sees a thread
other than its own:

    HTTP handlers (asyncio)        prepare threads            engine thread (EngineLoop)
    -----------------------        ---------------            --------------------------
    read the body (size limit)
    await prepare(body) ---------> parse JSON, check it,
                                   render template, tokenize
    submit(Request) ------------------ command queue -------> engine.add_request()
                                                              while engine.has_work():
                                                                  events = engine.step()
    per-request asyncio.Queue <------------------------------ call_soon_threadsafe(put, event)
    detokenize, stop strings,
    <think>/<tool_call> parsing, SSE
    client gone -> abort(id) --------- queue ---------------> engine.abort()

The event loop only moves bytes and small objects: anything whose cost grows with
the request (JSON parsing, the checks, the chat template, the tokenizer) runs on a
few prepare threads (two for small bodies, two for large ones), so one large
request never stalls /healthz or the other clients; the tokenizer releases the GIL
while it works through a long text (common/tokenizer.py).

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models,
GET /healthz (503 while the model loads, 200 when ready). Errors use OpenAI's
body: {"error": {"message", "type", "param", "code"}}. Input a client controls
never gets a 5xx: every limit (class Limits, listed in docs/server.md) answers
with a 4xx that names the field and says what to change.

Each stage's serve.py only builds its engine and calls main().
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import re
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
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
# Limits: everything the server refuses, in one place (docs/server.md lists them)
# ============================================================================
@dataclass
class Limits:
    """What one request may ask for. Each limit is checked before the work it
    protects, and answered with a 4xx that names the field and the limit."""
    max_body_bytes: int = 4 * 2**20    # request body (--max-body-mb); more -> 413 before any parsing
    max_depth: int = 64                # nesting of arrays/objects in the body; deeper -> 400
    max_choices: int = 64              # n (times the prompts of a /v1/completions batch); more -> 400
    max_stop: int = 16                 # stop strings per request; more -> 400
    max_stop_chars: int = 256          # characters in one stop string; more -> 400
    max_stop_token_ids: int = 256      # entries of stop_token_ids; more -> 400
    max_concurrent: int = 256          # generation requests served at once (--max-concurrent); more -> 429
    prepare_threads: int = 2           # threads that parse, render and tokenize large bodies ...
    small_body_bytes: int = 64 * 2**10  # ... and bodies up to this size have 2 threads of their own, so
                                        # a small request never queues behind large ones

    def __post_init__(self):
        for name in ("max_body_bytes", "max_depth", "max_choices", "max_stop", "max_stop_chars",
                     "max_stop_token_ids", "max_concurrent", "prepare_threads", "small_body_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {getattr(self, name)!r}")


# Sampling values the numpy sampler cannot take. It divides float32 logits by the
# temperature and by the repetition penalty; a value that is 0 or inf in float32
# turns logits into inf / NaN, and that fails the whole engine step: every request
# in the batch, not just this one. So: temperature in OpenAI's range [0, 2], where
# a positive value below GREEDY_BELOW is greedy (as vLLM does: the distribution is
# an argmax already); the repetition penalty within [1/100, 100].
MAX_TEMPERATURE, GREEDY_BELOW = 2.0, 1e-5
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 100.0
MAX_SEED = 2**63 - 1


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
    limits: Limits = field(default_factory=Limits)
    longest_token: int = 0                   # characters in the longest vocabulary entry (0: unknown)
    in_flight: int = 0                       # generation requests being served (event loop only)
    pools: dict[str, ThreadPoolExecutor] = field(default_factory=dict)   # prepare threads: "small", "large"

    @property
    def ready(self) -> bool:
        return self.loop is not None

    @property
    def max_prompt_chars(self) -> int | None:
        """More characters than this can never fit the context, whatever they are.

        A token covers at most `longest_token` characters of the text the tokenizer
        sees (a byte-level vocabulary entry has one character per byte, and a
        character is at least one byte). The tokenizer's normalizer may first
        compose characters (NFC turns "e" + U+0301 into one "é"); that shrinks a
        text by well under half, so twice the bound is safe. A prompt longer than
        this is refused from its length alone, before it costs any tokenizing."""
        if not (self.longest_token and self.max_ctx):
            return None
        return 2 * self.longest_token * self.max_ctx

    def set_ready(self, engine, tokenizer, template, folder, max_ctx: int | None = None) -> None:
        """Called once the engine is built (from the loading thread)."""
        self.tokenizer, self.template, self.folder = tokenizer, template, Path(folder) if folder else None
        self.max_ctx = int(getattr(engine, "max_ctx", 0) or max_ctx)
        if max_ctx:
            self.max_ctx = min(self.max_ctx, max_ctx)
        config = getattr(engine, "config", None)
        self.vocab_size = getattr(config, "vocab_size", 0) or tokenizer.vocab_size
        self.stop_ids = set(tokenizer.eos_token_ids) | set(getattr(config, "eos_token_ids", []) or [])
        self.longest_token = longest_token(tokenizer)
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


def longest_token(tokenizer) -> int:
    """Characters in the longest vocabulary entry, added tokens included (Qwen3: 128,
    a run of spaces); 0 when the tokenizer cannot list its vocabulary."""
    id_to_token, size = getattr(tokenizer, "id_to_token", None), getattr(tokenizer, "vocab_size", 0)
    if id_to_token is None or not size:
        return 0
    return max(len(id_to_token(i) or "") for i in range(size))


# ============================================================================
# The body: bytes -> a checked JSON object (on a prepare thread)
# ============================================================================
# A lone UTF-16 surrogate ("\ud800" written as an escape, or its bytes) is not
# Unicode: the tokenizer cannot take it, and RFC 8259 / I-JSON call such text
# invalid. We answer 400 naming the field rather than silently replacing it with
# U+FFFD, as the strict JSON parsers of hosted OpenAI-style APIs do (docs/server.md).
_SURROGATE = re.compile("[\ud800-\udfff]")
# the tokens of a JSON text that matter for nesting: strings (skipped whole), brackets, separators
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},:]', re.DOTALL)


def _segments(where) -> list:
    """The keys from the body down to a value; `where` is a linked list (parent, key)
    built while walking, None for the body itself."""
    keys = []
    while where is not None:
        where, key = where
        keys.append(key)
    return keys[::-1]


def _path(where, depth: int | None = None) -> str | None:
    """A field as OpenAI writes it, messages[0].content, from its first `depth` keys."""
    out = ""
    for key in _segments(where)[:depth]:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (JSON has no NaN or Infinity); send a number or null")


def _too_deep(where, max_depth: int) -> APIError:
    """Names the field by its first four keys (messages[0].content[0]); the message
    shows the path to the container that is too deep, cut at 80 characters."""
    keys = _segments(where)
    # a body that is an array has no field to name (and is refused for not being an object anyway)
    field = _path(where, 4) if keys and isinstance(keys[0], str) else None
    full = _path(where) or ""
    at = f" (at {full[:80]}{'...' if len(full) > 80 else ''})" if full != field else ""
    return bad_request(f"{field or 'the request body'} nests arrays/objects more than {max_depth} levels "
                       f"deep{at}; send a flatter structure", field)


def _deep_where(raw: bytes, max_depth: int):
    """Where the first array/object deeper than max_depth opens, from the raw bytes.
    Used when json.loads gave up with RecursionError, so there is no parsed value
    to walk; the scan stops at that container, so 100,000 '[' cost 65 steps."""
    frames: list[list] = []     # per open container: [is_object, current key or index, last string]
    for m in _JSON_TOKEN.finditer(raw):
        t = m.group()
        if t in (b"[", b"{"):
            if len(frames) >= max_depth:
                break
            frames.append([t == b"{", None if t == b"{" else 0, None])
        elif t in (b"]", b"}"):
            if frames:
                frames.pop()
        elif not frames:
            continue
        elif t == b",":
            if frames[-1][0]:
                frames[-1][1] = None
            else:
                frames[-1][1] += 1
        elif t == b":":
            frames[-1][1] = frames[-1][2]
        else:                   # a string: maybe the key of the next ':'
            try:
                frames[-1][2] = json.loads(t)
            except ValueError:
                frames[-1][2] = t.decode("utf-8", "replace")
    where = None
    for _is_object, key, _last in frames:
        where = (where, "?" if key is None else key)
    return where


def check_json(body, max_depth: int) -> None:
    """One walk over the parsed body: no array/object nested deeper than max_depth,
    no string or key with a lone surrogate. Raises a 400 naming the field."""
    stack = [(body, 1, None)]        # (container, its depth, where it is)
    while stack:
        value, depth, where = stack.pop()
        if depth > max_depth:
            raise _too_deep(where, max_depth)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and _SURROGATE.search(key):
                path = _path(where)
                raise bad_request(f"{path or 'the request body'} has a key with a lone UTF-16 surrogate; "
                                  "send valid Unicode (a surrogate must be half of a pair)", path)
            if isinstance(item, str):
                m = _SURROGATE.search(item)
                if m:
                    path = _path((where, key))
                    raise bad_request(f"{path} contains a lone UTF-16 surrogate (\\u{ord(m.group()):04x} at "
                                      f"character {m.start()}), which is not valid Unicode; send the character "
                                      "as a surrogate pair, or leave it out", path)
            elif isinstance(item, (dict, list)):
                stack.append((item, depth + 1, (where, key)))


def parse_body(raw: bytes, max_depth: int) -> dict:
    """The request body as a checked JSON object, or a 400 that says what is wrong."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise _too_deep(_deep_where(raw, max_depth), max_depth) from None
    except ValueError as e:
        # JSONDecodeError, bytes that are not UTF-8, NaN, an integer of more than 4300 digits
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got a JSON {type(body).__name__}")
    check_json(body, max_depth)
    return body


# ============================================================================
# Request validation (hand-written so every error is an OpenAI error with a clear message)
# ============================================================================
_NUMBER = (int, float)


def _show(value) -> str:
    return json.dumps(value)[:50]


def _get(body: dict, name: str, kinds: tuple, what: str, default=None):
    """body[name] if present and not null, checked against kinds (bool is never a number)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise bad_request(f"'{name}' must be {what}, got {_show(value)}", name)
    if not isinstance(value, kinds):
        raise bad_request(f"'{name}' must be {what}, got {type(value).__name__} {_show(value)}", name)
    return value


def _stop_strings(body: dict, limits: Limits) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    # each stop string is matched against the text of every new token: bound the work
    if len(stop) > limits.max_stop:
        raise bad_request(f"'stop' has {len(stop)} strings; this server takes at most {limits.max_stop}", "stop")
    longest = max(len(s) for s in stop)
    if longest > limits.max_stop_chars:
        raise bad_request(f"a stop string has {longest} characters; this server takes at most "
                          f"{limits.max_stop_chars}", "stop")
    return stop


def _stop_token_ids(body: dict, limits: Limits) -> list[int]:
    ids = _get(body, "stop_token_ids", (list,), "a list of token ids", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise bad_request("'stop_token_ids' must be a list of non-negative integers", "stop_token_ids")
    if len(ids) > limits.max_stop_token_ids:
        raise bad_request(f"'stop_token_ids' has {len(ids)} entries; this server takes at most "
                          f"{limits.max_stop_token_ids}", "stop_token_ids")
    return ids


def sampling_params(state: ServerState, body: dict) -> SamplingParams:
    """The request's sampling fields over the model's generation_config.json defaults.
    max_tokens is what the request asked for (the whole context if it did not ask);
    fit_to_context() cuts it to the room the prompt leaves, once the prompt is tokenized."""
    max_tokens = _get(body, "max_completion_tokens", (int,), "an integer")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = _get(body, "max_tokens", (int,), "an integer"), "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"'{name}' must be at least 1, got {max_tokens}", name)
    # without max_tokens, a request may use the rest of the context (as vLLM does);
    # with it, the context still caps the output
    max_tokens = state.max_ctx if max_tokens is None else min(max_tokens, state.max_ctx)

    temperature = _get(body, "temperature", _NUMBER, "a number")
    if temperature is not None:
        if not 0 <= temperature <= MAX_TEMPERATURE:          # NaN fails this too
            raise bad_request(f"'temperature' must be between 0 and {MAX_TEMPERATURE:g}, got {temperature}",
                              "temperature")
        if temperature < GREEDY_BELOW:
            temperature = 0.0
    repetition_penalty = _get(body, "repetition_penalty", _NUMBER, "a number")
    if repetition_penalty is not None and not (
            MIN_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY):
        raise bad_request(f"'repetition_penalty' must be between {MIN_REPETITION_PENALTY:g} and "
                          f"{MAX_REPETITION_PENALTY:g} (1 = off), got {repetition_penalty}", "repetition_penalty")
    seed = _get(body, "seed", (int,), "an integer")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise bad_request(f"'seed' must be between 0 and 2**63 - 1, got {seed}", "seed")
    try:
        return SamplingParams.from_generation_config(
            state.folder,
            temperature=temperature,
            top_p=_get(body, "top_p", _NUMBER, "a number"),
            top_k=_get(body, "top_k", (int,), "an integer"),
            min_p=_get(body, "min_p", _NUMBER, "a number"),
            presence_penalty=_get(body, "presence_penalty", _NUMBER, "a number"),
            frequency_penalty=_get(body, "frequency_penalty", _NUMBER, "a number"),
            repetition_penalty=repetition_penalty,
            seed=seed,
            ignore_eos=_get(body, "ignore_eos", (bool,), "true or false"),
            max_tokens=max_tokens,
            stop=_stop_strings(body, state.limits),
            stop_token_ids=_stop_token_ids(body, state.limits),
        )
    except ValueError as e:
        # SamplingParams says "top_p must be in (0, 1]": its first word is the field
        raise bad_request(str(e), str(e).split()[0]) from None


def fit_to_context(params: SamplingParams, prompt_len: int, max_ctx: int) -> SamplingParams:
    """A copy whose max_tokens fits the room the prompt leaves in the context."""
    return SamplingParams(**{**params.__dict__, "stop": list(params.stop),
                             "stop_token_ids": list(params.stop_token_ids),
                             "max_tokens": min(params.max_tokens, max_ctx - prompt_len)})


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


def _n(body: dict, limits: Limits, prompts: int = 1) -> int:
    n = _get(body, "n", (int,), "an integer", 1)
    if not 1 <= n <= limits.max_choices:
        raise bad_request(f"'n' must be between 1 and {limits.max_choices}, got {n}", "n")
    if n * prompts > limits.max_choices:
        raise bad_request(f"{prompts} prompts x n={n} is {n * prompts} choices; this server makes at most "
                          f"{limits.max_choices} per request", "n")
    return n


def _reject_unsupported(body: dict) -> None:
    if body.get("logprobs") or body.get("top_logprobs"):
        raise bad_request("logprobs are not supported by this server; leave 'logprobs' unset", "logprobs")
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported by this server; leave it unset (or {})", "logit_bias")


def _text_content(content, i: int) -> str:
    """A message's content: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) "
                                  "are supported", f"messages[{i}].content[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts, got "
                      f"{type(content).__name__}", f"messages[{i}].content")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be a list of {role, content} objects", "messages")
    if not messages:
        raise bad_request("'messages' is empty: send at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
        role = m.get("role")
        if role == "developer":       # OpenAI's newer name for the system role
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role must be system, user, assistant or tool, got "
                              f"{_show(role)}", f"messages[{i}].role")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"], msg["content"] = role, _text_content(m.get("content"), i)
        for key in ("name", "tool_call_id", "reasoning_content", "reasoning", "thinking"):
            if key in msg and not isinstance(msg[key], str):
                raise bad_request(f"messages[{i}].{key} must be a string, got {type(msg[key]).__name__}",
                                  f"messages[{i}].{key}")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be a list on an assistant message",
                                  f"messages[{i}].tool_calls")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                        fn.get("arguments", ""), (str, dict)):
                    raise bad_request(f"messages[{i}].tool_calls[{j}] needs function.name (a string) and "
                                      "function.arguments (a JSON string)", f"messages[{i}].tool_calls[{j}]")
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
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of {'type': 'function', 'function': {'name': ...}}", "tools")
    for j, t in enumerate(tools):
        if not (isinstance(t, dict) and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str)):
            raise bad_request(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                              f"tools[{j}]")
    return tools if (tools and choice == "auto") else None


def chat_template_kwargs(body: dict) -> tuple[dict, bool]:
    """chat_template_kwargs -> (extra template variables, enable_thinking)."""
    kwargs = dict(_get(body, "chat_template_kwargs", (dict,), "an object", {}))
    clash = {"messages", "tools", "add_generation_prompt"} & set(kwargs)
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {sorted(clash)}", "chat_template_kwargs")
    bad = [k for k in kwargs if not k.isidentifier()]
    if bad:
        raise bad_request(f"chat_template_kwargs keys must be names, got {_show(bad[0])}", "chat_template_kwargs")
    thinking = kwargs.pop("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be true or false",
                          "chat_template_kwargs.enable_thinking")
    return kwargs, thinking


# ============================================================================
# Preparing a request: everything whose cost grows with the body (prepare threads)
# ============================================================================
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


def check_length(state: ServerState, chars: int, param: str) -> None:
    """Refuse a prompt that cannot fit from its length alone, before tokenizing it."""
    bound = state.max_prompt_chars
    if bound is not None and chars > bound:
        raise bad_request(f"the prompt has {chars} characters; a context of {state.max_ctx} tokens holds at most "
                          f"{bound} (a token covers at most {state.longest_token} characters); shorten the "
                          "prompt or start the server with a larger --max-ctx", param)


def check_ids(state: ServerState, ids: list[int], param: str) -> None:
    try:
        check_prompt(ids, state.max_ctx, state.vocab_size)
    except ValueError as e:
        raise bad_request(str(e), param) from None


def prepare_chat(state: ServerState, raw: bytes) -> Job:
    """POST /v1/chat/completions: body bytes -> a Job (template rendered and tokenized once)."""
    body = parse_body(raw, state.limits.max_depth)
    state.check_model(body)
    _reject_unsupported(body)
    messages = chat_messages(body)
    tools = chat_tools(body)
    kwargs, thinking = chat_template_kwargs(body)
    stream = _get(body, "stream", (bool,), "true or false", False)
    include_usage = bool(_get(body, "stream_options", (dict,), "an object", {}).get("include_usage"))
    n = _n(body, state.limits)
    params = sampling_params(state, body)       # checked before the costly part
    try:
        prompt = state.template.render(messages, add_generation_prompt=True, enable_thinking=thinking,
                                       tools=tools, **kwargs)
    except (ValueError, RecursionError, TypeError, AttributeError, LookupError) as e:
        # ChatTemplateError (a ValueError): the template refused these messages;
        # the others: a value of an unexpected type reached the template
        raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from None
    if not isinstance(prompt, str):
        raise bad_request("the chat template did not render text for these messages", "messages")
    check_length(state, len(prompt), "messages")
    ids = state.tokenizer.encode(prompt)
    check_ids(state, ids, "messages")
    params = fit_to_context(params, len(ids), state.max_ctx)
    return Job([ids] * n, choice_params(params, n), stream, include_usage, thinking=thinking, tools=tools,
               opens_think=thinking and prompt_opens_think(prompt))


def prepare_completion(state: ServerState, raw: bytes) -> Job:
    """POST /v1/completions: body bytes -> a Job (each prompt tokenized once)."""
    body = parse_body(raw, state.limits.max_depth)
    state.check_model(body)
    _reject_unsupported(body)
    prompt = body.get("prompt")

    def is_ids(p) -> bool:
        return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

    # one prompt (text or ids) or a batch of them
    if isinstance(prompt, str) or is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise bad_request("'prompt' must be a string, a list of token ids, or a list of those", "prompt")
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported", "suffix")
    echo = _get(body, "echo", (bool,), "true or false", False)
    stream = _get(body, "stream", (bool,), "true or false", False)
    include_usage = bool(_get(body, "stream_options", (dict,), "an object", {}).get("include_usage"))
    n = _n(body, state.limits, len(prompts))
    params = sampling_params(state, body)
    job = Job([], [], stream, include_usage)
    for k, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
        if isinstance(p, str):
            check_length(state, len(p), param)
            ids = state.tokenizer.encode(p)
        else:
            ids = list(p)
        check_ids(state, ids, param)
        job.prompts += [ids] * n
        job.params += choice_params(fit_to_context(params, len(ids), state.max_ctx), n)
        job.echoes += [(p if isinstance(p, str) else state.tokenizer.decode(ids)) if echo else ""] * n
    return job


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


GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
ADMITTED = "qwen3_stages.admitted"     # in the ASGI scope: this request counts against max_concurrent


class ConcurrencyLimit:
    """At most limits.max_concurrent generation requests at once. A request counts
    from the moment its whole body has arrived (read_body admits it, or answers 429)
    to the end of its answer, a stream included; this middleware ends the count.
    A client still sending its body does not count, so stalled half-sent
    connections cannot lock others out. All counting is on the event loop thread."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        scope[ADMITTED] = False
        try:
            await self.app(scope, receive, send)
        finally:
            if scope[ADMITTED]:
                self.state.in_flight -= 1


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

    app.add_middleware(ConcurrencyLimit, state=state)
    if state.api_key:
        app.add_middleware(APIKeyGuard, key=state.api_key)
    if not state.pools:
        state.pools = {"small": ThreadPoolExecutor(2, thread_name_prefix="prepare-small"),
                       "large": ThreadPoolExecutor(state.limits.prepare_threads, thread_name_prefix="prepare-large")}

    async def read_body(request: HTTPRequest) -> bytes:
        """The body's bytes, refused with 413 as soon as it is known to be too large
        (from Content-Length, or while reading a chunked body): nothing is parsed yet."""
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
        # the body is here: from now on the request holds memory and will cost work
        if state.in_flight >= state.limits.max_concurrent:
            raise APIError(429, f"the server is already serving {state.limits.max_concurrent} requests, its "
                           "limit (--max-concurrent); retry in a moment", type="rate_limit_error",
                           code="too_many_requests")
        state.in_flight += 1
        request.scope[ADMITTED] = True
        return b"".join(chunks)

    async def prepare(fn: Callable[[ServerState, bytes], Job], request: HTTPRequest) -> Job:
        """Read the body here, then parse, check, render and tokenize it on a prepare thread."""
        raw = await read_body(request)
        pool = state.pools["small" if len(raw) <= state.limits.small_body_bytes else "large"]
        return await asyncio.get_running_loop().run_in_executor(pool, fn, state, raw)

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
        job = await prepare(prepare_chat, request)
        thinking, tools, stream, include_usage = job.thinking, job.tools, job.stream, job.include_usage
        gen = Generation(state, job.prompts, job.params)
        for c in gen.choices:
            c.parser = StreamParser(thinking=thinking, tools=tools is not None, start_in_reasoning=job.opens_think)
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
        job = await prepare(prepare_completion, request)
        stream, include_usage, echoes = job.stream, job.include_usage, job.echoes
        gen = Generation(state, job.prompts, job.params)
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
               api_key: str | None = None, limits: Limits | None = None):
    """An app serving `engine` at once (tests run it in-process with any engine).
    app.state.server.loop is the EngineLoop (its .idle() tells when all is settled)."""
    state = ServerState(model_name=model_name, api_key=api_key, limits=limits or Limits())
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
    parser.add_argument("--max-body-mb", type=float, default=Limits.max_body_bytes / 2**20, metavar="MB",
                        help="largest request body in MiB; a larger one gets 413 before it is parsed "
                        "(default %(default)g)")
    parser.add_argument("--max-concurrent", type=int, default=Limits.max_concurrent, metavar="N",
                        help="generation requests served at once; one more gets 429 (default %(default)d)")
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
    if not args.max_body_mb > 0 or args.max_concurrent < 1:
        raise SystemExit("--max-body-mb must be positive and --max-concurrent at least 1")
    limits = Limits(max_body_bytes=max(1, int(args.max_body_mb * 2**20)), max_concurrent=args.max_concurrent)
    host, port = parse_addr(args.addr)

    try:
        folder = Path(resolve_model(args.model))
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot use --model {args.model!r}: {e}") from None
    name = args.served_model_name or args.model or folder.name
    state = ServerState(model_name=name, api_key=args.api_key, aliases={folder.name, str(folder)}, limits=limits)

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
        for pool in state.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
    if state.load_error:
        sys.exit(state.load_error)
