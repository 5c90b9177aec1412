"""The prompt side of tool calling, without a server: the tools preamble for templates that
know no tools (SmolLM2's), the history conversion (past calls, tool results), and the native
path through a template that renders tools itself."""

from __future__ import annotations

import json

import pytest

from openai_helpers import WEATHER
from srt_lite.entrypoints.openai.protocol import ChatCompletionRequest
from srt_lite.entrypoints.openai.tool_prompt import (
    preamble,
    preamble_messages,
    render_inputs,
    template_source,
    template_supports_tools,
)
from srt_lite.entrypoints.openai.tools import plan_tools
from srt_lite.managers.validation import RequestError

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25C"},
]

# A template that renders tools the way Qwen2.5's does (tools listed with `tojson`, a past
# call's arguments with `tojson`, tool results as <tool_response> in a user turn).
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and tools %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content }}"
    "{%- for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def request(messages=HISTORY, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **fields})


def test_preamble_lists_tools_and_asks_for_the_mode_format():
    plan = plan_tools(request(tools=[WEATHER]))
    text = preamble(plan)
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0]
    assert [json.loads(line) for line in listed.splitlines()] == [WEATHER]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    required = preamble(plan_tools(request(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)))
    assert "exactly one of these functions" in required and '"parameters"' in required
    named = preamble(plan_tools(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})))
    assert 'Call the function "get_weather" now' in named


def test_history_conversion_on_the_preamble_path():
    plan = plan_tools(request(tools=[WEATHER]))
    out = preamble_messages(request(tools=[WEATHER]).messages, plan)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"] == "Be brief.\n\n" + preamble(plan)  # merged into the system message
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    # consecutive tool results: one user turn
    assert out[3]["content"] == "<tool_response>\n18C\n</tool_response>\n<tool_response>\n25C\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)


def test_preamble_without_a_system_message_and_with_text_before_calls():
    msgs = [HISTORY[1], {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]}, HISTORY[3]]
    req = request(msgs, tools=[WEATHER])
    out = preamble_messages(req.messages, plan_tools(req))
    assert out[0] == {"role": "system", "content": preamble(plan_tools(req))}
    assert out[2]["content"].startswith("Let me look.\n<tool_call>\n")


def test_tool_choice_none_renders_history_but_no_tools():
    req = request(tools=[WEATHER], tool_choice="none")
    out = preamble_messages(req.messages, plan_tools(req))
    assert out[0]["content"] == "Be brief." and "<tools>" not in json.dumps(out)
    assert "<tool_call>" in out[2]["content"]


def test_smollm2_template_renders_the_preamble(tokenizer):
    """SmolLM2's own template knows no tools: the preamble path, end to end."""
    source = template_source(tokenizer, None)
    assert not template_supports_tools(source)
    req = request(tools=[WEATHER])
    messages, kwargs = render_inputs(req.messages, plan_tools(req), native=False)
    assert kwargs == {}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<|im_start|>user\n<tool_response>\n18C" in text and text.endswith("<|im_start|>assistant\n")
    assert "helpful AI assistant named SmolLM" not in text  # the system message replaces the default one


def test_native_template_gets_tools_and_parsed_arguments(tokenizer):
    assert template_supports_tools(template_source(tokenizer, NATIVE_TEMPLATE))
    req = request(tools=[WEATHER])
    messages, kwargs = render_inputs(req.messages, plan_tools(req), native=True)
    assert kwargs == {"tools": [WEATHER]}
    assert messages[2]["tool_calls"][0] == {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert messages[2]["content"] == "" and messages[3]["tool_call_id"] == "call_1"
    text = tokenizer.apply_chat_template(messages, chat_template=NATIVE_TEMPLATE, tokenize=False, add_generation_prompt=True, **kwargs)
    # arguments come out as JSON once, not as a quoted string
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert json.dumps(WEATHER["function"]["name"]) in text and "<tool_response>25C</tool_response>" in text
    # tool_choice none: no tools for the template
    none = request(tools=[WEATHER], tool_choice="none")
    assert render_inputs(none.messages, plan_tools(none), native=True)[1] == {}


def test_arguments_that_are_not_json_stay_text():
    msgs = [HISTORY[1], {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get_weather", "arguments": "city=Paris"}}]}]
    req = request(msgs)
    assert render_inputs(req.messages, plan_tools(req), native=True)[0][1]["tool_calls"][0]["function"]["arguments"] == "city=Paris"
    out = preamble_messages(req.messages, plan_tools(req))
    assert '"arguments": "city=Paris"' in out[1]["content"]


@pytest.mark.parametrize(
    "message,named",
    [
        ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]}, "messages[1].tool_calls[0].function.name"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}]}, "messages[1].tool_calls[0].function.arguments"),
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages[1].tool_calls"),
        ({"role": "tool", "content": [{"type": "image_url"}]}, "messages[1].content"),
    ],
)
def test_bad_history_names_the_field(message, named):
    req = request([HISTORY[1], message])
    for native in (True, False):
        with pytest.raises(RequestError, match=named.replace("[", r"\[").replace("]", r"\]")):
            render_inputs(req.messages, plan_tools(req), native)
