"""ChatTemplate renders exactly what transformers' apply_chat_template(tokenize=False)
renders, on the real Qwen3 template; the built-in ChatML follows Qwen3's format."""
from __future__ import annotations

import json

import pytest

from bench.testbed.qwen_tokenizer import TEMPLATE_PATH
from common.chat_template import BUILTIN_CHATML, ChatTemplate, ChatTemplateError

SYSTEM = {
    "role": "system",
    "content": "You are a helpful assistant. Réponds en français si besoin.",
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city. Use <city> names & 'quotes' as given.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string",
                                               "description": "城市, e.g. Zürich"},
                                      "unit": {"type": "string",
                                               "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]},
    },
}
MULTI_TURN = [
    SYSTEM,
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nEasy: 4.\n</think>\n\n2+2 = 4."},
    {"role": "user", "content": "And 3*3? Answer in one word."},
]
TOOL_CHAIN = [
    SYSTEM,
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool twice.",
     "tool_calls": [
         {"type": "function", "id": "call_1",
          "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
         {"type": "function", "id": "call_2",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}},
     ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"sunny\"}"},
    {"role": "tool", "tool_call_id": "call_2", "content": "{\"temp\": 15, \"sky\": \"rain\"}"},
]
TOOL_CHAIN_ANSWERED = TOOL_CHAIN + [
    {"role": "assistant", "content": "Paris: 21 °C and sunny; Zürich: 15 °C with rain."},
    {"role": "user", "content": "Thanks! Which one is warmer?"},
]

CASES = [   # (name, messages, tools, add_generation_prompt, enable_thinking)
    ("multi_turn_thinking", MULTI_TURN, None, True, True),
    ("multi_turn_no_thinking", MULTI_TURN, None, True, False),
    ("no_generation_prompt", MULTI_TURN[:3], None, False, True),
    ("tools_no_system", MULTI_TURN[1:2], [WEATHER_TOOL], True, True),
    ("tool_chain_thinking", TOOL_CHAIN, [WEATHER_TOOL], True, True),
    ("tool_chain_no_thinking", TOOL_CHAIN, [WEATHER_TOOL], True, False),
    ("tool_chain_answered", TOOL_CHAIN_ANSWERED, [WEATHER_TOOL], True, True),
]


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir) -> ChatTemplate:
    return ChatTemplate.from_folder(qwen3_tokenizer_dir)


@pytest.mark.parametrize("name,messages,tools,gen,thinking", CASES, ids=[c[0] for c in CASES])
def test_qwen3_template_matches_transformers(
    qwen3, qwen3_hf_tokenizer, name, messages, tools, gen, thinking
):
    ours = qwen3.render(messages, add_generation_prompt=gen, enable_thinking=thinking, tools=tools)
    theirs = qwen3_hf_tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=gen, enable_thinking=thinking
    )
    assert ours == theirs
    assert ours.count("<|im_start|>") >= 2


def test_qwen3_template_output_has_expected_pieces(qwen3):
    text = qwen3.render(TOOL_CHAIN, tools=[WEATHER_TOOL], enable_thinking=False)
    # tools as JSON lines in the system turn, non-ASCII kept, nothing HTML-escaped
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert "\n<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in text
    # the reasoning of the current tool chain is kept, the calls follow it
    assert ("<|im_start|>assistant\n<think>\nI need the weather tool twice.\n</think>\n\n"
            "<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            "</tool_call>\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
            "</tool_call><|im_end|>\n") in text
    # consecutive tool results share one user turn
    assert ("<|im_start|>user\n"
            "<tool_response>\n{\"temp\": 21, \"sky\": \"sunny\"}\n</tool_response>\n"
            "<tool_response>\n{\"temp\": 15, \"sky\": \"rain\"}\n</tool_response>"
            "<|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.has_thinking


def test_content_none_with_tool_calls_renders_as_empty(qwen3):
    # OpenAI clients send content=null next to tool_calls
    with_none = [dict(m, content=None) if m.get("tool_calls") else m for m in TOOL_CHAIN]
    assert (qwen3.render(with_none, tools=[WEATHER_TOOL])
            == qwen3.render(TOOL_CHAIN, tools=[WEATHER_TOOL]))


@pytest.mark.parametrize("name,messages,tools,gen,thinking", CASES, ids=[c[0] for c in CASES])
def test_builtin_chatml_renders_like_qwen3(qwen3, name, messages, tools, gen, thinking):
    builtin = ChatTemplate(BUILTIN_CHATML)
    kwargs = dict(add_generation_prompt=gen, enable_thinking=thinking, tools=tools)
    assert builtin.render(messages, **kwargs) == qwen3.render(messages, **kwargs)


def test_builtin_chatml_documented_format():
    builtin = ChatTemplate(BUILTIN_CHATML)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\nGreeting.\n</think>\n\nHello!"},
                {"role": "user", "content": "Bye"}]
    assert builtin.render(messages, enable_thinking=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"           # old reasoning dropped
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (
        builtin.render(messages[1:2]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert builtin.has_thinking and builtin.is_builtin
    with pytest.raises(ChatTemplateError, match="unknown message role"):
        builtin.render([{"role": "narrator", "content": "x"}])


def test_from_folder_sources(tmp_path, qwen3_tokenizer_dir):
    # no template anywhere: the built-in ChatML
    assert ChatTemplate.from_folder(tmp_path).is_builtin
    # a list of named templates: "default"
    cfg = {"eos_token": {"content": "</s>"}, "bos_token": "<s>",
           "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                             {"name": "default",
                              "template": "{{ bos_token }}{{ messages[0].content }}"
                                          "{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert (
        ChatTemplate.from_folder(tmp_path).render([{"role": "user", "content": "hi"}])
        == "<s>hi</s>"
    )
    # chat_template.jinja wins over tokenizer_config.json, as in transformers
    (tmp_path / "chat_template.jinja").write_text("[{{ messages | length }}]")
    template = ChatTemplate.from_folder(tmp_path)
    assert (
        template.render([{"role": "user", "content": "hi"}]) == "[1]" and not template.has_thinking
    )
    # the Qwen3 test folder carries the real template
    assert (ChatTemplate.from_folder(qwen3_tokenizer_dir).source
            == TEMPLATE_PATH.read_text(encoding="utf-8"))


def test_template_helpers_match_transformers():
    template = ChatTemplate("{{ tools | tojson(indent=2) }}|"
                            "{{ 'x' if strftime_now('%Y') | int > 2000 }}"
                            "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                            "{{ m.content }}"
                            "{% endfor %}{% generation %}G{% endgeneration %}")
    tools = [{"name": "f", "description": "<b> & 'é'"}]
    out = template.render(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], tools=tools
    )
    assert out == json.dumps(tools, ensure_ascii=False, indent=2) + "|xaG"


def test_template_errors_are_clear():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% if %}")
    failing = ChatTemplate("{{ raise_exception('System role not supported') }}")
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        failing.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="failed"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
