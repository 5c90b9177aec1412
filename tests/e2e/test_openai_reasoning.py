"""Reasoning end to end: a tiny Qwen3-architecture model trained to answer with a
<think>...</think> block, served with --reasoning-parser qwen3 (and an API key)."""

from __future__ import annotations

import httpx
import openai
import pytest

from reasoning_model import QUESTION, make_reasoning_model
from server_utils import ServerProcess

KEY = "sk-test-key"
REASONING = "\nThe user asks 2+2. That is 4.\n"
ANSWER = "The answer is 4."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_reasoning_model(str(tmp_path_factory.mktemp("reasoner")))
    with ServerProcess(
        "--model-path", path, "--dtype", "float32", "--reasoning-parser", "qwen3", "--api-key", KEY,
        "--served-model-name", "tiny-reasoner", "--max-total-tokens", "2048",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": QUESTION}]


def test_non_streaming_splits_reasoning(client):
    r = client.chat.completions.create(model="tiny-reasoner", messages=MESSAGES, temperature=0, max_tokens=64)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == REASONING
    assert msg.content == ANSWER
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.model_extra["reasoning_tokens"] > 0


def _stream(client, stream_reasoning: bool) -> tuple[list[str], list[str], list[str]]:
    stream = client.chat.completions.create(
        model="tiny-reasoner", messages=MESSAGES, temperature=0, max_tokens=64, stream=True,
        extra_body={"stream_reasoning": stream_reasoning},
    )
    reasoning, content, order = [], [], []
    for chunk in stream:
        d = chunk.choices[0].delta
        if d.model_extra.get("reasoning_content"):
            reasoning.append(d.model_extra["reasoning_content"])
            order.append("r")
        if d.content:
            content.append(d.content)
            order.append("c")
    return reasoning, content, order


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_streaming_splits_reasoning(client, stream_reasoning):
    """With stream_reasoning the reasoning streams as it is generated; without, it comes in one
    delta before the answer. Text the client has not read yet is sent together (a fast decode
    can finish the short reasoning before the first read), so a split is asked of one stream
    in three, not of every one."""
    splits = []
    for _ in range(3):
        reasoning, content, order = _stream(client, stream_reasoning)
        assert "".join(reasoning) == REASONING and "".join(content) == ANSWER
        assert "<think>" not in "".join(content + reasoning) and "</think>" not in "".join(content + reasoning)
        assert order.index("c") > max(i for i, k in enumerate(order) if k == "r")  # reasoning first
        splits.append(len(reasoning))
        if stream_reasoning and len(reasoning) > 1:
            break
    if not stream_reasoning:
        assert splits == [1] * 3
    else:
        assert splits[-1] > 1, splits


def test_separate_reasoning_false_keeps_everything_in_content(client):
    r = client.chat.completions.create(
        model="tiny-reasoner", messages=MESSAGES, temperature=0, max_tokens=64, extra_body={"separate_reasoning": False}
    )
    assert r.choices[0].message.content == "<think>" + REASONING + "</think>\n\n" + ANSWER
    assert r.choices[0].message.model_extra.get("reasoning_content") is None


def test_enable_thinking_false_per_request(client):
    r = client.chat.completions.create(
        model="tiny-reasoner", messages=MESSAGES, temperature=0, max_tokens=64,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert r.choices[0].message.content == ANSWER
    assert r.choices[0].message.model_extra.get("reasoning_content") is None


def test_api_key_guards_everything_but_health(server):
    base = server.base_url
    assert httpx.get(base + "/health").status_code == 200
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/generate"), ("GET", "/get_server_info")]:
        r = httpx.request(method, base + path, json={"messages": MESSAGES}, timeout=30)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.request(method, base + path, json={}, headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert r.status_code == 401
    ok = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny-reasoner"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="bad", max_retries=0).models.list()


@pytest.mark.parametrize("regex", [r"The answer is [0-9]+\.", "[0-9]+"])
def test_a_grammar_constrains_the_answer_after_free_reasoning(client, regex):
    """As in SGLang: the think block is free text, the grammar starts after </think>."""
    import re

    r = client.chat.completions.create(
        model="tiny-reasoner", messages=MESSAGES, temperature=0, max_tokens=64, extra_body={"regex": regex}
    )
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == REASONING
    assert re.fullmatch(regex, msg.content), msg.content
    assert r.choices[0].finish_reason == "stop"
    # Without thinking the grammar applies from the first token.
    r = client.chat.completions.create(
        model="tiny-reasoner", messages=MESSAGES, temperature=0, max_tokens=64,
        extra_body={"regex": regex, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert re.fullmatch(regex, r.choices[0].message.content) and r.choices[0].message.model_extra.get("reasoning_content") is None


def test_responses_api_returns_a_reasoning_item(client):
    r = client.responses.create(model="tiny-reasoner", input=QUESTION, temperature=0, max_output_tokens=64)
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING and r.output_text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model="tiny-reasoner", input=QUESTION, temperature=0, max_output_tokens=64, stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, said) == (REASONING, ANSWER)
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]


def test_messages_api_returns_a_thinking_block_with_x_api_key(server):
    import anthropic
    client = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)  # sends x-api-key
    r = client.messages.create(model="tiny-reasoner", max_tokens=64, messages=MESSAGES, extra_body={"temperature": 0})
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == REASONING and r.content[1].text == ANSWER
    with client.messages.stream(model="tiny-reasoner", max_tokens=64, messages=MESSAGES, extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == REASONING
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="tiny-reasoner", max_tokens=8, messages=MESSAGES)
    assert e.value.body["error"]["type"] == "authentication_error"
