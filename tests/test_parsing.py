"""Qwen3 output parsing (<think>, <tool_call>) and stop strings, on text split every way."""
from __future__ import annotations

import json

import pytest

from common.parsing import Delta, StreamParser, parse_output, prompt_opens_think
from common.stopping import StopChecker

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FULL = "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n" + CALL + "\n" + \
       '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>'


def run(text: str, sizes, **kw) -> list[Delta]:
    """Feed text in pieces of the given sizes (cycled)."""
    p = StreamParser(**kw)
    out, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        out += p.feed(text[i:i + n])
        i, k = i + n, k + 1
    return out + p.finish()


def merge(out: list[Delta]) -> list[Delta]:
    """Same-kind neighbours joined (a stream sends text in many small deltas)."""
    merged: list[Delta] = []
    for d in out:
        assert d.kind == "tool_call" or d.text, "no empty deltas"
        if merged and d.kind == merged[-1].kind != "tool_call":
            merged[-1] = Delta(d.kind, merged[-1].text + d.text)
        else:
            merged.append(d)
    return merged


def summary(deltas: list[Delta]):
    deltas = merge(deltas)
    return [(d.kind, d.text if d.kind != "tool_call" else
             (d.tool_call["function"]["name"], json.loads(d.tool_call["function"]["arguments"])))
            for d in deltas]


EXPECTED = [("reasoning", "The user wants the weather."), ("content", "Let me check."),
            ("tool_call", ("get_weather", {"city": "Paris"})),
            ("tool_call", ("get_time", {"tz": "CET"}))]


@pytest.mark.parametrize("sizes", [[len(FULL)], [1], [2], [3], [5, 1, 7], [13]])
def test_any_split_of_the_text_gives_the_same_deltas(sizes):
    assert summary(run(FULL, sizes)) == EXPECTED


def test_tool_call_has_id_type_and_json_string_arguments():
    content, reasoning, calls = parse_output(CALL)
    assert content == "" and reasoning == ""
    (call,) = calls
    assert call["id"].startswith("call_") and len(call["id"]) > 10 and call["type"] == "function"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert parse_output(CALL)[2][0]["id"] != call["id"]      # a fresh id each time


def test_partial_tags_are_held_back_until_decided():
    p = StreamParser()
    assert p.feed("Hello <too") == [Delta("content", "Hello")]
    assert p.feed("l_cal") == []          # still could be <tool_call>
    out = p.feed('l>{"name": "f", "arguments": {}}</tool_call>')
    assert [d.kind for d in out] == ["tool_call"] and out[0].tool_call["function"]["name"] == "f"
    p = StreamParser()
    assert p.feed("a <thin") == [Delta("content", "a")]
    # not a tag after all: released as text
    assert p.feed("g> b") == [Delta("content", " <thing> b")]


def test_reasoning_close_tag_split_across_pieces():
    p = StreamParser()
    out = p.feed("<think>abc</th") + p.feed("ink>answer")
    assert summary(out + p.finish()) == [("reasoning", "abc"), ("content", "answer")]


def test_malformed_json_in_a_tool_call_is_left_as_content():
    bad = '<tool_call>\n{"name": "f", "arguments": {x: 1}\n</tool_call>'
    content, reasoning, calls = parse_output("Sure. " + bad)
    assert calls == [] and content == "Sure." + bad
    # JSON that is not a call (no name) stays content too
    content, _, calls = parse_output('<tool_call>[1, 2]</tool_call>')
    assert calls == [] and content == "<tool_call>[1, 2]</tool_call>"


def test_unclosed_tool_call_at_the_end():
    # cut by max_tokens after a complete object: still a call
    _, _, calls = parse_output('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert [c["function"]["name"] for c in calls] == ["f"]
    # cut in the middle of the JSON: the text is returned as it came
    content, _, calls = parse_output('<tool_call>\n{"name": "f", "argu')
    assert calls == [] and content == '<tool_call>\n{"name": "f", "argu'


def test_output_that_starts_inside_thinking():
    # the prompt opened <think>; the output only closes it
    assert (parse_output("I reason here.\n</think>\n\nThe answer.")
            == ("The answer.", "I reason here.", []))
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_think("<|im_start|>assistant\n")
    p = StreamParser(start_in_reasoning=True)
    out = p.feed("I rea") + p.feed("son.</thi") + p.feed("nk>\n\nDone.") + p.finish()
    assert summary(out) == [("reasoning", "I reason."), ("content", "Done.")]


def test_thinking_off_and_tools_off_leave_tags_as_content():
    text = "<think>\nx\n</think>\n\nhi " + CALL
    assert parse_output(text, thinking=False, tools=False) == (text, "", [])
    content, reasoning, calls = parse_output(text, thinking=True, tools=False)
    assert (content, reasoning, calls) == ("hi " + CALL, "x", [])
    content, reasoning, calls = parse_output(text, thinking=False, tools=True)
    assert content == "<think>\nx\n</think>\n\nhi" and len(calls) == 1


def test_plain_text_passes_through_unchanged_inside():
    text = "Line one.\n\n  Line two with <b>html</b> and a < sign."
    assert parse_output(text) == (text, "", [])
    assert summary(run(text, [1])) == [("content", text)]


# ---- stop strings ---------------------------------------------------------------
def stop_run(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    s = StopChecker(stops)
    out = [s.feed(p) for p in pieces]
    if not s.stopped:
        out.append(s.flush())
    return out, s.stopped


def test_stop_string_across_pieces_is_cut_and_not_returned():
    out, stopped = stop_run(["Hello wo", "rld\n\nUs", "er: more", " text"], ["\n\nUser:"])
    assert stopped and "".join(out) == "Hello world"
    # the held-back tail was never returned early
    assert out[1] == "rld"


def test_stop_checker_holds_back_only_a_possible_prefix_and_releases_it():
    s = StopChecker(["STOP"])
    assert s.feed("abc ST") == "abc "
    assert s.feed("AR") == "STAR"          # not a stop string after all
    assert s.feed("S") == ""
    assert s.flush() == "S"


def test_earliest_stop_string_wins_and_nothing_after_it():
    s = StopChecker(["cd", "b"])
    assert s.feed("abcd") == "a" and s.stopped
    assert s.feed("more") == "" and s.flush() == ""


def test_no_stop_strings_is_a_pass_through():
    s = StopChecker([])
    assert s.feed("abc") == "abc" and s.flush() == "" and not s.stopped
