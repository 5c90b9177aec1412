"""The Responses API with the official clients: `openai` (plain, chained, streamed, function
tools, text.format) and the OpenAI Agents SDK's OpenAIResponsesModel; the bounded store; bad
input. The default model in fp32, greedy."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from openai_helpers import MODEL, assert_kv_idle, client_for
from srt_lite.entrypoints.openai.response_store import ResponseStore, StoredResponse

WEATHER = {
    "type": "function", "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return client_for(server)


def ask(client, **kw):
    return client.responses.create(model=MODEL, temperature=0, **kw)


def test_plain_response_is_stored_listed_and_deleted(client, server):
    r = ask(client, input="What is the capital of France?", max_output_tokens=40, metadata={"k": "v"})
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert "Paris" in r.output_text
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 40
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.metadata == {"k": "v"}
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "What is the capital of France?")]
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    assert_kv_idle(server)


def test_chain_continues_the_stored_conversation_from_the_cache(client):
    first = ask(client, input="What is the capital of France?", max_output_tokens=40)
    second = ask(client, input="And of Germany?", previous_response_id=first.id, max_output_tokens=40)
    assert "Berlin" in second.output_text
    # The chained prompt starts with the whole first turn: its prompt and answer are cached.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # Sending the history by hand renders the same prompt and gives the same answer.
    by_hand = ask(client, input=[
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And of Germany?"},
    ], max_output_tokens=40)
    assert by_hand.output_text == second.output_text
    assert by_hand.usage.input_tokens == second.usage.input_tokens
    # input_items lists the request's own input, not the history it continues.
    assert [i.content[0].text for i in client.responses.input_items.list(second.id).data] == ["And of Germany?"]


def test_stream_events_in_openai_order(client):
    stream = ask(client, input="Say hello.", max_output_tokens=12, stream=True)
    events = list(stream)
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas and deltas == events[-4].text == final.output_text
    assert final.incomplete_details.reason == "max_output_tokens" and final.usage.output_tokens == 12
    assert client.responses.retrieve(final.id).output_text == deltas
    # The SDK's stream helper assembles the same response as the plain call.
    with client.responses.stream(model=MODEL, input="What is the capital of France?", temperature=0, max_output_tokens=40) as s:
        done = s.get_final_response()
    assert done.status == "completed" and done.output_text == ask(client, input="What is the capital of France?", max_output_tokens=40).output_text


def test_function_tool_round_trip(client):
    r = ask(client, input="What's the weather in Paris?", tools=[WEATHER], tool_choice="required")
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    named = ask(client, input="Weather in Rome?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert named.output[-1].type == "function_call" and named.output[-1].name == "get_weather"
    back = ask(client, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=40,
               input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 22 C"}])
    assert back.status in ("completed", "incomplete") and back.output_text
    # tool_choice "required" words the tools preamble for its JSON form, "auto" (here) for the
    # template's own; the conversation before the preamble is still a cache hit.
    assert back.usage.input_tokens_details.cached_tokens > 0
    # Streamed, a call arrives as an item with argument deltas.
    events = list(ask(client, input="What's the weather in Paris?", tools=[WEATHER], tool_choice="required", stream=True))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and done.name == "get_weather"


def test_text_format_json_schema(client):
    r = ask(client, input="Describe a person as JSON.", text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"
    o = ask(client, input="Give me a JSON object.", text={"format": {"type": "json_object"}}, max_output_tokens=60)
    if o.status == "completed":
        assert isinstance(json.loads(o.output_text), dict)


def test_agents_sdk_runner_with_a_function_tool(server):
    import agents
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
        tool_agent = agents.Agent(
            name="weather", instructions="Use the tools.", model=model, tools=[get_weather],
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0), tool_use_behavior="stop_on_first_tool",
        )
        first = (await agents.Runner.run(tool_agent, "What's the weather in Paris?", max_turns=3)).final_output
        plain = agents.Agent(name="plain", instructions="You are a helpful assistant.", model=model,
                             model_settings=agents.ModelSettings(temperature=0, max_tokens=200))
        second = (await agents.Runner.run(plain, "What is the capital of France?", max_turns=3)).final_output
        return first, second

    tool_out, text_out = asyncio.run(run())
    assert calls == ["Paris"] and tool_out == "sunny in Paris"
    assert "Paris" in text_out


def test_bad_input_is_a_clear_error(client, server):
    url = server.base_url + "/v1/responses"
    cases = [
        ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "resp_unknown"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input_image"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "web_search"),
        ({"input": "hi", "background": True}, 400, "background"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "call_id"),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, 400, "nope"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "schema"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": []}, 400, "empty"),
    ]
    for body, status, word in cases:
        r = httpx.post(url, json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == status, (body, r.text)
        assert word in r.json()["error"]["message"], (body, r.text)
    for method in ("GET", "DELETE"):
        r = httpx.request(method, url + "/resp_unknown", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert_kv_idle(server)


def test_the_store_keeps_its_bound(client):
    """The server keeps 8 responses: the oldest of 11 are gone (404), the newest 8 remain."""
    ids = [ask(client, input=f"Say the number {i}.", max_output_tokens=4).id for i in range(11)]
    for rid in ids[:3]:
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
    assert [client.responses.retrieve(rid).id for rid in ids[3:]] == ids[3:]
    not_stored = ask(client, input="Hi.", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(not_stored.id)


def test_store_bounds_bytes_and_age(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("srt_lite.entrypoints.openai.response_store.time.monotonic", lambda: clock[0])
    store = ResponseStore(max_entries=100, max_bytes=1000, ttl_s=60)

    def record(n: int) -> StoredResponse:
        return StoredResponse({"text": "x" * n}, [], [])

    for i in range(5):
        store.put(f"r{i}", record(300))  # ~320 bytes each: three fit
    assert [rid for rid in (f"r{i}" for i in range(5)) if store.get(rid)] == ["r2", "r3", "r4"]
    assert store.bytes <= 1000
    store.put("big", record(2000))  # larger than the whole store: not kept, nothing evicted
    assert store.get("big") is None and len(store) == 3
    clock[0] += 61
    store.put("new", record(10))
    assert store.get("r4") is None and store.get("new") is not None  # the old ones expired
    assert len(store) == 1 and store.bytes == store.get("new").size
