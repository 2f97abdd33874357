"""A request body's bytes -> a protocol model (on a prepare thread), with the checks
pydantic's JSON parser leaves to us: nesting depth, lone surrogates, NaN."""
from __future__ import annotations

import json
import re

from pydantic import ValidationError

from common.api_protocol import APIError, Strict, bad_request, invalid_field, param_of

# A lone UTF-16 surrogate ("\ud800" written as an escape, or its bytes) is not Unicode:
# we answer 400 naming the field rather than replace it with U+FFFD (docs/server.md).
_SURROGATE = re.compile("[\ud800-\udfff]")
# the tokens of a JSON text that matter for nesting: strings (skipped whole), brackets, separators
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},:]', re.DOTALL)


def parse_request(model: type[Strict], raw: bytes, max_depth: int) -> Strict:
    """The body as `model`, or a 400 that names the field (404 for an unknown model is the caller's).

    pydantic's JSON parser refuses a lone surrogate, nesting past its own limit and an
    integer of more than 4300 digits with no field to name, and it reads NaN; so the
    reference parser reads the body first, and its answer is walked for what we refuse."""
    check_json(strict_json(raw, max_depth), max_depth)
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise invalid_field(e.errors(include_url=False)[0]) from None


def strict_json(raw: bytes, max_depth: int):
    """json.loads without NaN / Infinity; a 400 that says what is wrong with the text."""
    def no_constant(name):
        raise ValueError(f"{name} is not valid JSON (JSON has no NaN or Infinity); send a number or null")
    try:
        body = json.loads(raw, parse_constant=no_constant)
    except RecursionError:
        raise _too_deep(_deep_where(raw, max_depth), max_depth) from None
    except ValueError as e:
        # not JSON, bytes that are not UTF-8, NaN, an integer of more than 4300 digits
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got a JSON {type(body).__name__}")
    return body


def _too_deep(keys: list, max_depth: int) -> APIError:
    """Names the field by its first four keys (messages[0].content[0]); the message shows
    the path to the container that is too deep, cut at 80 characters."""
    # a body that is an array has no field to name (and is refused for not being an object anyway)
    field = param_of(keys[:4]) if keys and isinstance(keys[0], str) else None
    full = param_of(keys) or ""
    at = f" (at {full[:80]}{'...' if len(full) > 80 else ''})" if full != field else ""
    return bad_request(f"{field or 'the request body'} nests arrays/objects more than {max_depth} levels "
                       f"deep{at}; send a flatter structure", field)


def _deep_where(raw: bytes, max_depth: int) -> list:
    """The keys down to the first array/object deeper than max_depth, from the raw bytes
    (json.loads gave up with RecursionError); the scan stops there: 100,000 '[' cost 65 steps."""
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
            frames[-1][1] = None if frames[-1][0] else frames[-1][1] + 1
        elif t == b":":
            frames[-1][1] = frames[-1][2]
        else:                   # a string: maybe the key of the next ':'
            try:
                frames[-1][2] = json.loads(t)
            except ValueError:
                frames[-1][2] = t.decode("utf-8", "replace")
    return ["?" if key is None else key for _obj, key, _last in frames]


def check_json(body: dict, max_depth: int) -> None:
    """One walk over a parsed body: a 400 naming the field for nesting deeper than max_depth
    or a lone surrogate in a string or key."""
    stack = [(body, 1, [])]       # (container, its depth, its keys from the body)
    while stack:
        value, depth, keys = stack.pop()
        if depth > max_depth:
            raise _too_deep(keys, max_depth)
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(key, str) and _SURROGATE.search(key):
                raise bad_request(f"{param_of(keys) or 'the request body'} has a key with a lone UTF-16 surrogate; "
                                  "send valid Unicode (a surrogate must be half of a pair)", param_of(keys))
            if isinstance(item, str) and (m := _SURROGATE.search(item)):
                path = param_of(keys + [key])
                raise bad_request(f"{path} contains a lone UTF-16 surrogate (\\u{ord(m.group()):04x} at character "
                                  f"{m.start()}), which is not valid Unicode; send the character as a surrogate "
                                  "pair, or leave it out", path)
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1, keys + [key]))
