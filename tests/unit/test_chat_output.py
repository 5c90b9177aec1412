"""One chat choice's output -> reasoning_content / content / tool_calls, without a server:
the whole-output and the streamed paths must agree for every way the text is chunked."""

from __future__ import annotations

import json

import pytest

from srt_lite.entrypoints.openai.chat_output import ChoiceOutput
from srt_lite.parser.reasoning_parser import ReasoningParser

HERMES_OUT = (
    "<think>\nNeed the weather.\n</think>\n\n"
    'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
NAMES = {"get_weather", "get_time"}


def hermes() -> ChoiceOutput:
    return ChoiceOutput(ReasoningParser("qwen3"), "hermes", NAMES)


def stream(out: ChoiceOutput, text: str, size: int) -> tuple[str, str, list[dict]]:
    """Feeds `text` in pieces of `size` characters; returns (reasoning, content, calls) as a
    client reassembles them, checking the OpenAI delta layout on the way."""
    reasoning = content = ""
    calls: dict[int, dict] = {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        for delta in out.feed(piece, final=k == len(pieces) - 1):
            assert delta, "no empty deltas"
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
            for d in delta.get("tool_calls", []):
                assert len(delta) == 1 and len(delta["tool_calls"]) == 1  # one call step per event
                if "id" in d:
                    assert d["index"] not in calls and d["type"] == "function" and d["function"]["arguments"] == ""
                    calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
                else:
                    assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                    calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return reasoning, content, [calls[i] for i in sorted(calls)]


def test_reasoning_then_hermes_calls():
    msg = hermes().parse(HERMES_OUT)
    assert msg.reasoning == "\nNeed the weather.\n"
    assert msg.content == "Checking."  # the whitespace before a call is dropped
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in msg.tool_calls)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, 1000])
def test_streamed_equals_whole(size):
    whole = hermes().parse(HERMES_OUT)
    reasoning, content, calls = stream(hermes(), HERMES_OUT, size)
    assert reasoning == whole.reasoning and content == whole.content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls
    ]


def test_no_calls_keeps_content():
    out = hermes()
    msg = out.parse("Just text.")
    assert msg.content == "Just text." and msg.tool_calls is None and not out.made_calls
    assert stream(hermes(), "Just text.", 3)[1] == "Just text."


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_named_function_output_is_the_arguments(size):
    text = '{"city": "Paris"}'
    out = ChoiceOutput(None, None, NAMES, named="get_weather")
    msg = out.parse(text)
    assert msg.content is None and out.made_calls
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg.tool_calls] == [("get_weather", text)]
    reasoning, content, calls = stream(ChoiceOutput(None, None, NAMES, named="get_weather"), text, size)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", text)]
    assert ChoiceOutput(None, None, NAMES, named="get_weather").parse("").tool_calls is None


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_required_json_array(size):
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"zone": "CET"}}]'
    msg = ChoiceOutput(None, "json_array", NAMES).parse(text)
    assert msg.content is None
    expected = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.tool_calls] == expected
    _, content, calls = stream(ChoiceOutput(None, "json_array", NAMES), text, size)
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == expected
