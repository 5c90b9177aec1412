"""Tool calling end to end with the default model (its template knows no tools, so the tools
reach it through the preamble), through the official `openai` client and LangChain: forced
calls (tool_choice required / named) are grammar-constrained, so their arguments must
validate against the function's schema; "auto" depends on the model and is only checked for
a well-formed answer."""

from __future__ import annotations

import json

import jsonschema
import pytest

from openai_helpers import MODEL, assert_kv_idle, client_for, post_error
from server_utils import ServerProcess
from tool_call_model import FINAL_REPLY, TOOL_CALL_REPLY, after_tool_messages, make_tool_call_model, question_messages
from tool_call_model import TOOLS as TINY_TOOLS

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city", "unit"],
}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


@pytest.fixture(autouse=True)
def kv_idle_after(request):
    yield
    for name in ("server", "tiny_server"):
        if name in request.fixturenames:
            assert_kv_idle(request.getfixturevalue(name))


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A tiny model trained to call get_weather (tool_call_model.py), whose template renders
    tools itself (the native path, parsed as hermes). The reasoning parser is on, to show that
    calls are still read from the content of an answer without a think block."""
    path = make_tool_call_model(str(tmp_path_factory.mktemp("tool_model")))
    with ServerProcess(
        "--model-path", path, "--dtype", "float32", "--max-total-tokens", "2048", "--served-model-name", "tiny",
        "--reasoning-parser", "qwen3",
    ) as s:
        yield s


def check_calls(message, finish_reason: str) -> list:
    """The OpenAI shape of a message of calls; returns them."""
    assert finish_reason == "tool_calls"
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


def stream_calls(client, **kwargs) -> tuple[dict, str]:
    """Streams a request and reassembles its tool calls the way clients do: by index, the
    first delta carrying id/type/name, the next ones argument fragments."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        c = chunk.choices[0]
        for d in c.delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in calls and d.type == "function" and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        assert not c.delta.content
        finish = c.finish_reason or finish
    return calls, finish


def test_required_calls_validate(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    calls = check_calls(r.choices[0].message, r.choices[0].finish_reason)
    assert len({c.id for c in calls}) == len(calls)
    streamed, finish = stream_calls(client, model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    assert finish == "tool_calls"
    assert [(s["name"], s["arguments"]) for _, s in sorted(streamed.items())] == [(c.function.name, c.function.arguments) for c in calls]


def test_required_without_parallel_calls_makes_one(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        temperature=0.8, seed=3, n=2, max_tokens=120,
    )
    for choice in r.choices:
        assert len(check_calls(choice.message, choice.finish_reason)) == 1


def test_named_function(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=60)
    (call,) = check_calls(r.choices[0].message, r.choices[0].finish_reason)
    assert call.function.name == "get_weather"
    streamed, finish = stream_calls(client, model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=60)
    assert finish == "tool_calls"
    assert [(s["name"], s["arguments"]) for s in streamed.values()] == [("get_weather", call.function.arguments)]


def test_tool_result_turn_and_auto(client):
    """A conversation that carries a call and its result is accepted; with "auto" the model
    may answer or call again, either way in the OpenAI shape."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_abc", "content": '{"temperature": 18}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=40)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name in SCHEMAS
            json.loads(call.function.arguments)
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    none = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=20)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "body,named",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 1}}}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters"),
    ],
)
def test_invalid_tools_are_400_naming_the_field(server, body, named):
    err = post_error(server, "/v1/chat/completions", {"messages": ASK, **body})
    assert named in err["message"] or err["param"] == named, err


def test_auto_parses_the_models_own_calls(tiny_server):
    """tool_choice auto: the model writes a <tool_call>, the response carries it as
    tool_calls (streamed the same, per choice with n=2); its result sent back gives the
    model's final answer as content."""
    client = client_for(tiny_server)
    kwargs = dict(model="tiny", messages=question_messages(), tools=TINY_TOOLS, temperature=0, max_tokens=40)
    r = client.chat.completions.create(**kwargs, n=2)
    expected = json.loads(TOOL_CALL_REPLY.split("\n")[1])
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == expected["name"] and json.loads(call.function.arguments) == expected["arguments"]
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id
    streamed, finish = stream_calls(client, **kwargs)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
        (call.function.name, call.function.arguments) for call in r.choices[0].message.tool_calls
    ]
    final = client.chat.completions.create(**{**kwargs, "messages": after_tool_messages()})
    assert final.choices[0].message.content == FINAL_REPLY and final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason == "stop"


def test_langchain_bind_tools(server):
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=server.base_url + "/v1", api_key="x", model=MODEL, temperature=0, max_tokens=60, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert isinstance(msg, AIMessage)
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["id"].startswith("call_")
