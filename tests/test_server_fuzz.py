"""A property-based fuzz test of the server: hostile bodies never get a 5xx.

Hypothesis writes chat and completion bodies, valid ones and mutated ones (a
value of the wrong type anywhere, a key dropped or added, deep nesting, lone
surrogates, NaN, cut or corrupted bytes, bodies over the size limit, the wrong
endpoint), and sends them over loopback to the real server in front of the
stage-2 engine on device="cpu" (the engine with a paged KV cache, so a leak shows
as pages that never come back). Properties:

  * no response is a 5xx, and every error is an OpenAI error body;
  * a 200 is a well-formed answer (a JSON completion, or an SSE stream that ends
    with [DONE] and carries no server error);
  * afterwards the server is alive, every KV page is free again, and a greedy
    request still gets transformers' tokens.

The run is bounded in time (FUZZ_SECONDS, default 60) and in requests
(FUZZ_MAX_REQUESTS, default 5000); it prints how many requests it sent.
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bench.testbed.models import hf_greedy, make_model
from common.chat_template import ChatTemplate
from common.server import Limits, create_app
from common.tokenizer import Tokenizer
from test_server import LiveServer

FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", "60"))
FUZZ_MAX_REQUESTS = int(os.environ.get("FUZZ_MAX_REQUESTS", "5000"))
MAX_CTX = 128
BODY_LIMIT = 64 * 2**10          # small, so that "over the limit" is cheap to send


# ============================================================================
# Bodies
# ============================================================================
# text: any Unicode scalar values (hypothesis leaves out lone surrogates; a mutation adds them)
text = st.text(max_size=30)
nonempty = st.text(min_size=1, max_size=12)
leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                 text)
json_value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=8), inner,
                                                                        max_size=3)),
                          max_leaves=8)

part = st.fixed_dictionaries({"type": st.just("text"), "text": text})
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
     "content": st.one_of(text, st.lists(part, max_size=2), st.none())},
    optional={"name": nonempty, "tool_call_id": nonempty, "reasoning_content": text})
function = st.fixed_dictionaries({"name": nonempty}, optional={
    "description": text, "parameters": st.dictionaries(nonempty, json_value, max_size=2)})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": function})
sampling = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 100),
    "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2),
    "seed": st.integers(0, 2**63 - 1), "n": st.integers(1, 2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(nonempty, st.lists(nonempty, max_size=3)), "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 151_000), max_size=3), "logit_bias": st.just({}),
    "user": text,
}
# max_tokens is always there in a valid body (1..4), so the engine work of one request stays small
chat_body = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.lists(message, min_size=1, max_size=3),
     "max_tokens": st.integers(1, 4)},
    optional={**sampling, "tools": st.lists(tool, max_size=2),
              "tool_choice": st.sampled_from(["auto", "none"]),
              "chat_template_kwargs": st.fixed_dictionaries(
                  {}, optional={"enable_thinking": st.booleans()})})
token_ids = st.lists(st.integers(0, 151_000), min_size=1, max_size=12)
completion_body = st.fixed_dictionaries(
    {"model": st.just("tiny"), "max_tokens": st.integers(1, 4),
     "prompt": st.one_of(nonempty, token_ids,
                         st.lists(st.one_of(nonempty, token_ids), min_size=1, max_size=2))},
    optional={**sampling, "echo": st.booleans()})


def containers(value, out=None) -> list:
    """Every (container, key) in a JSON value: the places a mutation can change."""
    out = [] if out is None else out
    if isinstance(value, dict):
        for k, v in value.items():
            out.append((value, k))
            containers(v, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append((value, i))
            containers(v, out)
    return out


@st.composite
def mutated(draw, body_strategy) -> bytes:
    """A valid body, then one (or two) hostile changes, as bytes."""
    body = draw(body_strategy)
    nests: list[tuple] = []
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["replace", "replace", "drop", "add", "nest", "surrogate",
                                     "nan", "big int"]))
        places = containers(body)
        where, key = draw(st.sampled_from(places))
        if kind == "replace":                     # a value of any type anywhere
            where[key] = draw(json_value)
        elif kind == "drop" and isinstance(where, dict):
            del where[key]
        elif kind == "add":
            target = where if isinstance(where, dict) else body
            target[draw(st.text(max_size=10))] = draw(json_value)
        # deep nesting, sometimes past json.loads' recursion limit
        elif kind == "nest":
            # written as bytes after json.dumps (which would recurse as deep itself)
            depth = draw(st.sampled_from([63, 65, 200, 5000]))
            bracket = draw(st.sampled_from(["[]", "{}"]))
            opener = b"[" if bracket == "[]" else b'{"k": '
            closer = b"]" if bracket == "[]" else b"}"
            # written below, big ints too
            nests.append((opener * depth, where[key], closer * depth))
            where[key] = f"__nest{len(nests) - 1}__"
        # a lone surrogate, written as a \u escape by json.dumps
        elif kind == "surrogate":
            where[key] = draw(text) + chr(draw(st.integers(0xD800, 0xDFFF))) + draw(text)
        elif kind == "nan":
            where[key] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
        elif kind == "big int":
            where[key] = draw(st.sampled_from([10**30, -(10**30), 2**63, 10**5000]))
    old = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)                 # so that the 5000-digit integer can be written
    try:
        # ensure_ascii: lone surrogates become "\udxxx" escapes
        raw = json.dumps(body).encode()
        for i, (opened, inner, closed) in enumerate(nests):
            raw = raw.replace(f'"__nest{i}__"'.encode(),
                              opened + json.dumps(inner).encode() + closed)
    finally:
        sys.set_int_max_str_digits(old)
    cut = draw(st.sampled_from(["none", "none", "none", "truncate", "byte", "pad"]))
    if cut == "truncate":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif cut == "byte":
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i:]
    elif cut == "pad":                            # over the body limit
        raw = raw[:-1] + b', "pad": "' + b"x" * BODY_LIMIT + b'"}'
    return raw


def valid(body_strategy):
    return body_strategy.map(lambda b: json.dumps(b).encode())


endpoint = st.sampled_from(["/v1/chat/completions", "/v1/completions"])
request = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), valid(chat_body)),
    st.tuples(st.just("/v1/completions"), valid(completion_body)),
    st.tuples(st.just("/v1/chat/completions"), mutated(chat_body)),
    st.tuples(st.just("/v1/completions"), mutated(completion_body)),
    # maybe the wrong endpoint
    st.tuples(endpoint, valid(st.one_of(chat_body, completion_body))),
    st.tuples(endpoint, json_value.map(lambda v: json.dumps(v).encode())),   # not an object
    st.tuples(endpoint, st.binary(max_size=64)),                              # not JSON
)


# ============================================================================
# The server under test
# ============================================================================
@pytest.fixture(scope="module")
def stage2_server():
    from stage2_batched.engine import LLMEngine
    folder = make_model("qwen3", tokenizer=True)
    # a small page pool: 16 pages of 16 positions, two full-length sequences' worth
    engine = LLMEngine(folder, max_ctx=MAX_CTX, slots=4, token_budget=64, page_size=16,
                       num_pages=16, device="cpu", progress=False)
    tok = Tokenizer(folder)
    app = create_app(engine, tok, ChatTemplate.from_folder(folder), "tiny", folder=folder,
                     max_ctx=MAX_CTX, limits=Limits(max_body_bytes=BODY_LIMIT))
    server = LiveServer(app)
    server.engine, server.tok, server.folder = engine, tok, folder
    yield server
    server.close()


def check_answer(r: httpx.Response, body: bytes, stream_text: str | None) -> str:
    """The response's class ("2xx", "4xx"); fails on a 5xx or a malformed answer."""
    assert r.status_code < 500, (r.status_code, r.text[:300], body[:300])
    if r.status_code >= 400:
        err = json.loads(r.text)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text[:300]
        return "4xx"
    assert r.status_code == 200
    if stream_text is not None:
        events = [line[len("data: "):] for line in stream_text.split("\n")
                  if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", stream_text[-300:]
        for e in events[:-1]:
            obj = json.loads(e)
            assert "error" not in obj or obj["error"]["type"] != "server_error", e
        return "2xx"
    obj = r.json()
    assert obj["choices"] and all(
        c["finish_reason"] in ("stop", "length", "tool_calls") for c in obj["choices"]
    )
    assert obj["usage"]["completion_tokens"] >= 1
    return "2xx"


def test_fuzzed_bodies_never_get_a_5xx_and_leak_no_kv_pages(stage2_server, capsys):
    server, engine = stage2_server, stage2_server.engine
    assert engine.num_free_pages() == engine.num_total_pages() == 16
    counts: Counter = Counter()
    end = time.monotonic() + FUZZ_SECONDS
    client = httpx.Client(
        base_url=server.url, timeout=60, headers={"Content-Type": "application/json"}
    )

    # no shrinking: it would resend hundreds of requests and break the time bound; a failure
    # prints the example that failed as it was generated
    @settings(max_examples=20, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(request, st.sampled_from(["read", "read", "read", "leave"]))
    def one(req, how):
        if time.monotonic() > end or sum(counts.values()) >= FUZZ_MAX_REQUESTS:
            return
        path, body = req
        streaming = b'"stream": true' in body
        with client.stream("POST", path, content=body) as r:
            if streaming and r.status_code == 200 and how == "leave":
                next(r.iter_raw(), None)          # a client that reads one chunk and goes away
                counts["left"] += 1
                counts["2xx"] += 1
                return
            r.read()
            text = r.text if streaming and r.status_code == 200 else None
            counts[check_answer(r, body, text)] += 1

    try:
        while time.monotonic() < end and sum(counts.values()) < FUZZ_MAX_REQUESTS:
            one()
    finally:
        client.close()
    sent = counts["2xx"] + counts["4xx"]
    with capsys.disabled():
        print(f"\n[fuzz] {sent} requests in {FUZZ_SECONDS:.0f} s: {counts['2xx']} answered "
              f"({counts['left']} streams left early), {counts['4xx']} refused with a 4xx, "
              "0 with a 5xx")
    assert counts["2xx"] > 0 and counts["4xx"] > 0

    # afterwards: alive, nothing left in the engine, every KV page back on the free list
    server.wait_idle(timeout=60)
    assert not engine.has_work()
    assert engine.num_free_pages() == engine.num_total_pages()
    deadline = time.monotonic() + 10
    # a reply goes out a moment before its request stops counting
    while server.app.state.server.in_flight:
        assert time.monotonic() < deadline, "requests still count against --max-concurrent"
        time.sleep(0.02)
    assert httpx.get(server.url + "/healthz").json()["status"] == "ok"
    # and it still computes the right thing: transformers' greedy tokens
    ids = server.tok.encode("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == server.tok.decode(hf_greedy(server.folder, ids, 5))
    assert r.json()["usage"]["completion_tokens"] == 5
