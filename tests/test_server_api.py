"""The server's schema, its start-up reads, pydantic's JSON parser at the edges, and
engine faults: an exception in engine.step(), and an engine process killed mid-stream.

The scripted engine of test_server.py (real Qwen3 token ids, known outputs) runs
behind the real server over loopback HTTP, in this process or in a child process.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
import typing
from types import SimpleNamespace

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from common.chat_template import ChatTemplate
from common.engine import TokenEvent
from common.engine_process import EngineProcess
from common.server import create_app
from common.tokenizer import Tokenizer
from test_server import CHAT_OK, LiveServer, ScriptedEngine, assert_error, model_dir, post_raw, \
    script_for, scripted, tok, user  # noqa: F401  (fixtures)

# the fields of our request models that are not OpenAI's: vLLM's extensions, with vLLM's names
EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids",
              "chat_template_kwargs"}
COMMON = {"model", "n", "stream", "stream_options", "max_tokens", "temperature", "top_p",
          "presence_penalty", "frequency_penalty", "seed", "stop", "user", "logprobs", "logit_bias"}
CHAT = COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice", "top_logprobs"}
COMPLETION = COMMON | {"prompt", "echo", "suffix"}


def openai_fields(params) -> dict[str, str]:
    """The openai package's typed request parameters: name -> its type, as text."""
    hints = typing.get_type_hints(params)
    return {name: str(hints[name]) for name in params.__required_keys__ | params.__optional_keys__}


def json_types(prop: dict) -> set[str]:
    """The JSON types a property of our schema allows (null left out)."""
    kinds = [prop] + prop.get("anyOf", []) + prop.get("oneOf", [])
    return {k["type"] for k in kinds if "type" in k} - {"null"}


def test_openapi_schema_is_open_with_an_api_key_and_matches_the_openai_clients_params(
    model_dir, tok
):
    app = create_app(ScriptedEngine(tok), tok, ChatTemplate.from_folder(model_dir), "scripted",
                     folder=model_dir, max_ctx=512, api_key="sekrit")
    server = LiveServer(app)
    try:
        # /v1 is behind the key ...
        assert httpx.get(server.url + "/v1/models").status_code == 401
        docs = httpx.get(server.url + "/docs")
        # ... the docs are not
        assert docs.status_code == 200 and "swagger" in docs.text.lower()
        r = httpx.get(server.url + "/openapi.json")
        assert r.status_code == 200
        schema = r.json()
    finally:
        server.close()
    components = schema["components"]["schemas"]
    for path, ours, theirs in [
        ("/v1/chat/completions", CHAT, chat_create_params.CompletionCreateParamsStreaming),
        ("/v1/completions", COMPLETION, completion_create_params.CompletionCreateParamsStreaming),
    ]:
        op = schema["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        props = components[ref.rsplit("/", 1)[1]]["properties"]
        fields = openai_fields(theirs)
        # every field we support is declared
        assert ours <= set(props), ours - set(props)
        assert ours <= set(fields), ours - set(fields)             # ... under OpenAI's name
        # no field with a made-up name
        assert set(props) - set(fields) <= EXTENSIONS, set(props) - set(fields)
        # and the scalar ones with OpenAI's type
        for name, kind, py in [("n", "integer", "int"), ("max_tokens", "integer", "int"),
                               ("seed", "integer", "int"),
                               ("temperature", "number", "float"), ("top_p", "number", "float"),
                               ("stream", "boolean", "Literal[True]"),
                               ("echo" if "echo" in ours else "n", *(
                                   ("boolean", "bool") if "echo" in ours else ("integer", "int")))]:
            assert kind in json_types(props[name]) and py in fields[name], (
                path, name, props[name], fields[name])
        assert op["security"] == [{"HTTPBearer": []}]
        assert "200" in op["responses"]
    assert components["ChatCompletionRequest"]["properties"]["n"]["maximum"] == 64
    assert "security" not in schema["paths"]["/healthz"]["get"]
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(schema)))
    # every $ref resolves
    assert {"Message", "Tool", "TextPart"} <= refs and refs <= set(components)
    assert "/v1/models" in schema["paths"]


def test_generation_config_is_read_once_at_start_up(model_dir, tok, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(model_dir, folder)
    engine = ScriptedEngine(tok)
    server = LiveServer(create_app(engine, tok, ChatTemplate.from_folder(folder), "scripted",
                                   folder=folder, max_ctx=512))
    try:
        # the file changes after start-up: requests keep the defaults the server started with
        (folder / "generation_config.json").write_text(
            json.dumps({"temperature": 1.5, "top_p": 0.5, "top_k": 3})
        )
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        c.chat.completions.create(model="scripted", messages=user("hello"), max_tokens=2)
        p = engine.requests[-1].params
        assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    finally:
        server.close()


def test_what_pydantics_json_parser_reads_differently_keeps_the_documented_answers(scripted):
    """pydantic's parser reads NaN and Infinity, nests ~200 levels and takes any field;
    the documented answers (docs/server.md) stay: NaN is not JSON, 64 levels at most."""
    url = scripted.url + "/v1/chat/completions"
    head = (
        b'{"model": "scripted", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}], '
    )
    tool = b'"tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": %s}}}]}'
    # NaN / Infinity inside a free-form value (a tool's JSON schema), which pydantic takes as a
    # float
    for constant in (b"NaN", b"-Infinity"):
        assert_error(post_raw(url, head + tool % constant)[0], 400, says="is not valid JSON")
    # 1e999 and 10**30 are JSON numbers: accepted there
    for number in (b"1e999", b"1" + b"0" * 30):
        r, _ = post_raw(url, head + tool % number)
        assert r.status_code == 200, r.text
    # 100 levels: past our 64, within pydantic's own limit; in an unknown field, and in a template
    # variable
    deep = b"[" * 100 + b"]" * 100
    err = assert_error(post_raw(url, head + b'"extra": ' + deep + b"}")[0], 400,
                       param="extra[0][0][0]", says="more than 64 levels deep")
    assert "(at extra[0][0][0][0]" in err["message"]
    assert_error(post_raw(url, head + b'"chat_template_kwargs": {"v": ' + deep + b"}}")[0], 400,
                 param="chat_template_kwargs.v[0][0]", says="more than 64 levels deep")
    # unknown fields anywhere are accepted and ignored, as OpenAI does
    r = httpx.post(url, json={**CHAT_OK, "service_tier": "auto",
                              "metadata": {"k": [1, {"a": None}]},
                              "messages": [{"role": "user", "content": "hello", "audio": None}],
                              "stream_options": {"include_usage": False,
                                                 "continuous_usage_stats": True}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


# ============================================================================
# Engine faults
# ============================================================================
def serve(engine, model_dir, tok) -> tuple[LiveServer, openai.OpenAI]:
    """The real server over `engine` (one of the scripted engines below), and a client for it."""
    server = LiveServer(create_app(engine, tok, ChatTemplate.from_folder(model_dir), "scripted",
                                   folder=model_dir, max_ctx=512))
    return server, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def post_in_background(server: LiveServer) -> tuple[threading.Thread, dict]:
    """A long non-streaming chat request on a thread; its response lands in the dict as "r"."""
    waiting: dict = {}
    thread = threading.Thread(target=lambda: waiting.update(r=httpx.post(
        server.url + "/v1/chat/completions", timeout=30,
        json={"model": "scripted", "messages": user("endless wait"), "max_tokens": 2000})))
    thread.start()
    return thread, waiting


def wait_until_running(engine: ScriptedEngine, n: int) -> None:
    deadline = time.time() + 10
    while len(engine.running) < n:
        assert time.time() < deadline
        time.sleep(0.01)


class FaultyEngine(ScriptedEngine):
    """The scripted engine with an exception planted in step(), fired once on demand."""
    fail = False

    def step(self):
        if self.fail:
            self.fail = False
            raise RuntimeError("planted fault in step()")
        return super().step()


def test_an_exception_in_engine_step_fails_the_requests_in_flight_and_new_ones_are_served(
    model_dir, tok
):
    engine = FaultyEngine(tok, step_delay=0.005)
    server, c = serve(engine, model_dir, tok)
    try:
        thread, waiting = post_in_background(server)
        stream = iter(c.chat.completions.create(model="scripted", messages=user("endless"),
                                                max_tokens=2000, stream=True))
        assert [next(stream) for _ in range(3)]
        wait_until_running(engine, 2)             # both are in the engine
        engine.fail = True
        with pytest.raises(openai.APIError, match="planted fault"):
            for _ in stream:
                pass
        thread.join(timeout=30)
        err = assert_error(waiting["r"], 500, says="planted fault")
        assert err["type"] == "server_error"
        # the engine holds nothing of them, and serves the next request
        server.wait_idle()
        assert not engine.running
        r = c.chat.completions.create(
            model="scripted", messages=user("hello"), seed=3, max_tokens=200
        )
        assert r.choices[0].message.content == script_for("<|im_start|>user\nhello", 3)
    finally:
        server.close()


class DegenerateEngine(ScriptedEngine):
    """The scripted engine whose next step ends one request with an "error" event, as stage 3's
    sampler does for a row of non-finite logits (token id -1: no token)."""
    spoil: str | None = None

    def step(self):
        events = super().step()
        rid, self.spoil = self.spoil, None
        if rid in self.running:
            del self.running[rid]
            events = [e for e in events if e.request_id != rid] + [TokenEvent(rid, -1, "error")]
        return events


def test_an_error_event_from_the_engine_fails_that_request_only_with_a_server_error(model_dir, tok):
    engine = DegenerateEngine(tok, step_delay=0.005)
    server, c = serve(engine, model_dir, tok)
    try:
        other = iter(c.chat.completions.create(model="scripted", messages=user("endless"),
                                               max_tokens=2000, stream=True))
        assert next(other)
        thread, waiting = post_in_background(server)
        wait_until_running(engine, 2)
        engine.spoil = engine.requests[-1].id         # the second request, the one waiting whole
        thread.join(timeout=30)
        err = assert_error(waiting["r"], 500, says="not finite")
        assert err["type"] == "server_error"
        # the stream goes on: more tokens after the error, and it stays in the engine
        assert [next(other) for _ in range(5)]
        assert engine.requests[0].id in engine.running
    finally:
        server.close()


def scripted_engine(folder, args):
    """The engine builder the child process imports (as a stage's serve.py build_engine)."""
    return ScriptedEngine(Tokenizer(folder), max_ctx=512, step_delay=args.step_delay)


def test_killing_the_engine_process_during_a_stream_fails_it_and_the_restarted_child_serves(
    model_dir, tok
):
    engine = EngineProcess(scripted_engine, model_dir, SimpleNamespace(step_delay=0.005))
    server, c = serve(engine, model_dir, tok)
    try:
        r = c.chat.completions.create(
            model="scripted", messages=user("hello"), seed=3, max_tokens=200
        )
        # through the child
        assert r.choices[0].message.content == script_for("<|im_start|>user\nhello", 3)
        assert httpx.get(server.url + "/healthz").json()["engine_restarts"] == 0
        first = engine.proc.pid
        stream = iter(c.chat.completions.create(model="scripted", messages=user("endless"),
                                                max_tokens=2000, stream=True))
        assert [next(stream) for _ in range(3)]
        os.kill(first, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine process died"):
            for _ in stream:
                pass
        statuses, deadline = set(), time.time() + 60
        while True:
            h = httpx.get(server.url + "/healthz")
            statuses.add(h.json()["status"])
            if h.status_code == 200:
                break
            assert h.json()["status"] == "restarting" and time.time() < deadline, h.text
            time.sleep(0.05)
        assert h.json()["engine_restarts"] == 1 and engine.proc.pid != first
        r = c.chat.completions.create(
            model="scripted", messages=user("hello"), seed=5, max_tokens=200, stream=True
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) == \
            script_for("<|im_start|>user\nhello", 5)
        # a child that dies while idle: the next request finds it dead, and the new child serves it
        dead = engine.proc
        second = dead.pid
        os.kill(second, signal.SIGKILL)
        dead.join(10)                # (the reader thread may have started the next child by now)
        r = c.chat.completions.create(
            model="scripted", messages=user("hello"), seed=6, max_tokens=200
        )
        assert r.choices[0].message.content == script_for("<|im_start|>user\nhello", 6)
        assert engine.restarts == 2 and engine.proc.pid not in (first, second)
        server.wait_idle()
    finally:
        server.close()
    assert not engine.proc.is_alive()


def test_the_server_stays_within_its_size_limits():
    """docs/server.md's bound: the server's files (common/api_*.py, engine_loop.py,
    engine_process.py, server.py) total at most 1,060 lines at 100 columns, none over 400."""
    root = os.path.join(os.path.dirname(__file__), "..", "common")
    # every api_*.py, a new one too
    files = sorted(f for f in os.listdir(root) if re.fullmatch(r"api_\w+\.py", f))
    assert ({"api_protocol.py", "api_state.py", "api_chat.py", "api_completions.py"}
            <= set(files)), files
    files += ["engine_loop.py", "engine_process.py", "server.py"]
    lines = {}
    for name in files:
        with open(os.path.join(root, name)) as f:
            lines[name] = len(f.read().splitlines())
    assert sum(lines.values()) <= 1060 and max(lines.values()) <= 400, lines
