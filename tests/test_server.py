"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP.

Two engines behind the same server code:
  * ScriptedEngine: emits the token ids of a fixed text (chosen from the prompt)
    through the real Qwen3 tokenizer, so tool calls, thinking and stop strings go
    through the real detokenize -> stop -> parse path with outputs we know;
  * the stage-1 LLMEngine on a tiny random Qwen3 with the real tokenizer, checked
    against transformers' greedy tokens.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from common.chat_template import ChatTemplate
from common.engine import Request, TokenEvent, check_prompt
from common.server import create_app
from common.tokenizer import Tokenizer
from qwen_tokenizer import qwen3_tokenizer_dir  # noqa: F401  (session fixture)

ROOT = Path(__file__).resolve().parent.parent
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}]


# ============================================================================
# A scripted engine: real token ids, a known output
# ============================================================================
def script_for(prompt: str, seed: int | None) -> str:
    """What the scripted 'model' answers, from the rendered prompt (its last turn)."""
    last = prompt[prompt.rfind("<|im_start|>user"):]
    if "<tool_response>" in last:
        return "It is 18 degrees in Paris."
    if "weather" in last:
        return "<think>\nI should call the weather tool.\n</think>\n\n" + WEATHER_CALL
    if "broken tool" in last:
        return '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}\n</tool_call>'
    if "think" in last:
        return "<think>\nLet me think: 2 + 2 = 4.\n</think>\n\nThe answer is 4."
    if "stop test" in last:
        return "one two three STOP four five"
    if "endless" in last:
        return " ".join(WORDS * 200)
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(40)) + "."


class ScriptedEngine:
    """The Engine protocol with a scripted output; batches every running request,
    like the batching stages (so many clients progress together)."""

    def __init__(self, tokenizer: Tokenizer, max_ctx: int = 512, step_delay: float = 0.002):
        self.tok = tokenizer
        self.max_ctx = max_ctx
        self.step_delay = step_delay
        self.end_id = tokenizer.token_to_id("<|im_end|>")
        self.running: dict[str, list] = {}      # id -> [request, script ids, position]
        self.pending_aborts: list[str] = []
        self.aborted: list[str] = []            # every aborted id, for the tests
        self.requests: list[Request] = []       # every request added, for the tests

    def add_request(self, req: Request) -> None:
        check_prompt(req.prompt_ids, self.max_ctx, self.tok.vocab_size)
        text = script_for(self.tok.decode(req.prompt_ids), req.params.seed)
        self.requests.append(req)
        self.running[req.id] = [req, self.tok.encode(text) + [self.end_id], 0]

    def abort(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is not None:
            self.pending_aborts.append(request_id)
            self.aborted.append(request_id)

    def has_work(self) -> bool:
        return bool(self.running or self.pending_aborts)

    def step(self) -> list[TokenEvent]:
        time.sleep(self.step_delay)
        events = [TokenEvent(rid, -1, "abort") for rid in self.pending_aborts]
        self.pending_aborts = []
        for rid, entry in list(self.running.items()):
            req, ids, pos = entry
            token = ids[pos]
            entry[2] = pos + 1
            finish = None
            if token == self.end_id and not req.params.ignore_eos:
                finish = "stop"
            elif entry[2] >= req.params.max_tokens or entry[2] >= len(ids):
                finish = "length"
            if finish:
                del self.running[rid]
            events.append(TokenEvent(rid, token, finish))
        return events


# ============================================================================
# Running a real server on a free loopback port
# ============================================================================
class LiveServer:
    def __init__(self, app):
        import uvicorn
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)

    @property
    def loop(self):
        return self.app.state.server.loop

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.time() + timeout
        while not self.loop.idle():
            assert time.time() < deadline, "the engine still holds requests"
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.loop.stop()


@pytest.fixture(scope="module")
def model_dir(qwen3_tokenizer_dir, tmp_path_factory) -> Path:
    """The Qwen3 tokenizer + chat template, and sampling defaults in generation_config.json."""
    d = tmp_path_factory.mktemp("scripted-model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen3_tokenizer_dir / name, d / name)
    (d / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [151645, 151643]}))
    return d


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def scripted(model_dir, tok):
    engine = ScriptedEngine(tok, max_ctx=512)
    app = create_app(engine, tok, ChatTemplate.from_folder(model_dir), "scripted", folder=model_dir, max_ctx=512)
    server = LiveServer(app)
    server.engine = engine
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(scripted) -> openai.OpenAI:
    return openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def stream_text(stream) -> tuple[str, str, list, str | None, object]:
    """Collect a chat stream -> (content, reasoning, tool call deltas, finish_reason, usage)."""
    content, reasoning, calls, finish, usage = "", "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            calls += d.tool_calls or []
            finish = choice.finish_reason or finish
    return content, reasoning, calls, finish, usage


# ============================================================================
# Chat: plain, streamed, usage
# ============================================================================
def test_chat_non_streaming_returns_the_scripted_text_and_usage(client, scripted, tok):
    r = client.chat.completions.create(model="scripted", messages=user("hello"), seed=3, max_tokens=200)
    expected = script_for("<|im_start|>user\nhello", 3)
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.object == "chat.completion" and r.model == "scripted"
    req = scripted.engine.requests[-1]
    assert r.usage.prompt_tokens == len(req.prompt_ids)
    assert r.usage.completion_tokens == len(tok.encode(expected)) + 1     # + <|im_end|>
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the prompt the engine saw is the chat template's rendering
    assert tok.decode(req.prompt_ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_streamed_text_equals_non_streamed_text_for_the_same_seed(client):
    full = client.chat.completions.create(model="scripted", messages=user("hi there"), seed=11, max_tokens=200)
    stream = client.chat.completions.create(model="scripted", messages=user("hi there"), seed=11, max_tokens=200,
                                            stream=True, stream_options={"include_usage": True})
    content, reasoning, calls, finish, usage = stream_text(stream)
    assert content == full.choices[0].message.content and len(content) > 50
    assert finish == "stop" and not calls and not reasoning
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_max_tokens_gives_finish_reason_length(client, tok):
    r = client.chat.completions.create(model="scripted", messages=user("hello"), seed=3, max_tokens=5)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.choices[0].message.content == tok.decode(tok.encode(script_for("user\nhello", 3))[:5])


def test_sampling_defaults_come_from_generation_config_and_requests_override_them(client, scripted):
    client.chat.completions.create(model="scripted", messages=user("hello"), max_tokens=3)
    p = scripted.engine.requests[-1].params
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    client.chat.completions.create(model="scripted", messages=user("hello"), max_completion_tokens=3,
                                   temperature=0.0, top_p=0.5, presence_penalty=0.5, frequency_penalty=0.25,
                                   extra_body={"top_k": 7, "min_p": 0.1, "repetition_penalty": 1.1})
    p = scripted.engine.requests[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 0.5, 7, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.max_tokens) == (0.5, 0.25, 1.1, 3)


def test_n_choices_use_seeds_seed_plus_i(client, scripted):
    r = client.chat.completions.create(model="scripted", messages=user("hello"), seed=40, n=3, max_tokens=200)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [script_for("user\nhello", 40 + i) for i in range(3)]
    assert sorted(q.params.seed for q in scripted.engine.requests[-3:]) == [40, 41, 42]


def test_stop_string_across_tokens_is_cut_and_the_engine_request_ends(client, scripted, tok):
    # "STOP" is several tokens; the stop string also spans the space before it
    assert len(tok.encode(" STOP")) >= 1 and len(tok.encode("three STOP")) > 1
    for stream in (False, True):
        r = client.chat.completions.create(model="scripted", messages=user("stop test"), stop=["e STO", "zzz"],
                                           max_tokens=100, stream=stream)
        if stream:
            content, _, _, finish, _ = stream_text(r)
        else:
            content, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert content == "one two thre" and finish == "stop"
    scripted.wait_idle()


# ============================================================================
# Tools and thinking
# ============================================================================
def test_tool_call_round_trip(client, scripted, tok):
    r = client.chat.completions.create(model="scripted", messages=user("What is the weather in Paris?"),
                                       tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    assert choice.message.content is None
    assert choice.message.reasoning_content == "I should call the weather tool."
    # the tool list reached the prompt
    assert '"name": "get_weather"' in tok.decode(scripted.engine.requests[-1].prompt_ids)

    # send the result back: the template renders the call and the tool response into the prompt
    messages = user("What is the weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    r2 = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, max_tokens=200)
    assert r2.choices[0].message.content == "It is 18 degrees in Paris."
    assert r2.choices[0].finish_reason == "stop"
    prompt = tok.decode(scripted.engine.requests[-1].prompt_ids)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
            in prompt)
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response><|im_end|>' in prompt


def test_tool_call_streamed(client):
    stream = client.chat.completions.create(model="scripted", messages=user("weather in Paris?"), tools=TOOLS,
                                            max_tokens=200, stream=True)
    content, reasoning, calls, finish, _ = stream_text(stream)
    assert finish == "tool_calls" and content == "" and reasoning == "I should call the weather tool."
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}


def test_malformed_tool_call_is_left_as_content(client):
    r = client.chat.completions.create(model="scripted", messages=user("broken tool please"), tools=TOOLS,
                                       max_tokens=200)
    m = r.choices[0].message
    assert not m.tool_calls and r.choices[0].finish_reason == "stop"
    assert m.content.startswith("<tool_call>") and "{city: Paris}" in m.content


def test_without_tools_a_tool_call_tag_is_plain_content(client):
    r = client.chat.completions.create(model="scripted", messages=user("weather?"), max_tokens=200,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content.startswith("<think>") and WEATHER_CALL in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_thinking_goes_to_reasoning_content_and_reasoning(client, scripted):
    r = client.chat.completions.create(model="scripted", messages=user("think about 2+2"), max_tokens=200)
    m = r.choices[0].message
    assert m.content == "The answer is 4."
    assert m.reasoning_content == "Let me think: 2 + 2 = 4." and m.reasoning == m.reasoning_content
    stream = client.chat.completions.create(model="scripted", messages=user("think about 2+2"), max_tokens=200,
                                            stream=True)
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    both = [(getattr(c.choices[0].delta, "reasoning_content", None), getattr(c.choices[0].delta, "reasoning", None))
            for c in chunks if c.choices]
    assert content == "The answer is 4."
    assert "".join(a or "" for a, _ in both) == "Let me think: 2 + 2 = 4."
    assert all(a == b for a, b in both)


def test_thinking_off_puts_everything_in_content(client, scripted, tok):
    r = client.chat.completions.create(model="scripted", messages=user("think about 2+2"), max_tokens=200,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m = r.choices[0].message
    assert m.content == "<think>\nLet me think: 2 + 2 = 4.\n</think>\n\nThe answer is 4."
    assert not getattr(m, "reasoning_content", None)
    # the template closed the thinking block in the prompt
    assert tok.decode(scripted.engine.requests[-1].prompt_ids).endswith("<think>\n\n</think>\n\n")


# ============================================================================
# Completions and models
# ============================================================================
def test_completions_with_text_ids_echo_and_stream(client, scripted, tok):
    r = client.completions.create(model="scripted", prompt="<|im_start|>user\nhello", seed=5, max_tokens=300)
    expected = script_for("<|im_start|>user\nhello", 5)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(tok.encode("<|im_start|>user\nhello"))
    ids = tok.encode("<|im_start|>user\nhello")
    r2 = client.completions.create(model="scripted", prompt=ids, seed=5, max_tokens=300, echo=True)
    assert r2.choices[0].text == "<|im_start|>user\nhello" + expected
    chunks = list(client.completions.create(model="scripted", prompt=ids, seed=5, max_tokens=300, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_and_healthz(client, scripted):
    assert [m.id for m in client.models.list().data] == ["scripted"]
    h = httpx.get(scripted.url + "/healthz")
    assert h.status_code == 200 and h.json()["status"] == "ok"


# ============================================================================
# Bad input: a 4xx OpenAI error each, and the server keeps serving
# ============================================================================
def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(client, scripted):
    url = scripted.url + "/v1/chat/completions"
    ok = {"model": "scripted", "messages": user("hello"), "max_tokens": 3}
    cases = [
        ("invalid JSON", b'{"model": "scripted", "messages": [', 400),
        ("not an object", b"[1, 2]", 400),
        ("wrong type", json.dumps({**ok, "temperature": "hot"}).encode(), 400),
        ("wrong type bool", json.dumps({**ok, "max_tokens": True}).encode(), 400),
        ("messages not a list", json.dumps({**ok, "messages": "hi"}).encode(), 400),
        ("unknown model", json.dumps({**ok, "model": "gpt-4"}).encode(), 404),
        ("empty messages", json.dumps({**ok, "messages": []}).encode(), 400),
        ("bad role", json.dumps({**ok, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
        ("prompt too long", json.dumps({**ok, "messages": user("word " * 600)}).encode(), 400),
        ("negative max_tokens", json.dumps({**ok, "max_tokens": -1}).encode(), 400),
        ("temperature < 0", json.dumps({**ok, "temperature": -1}).encode(), 400),
        ("bad stop", json.dumps({**ok, "stop": [1, 2]}).encode(), 400),
        ("tool_choice required", json.dumps({**ok, "tools": TOOLS, "tool_choice": "required"}).encode(), 400),
    ]
    for name, body, status in cases:
        r = httpx.post(url, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == status, (name, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], name
        # and a good request right after still works
        good = client.chat.completions.create(model="scripted", messages=user("hello"), max_tokens=3)
        assert good.choices[0].finish_reason == "length", name
    r = httpx.post(scripted.url + "/v1/completions", json={"model": "scripted", "prompt": [10**7], "max_tokens": 2})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    r = httpx.get(scripted.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    # the official client raises its typed errors
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="scripted", messages=user("word " * 600), max_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=user("hello"), max_tokens=3)
    scripted.wait_idle()


# ============================================================================
# Load and faults
# ============================================================================
def test_32_concurrent_streams_all_complete(scripted):
    async def one(aclient, i):
        stream = await aclient.chat.completions.create(model="scripted", messages=user(f"hello {i}"), seed=i,
                                                       max_tokens=200, stream=True)
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return i, text, finish

    async def run():
        aclient = openai.AsyncOpenAI(base_url=scripted.url + "/v1", api_key="x", max_retries=0,
                                     http_client=openai.DefaultAsyncHttpxClient(
                                         limits=httpx.Limits(max_connections=64)))
        async with aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32
    for i, text, finish in results:
        assert finish == "stop"
        assert text == script_for(f"<|im_start|>user\nhello {i}", i)
    scripted.wait_idle()


def test_clients_that_disconnect_mid_request_abort_their_requests(scripted):
    engine = scripted.engine
    before = len(engine.aborted)
    n_requests = len(engine.requests)

    def leave_early(i):
        c = openai.OpenAI(base_url=scripted.url + "/v1", api_key="x", max_retries=0)
        stream = c.chat.completions.create(model="scripted", messages=user(f"endless {i}"), max_tokens=2000,
                                           stream=True)
        got = 0
        for chunk in stream:
            got += bool(chunk.choices and chunk.choices[0].delta.content)
            if got >= 3:
                break
        stream.close()      # drop the connection while the engine still generates
        c.close()

    def give_up_waiting(i):
        # a non-streaming client that times out: its request is aborted too
        with pytest.raises(httpx.TimeoutException):
            httpx.post(scripted.url + "/v1/chat/completions", timeout=0.5,
                       json={"model": "scripted", "messages": user(f"endless wait {i}"), "max_tokens": 2000})

    threads = [threading.Thread(target=leave_early, args=(i,)) for i in range(10)]
    threads += [threading.Thread(target=give_up_waiting, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    scripted.wait_idle(timeout=20)
    new_ids = {r.id for r in engine.requests[n_requests:]}
    assert len(new_ids) == 12
    assert set(engine.aborted[before:]) == new_ids         # every one aborted, nothing else
    assert not engine.running and not engine.has_work()    # the engine holds no request
    assert scripted.loop.sinks == {}


def test_api_key_is_enforced(model_dir, tok):
    engine = ScriptedEngine(tok)
    app = create_app(engine, tok, ChatTemplate.from_folder(model_dir), "scripted", folder=model_dir,
                     max_ctx=512, api_key="sekrit")
    server = LiveServer(app)
    try:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = httpx.get(server.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0)
        r = good.chat.completions.create(model="scripted", messages=user("hello"), max_tokens=4)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
        assert engine.requests and len(engine.requests) == 1     # the refused calls never reached it
    finally:
        server.close()


# ============================================================================
# The real stage-1 engine behind the same server
# ============================================================================
@pytest.fixture(scope="module")
def tiny_qwen3() -> Path:
    from models import make_model
    return make_model("qwen3", tokenizer=True)


@pytest.fixture(scope="module")
def stage1(tiny_qwen3):
    from stage1_cpu.engine import LLMEngine
    engine = LLMEngine(tiny_qwen3, max_ctx=256, progress=False)
    tok = Tokenizer(tiny_qwen3)
    app = create_app(engine, tok, ChatTemplate.from_folder(tiny_qwen3), "tiny-qwen3", folder=tiny_qwen3)
    server = LiveServer(app)
    server.engine, server.tok = engine, tok
    yield server
    server.close()


def test_stage1_greedy_completion_matches_transformers(stage1, tiny_qwen3):
    from models import hf_greedy
    c = openai.OpenAI(base_url=stage1.url + "/v1", api_key="x", max_retries=0)
    ids = stage1.tok.encode("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    r = c.completions.create(model="tiny-qwen3", prompt=ids, max_tokens=8, temperature=0,
                             extra_body={"ignore_eos": True})
    expected = hf_greedy(tiny_qwen3, ids, 8)
    assert r.choices[0].text == stage1.tok.decode(expected) and r.choices[0].text
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == len(ids)
    assert r.choices[0].finish_reason == "length"


def test_stage1_chat_stream_equals_non_stream_for_the_same_seed(stage1):
    c = openai.OpenAI(base_url=stage1.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny-qwen3", messages=user("Tell me a story"), max_tokens=12, temperature=1.0, seed=123,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    full = c.chat.completions.create(**kw)
    content, _, _, finish, usage = stream_text(c.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert full.usage.completion_tokens == 12 and usage.completion_tokens == 12
    assert content == full.choices[0].message.content and content.strip()
    assert finish == full.choices[0].finish_reason == "length"
    other = c.chat.completions.create(**{**kw, "seed": 124})
    assert other.choices[0].message.content != content      # the seed matters
    stage1.wait_idle()
    assert not stage1.engine.has_work()


def test_stage1_serve_command_health_and_api_key(tiny_qwen3):
    """python -m stage1_cpu.serve end to end: 503 while loading is allowed, then 200,
    the API key enforced, a chat answered."""
    proc = subprocess.Popen([sys.executable, "-m", "stage1_cpu.serve", "--model", str(tiny_qwen3),
                             "--addr", "127.0.0.1:0", "--max-ctx", "128", "--api-key", "k3y",
                             "--served-model-name", "tiny", "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert m, line + (proc.stdout.read() if proc.poll() is not None else "")
        url = f"http://127.0.0.1:{m.group(1)}"
        statuses = set()
        deadline = time.time() + 120
        while True:
            s = httpx.get(url + "/healthz").status_code
            statuses.add(s)
            if s == 200:
                break
            assert s == 503 and proc.poll() is None and time.time() < deadline
            time.sleep(0.1)
        assert httpx.get(url + "/v1/models").status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key="k3y", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny"]
        r = c.chat.completions.create(model="tiny", messages=user("hi"), max_tokens=3,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
