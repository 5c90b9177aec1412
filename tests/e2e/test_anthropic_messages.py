"""The Anthropic Messages API with the official `anthropic` client: plain, streamed, forced tool
use whose input validates, a tool_result turn, stop sequences, JSON output, count_tokens, and
errors in Anthropic's shape. The default model in fp32, greedy (the client has no temperature
argument any more: it goes in the body)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from openai_helpers import MODEL, assert_kv_idle, load

GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather", "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def test_plain_message(client, server):
    r = client.messages.create(model=MODEL, max_tokens=40, system="You are a helpful assistant.", messages=QUESTION, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_") and r.model == MODEL
    [block] = r.content
    assert block.type == "text" and "Paris" in block.text
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 40
    short = client.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    stop = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, stop_sequences=["Paris"], extra_body=GREEDY)
    assert stop.stop_reason == "stop_sequence" and stop.stop_sequence == "Paris" and "Paris" not in stop.content[0].text
    assert_kv_idle(server)


def test_streaming_matches_the_whole_message(client):
    whole = client.messages.create(model=MODEL, max_tokens=40, messages=QUESTION, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=40, messages=QUESTION, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == whole.usage.output_tokens
    # The raw events, in Anthropic's order.
    with httpx.stream("POST", str(client.base_url).rstrip("/") + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 40, "messages": QUESTION, "stream": True, **GREEDY,
    }) as r:
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "content_block_start"]
    assert set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_forced_tool_use_and_a_tool_result_turn(client):
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        r = client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER], tool_choice=choice,
                                   messages=[{"role": "user", "content": "What's the weather in Paris?"}], extra_body=GREEDY)
        assert r.stop_reason == "tool_use", choice
        [use] = [b for b in r.content if b.type == "tool_use"]
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(model=MODEL, max_tokens=100, tools=[WEATHER], tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "What's the weather in Paris?"}], extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == use.input
    answer = client.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER], extra_body=GREEDY, messages=[
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 22 C"}]},
    ])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The tool_result turn renders the call and its result after the cached question.
    assert answer.usage.cache_read_input_tokens > 0


def test_json_output_and_count_tokens(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = client.messages.create(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "A person as JSON."}],
                               output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY)
    jsonschema.validate(json.loads(r.content[0].text), schema)
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION)
    sent = client.messages.create(model=MODEL, max_tokens=1, messages=QUESTION, extra_body=GREEDY)
    assert counted.input_tokens == sent.usage.input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=QUESTION, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens


def test_errors_in_anthropic_shape(client, server):
    url = server.base_url + "/v1/messages"
    cases = [
        ({"messages": QUESTION}, "max_tokens"),
        ({"max_tokens": 10, "messages": []}, "messages"),
        ({"max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"max_tokens": 10, "messages": QUESTION, "tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "name"),
        ({"max_tokens": 10, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "w", "input_schema": {}}]}, "web_search"),
        ({"max_tokens": 10, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ]
    for body, word in cases:
        r = httpx.post(url, json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert word in err["error"]["message"], (body, err)
    r = httpx.post(url, json={"model": "other", "max_tokens": 5, "messages": QUESTION}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}])
    assert_kv_idle(server)


def test_clients_that_go_away_free_their_kv(server):
    """Streams of /v1/messages and /v1/responses cut after a few events, and whole-response
    requests (messages, responses, embeddings) whose client gives up: every request is
    aborted and the server holds no KV."""
    long = {"model": MODEL, "max_tokens": 400, "messages": QUESTION, "ignore_eos": True}
    cases = [
        ("/v1/messages", {**long, "stream": True}, True),
        ("/v1/responses", {"model": MODEL, "input": "Tell a story.", "max_output_tokens": 400, "stream": True}, True),
        ("/v1/messages", long, False),
        ("/v1/responses", {"model": MODEL, "input": "Tell a story.", "max_output_tokens": 400}, False),
        ("/v1/embeddings", {"model": MODEL, "input": [f"{i} " + "word " * 300 for i in range(64)]}, False),
    ]
    for path, body, stream in cases:
        aborted = load(server)["num_aborted_reqs"]
        if stream:
            with httpx.stream("POST", server.base_url + path, json=body, timeout=60) as r:
                assert r.status_code == 200
                for k, _ in enumerate(r.iter_lines()):
                    if k >= 6:
                        break
        else:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(server.base_url + path, json=body, timeout=0.5)
        assert_kv_idle(server, timeout=30)
        assert load(server)["num_aborted_reqs"] > aborted, path
    r = httpx.post(server.base_url + "/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": QUESTION}, timeout=60)
    assert r.status_code == 200
