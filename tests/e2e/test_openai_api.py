"""The OpenAI-compatible API, driven by the official `openai` client against a real server."""

from __future__ import annotations

import random
import threading
import time

import httpx
import openai
import pytest
import torch

from server_utils import ServerProcess

MODEL = "smol"
# SmolLM2's own template without its default system prompt: serving it with --chat-template
# must change what the model sees.
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "template.jinja"
    path.write_text(TEMPLATE)
    with ServerProcess(
        "--dtype", "float32", "--max-total-tokens", "12000", "--served-model-name", MODEL,
        "--enable-cache-report", "--chat-template", str(path),
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat_prompt_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def load(server) -> dict:
    return httpx.get(server.base_url + "/get_server_info", timeout=30).json()["load"]


def wait_kv_idle(server, timeout=15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = load(server)
        if (info["num_running_reqs"] == 0 and info["kv_used_tokens"] == 0) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_greedy_chat_equals_transformers(client, hf_model, tokenizer):
    question = "What is the capital of France?"
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=40
    )
    ids = chat_prompt_ids(tokenizer, question)
    ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, pad_token_id=0)[0, len(ids):]
    ref_text = tokenizer.decode(ref, skip_special_tokens=True)
    choice = r.choices[0]
    assert choice.message.content == ref_text
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    # usage equals the tokenizer's counts (the custom template has no system prompt)
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(tokenizer.encode(ref_text, add_special_tokens=False)) + 1  # + EOS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_n2_stop_strings_and_usage(client):
    stop = [" the", "."]
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about the ocean."}],
                  temperature=0.8, seed=5, max_tokens=60, n=2, stop=stop)
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    texts, finishes, roles, usage = {0: "", 1: ""}, {}, set(), None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        if c.delta.role:
            roles.add(c.index)
        if c.delta.content:
            texts[c.index] += c.delta.content
            assert not any(s in texts[c.index] for s in stop)
        if c.finish_reason:
            assert c.index not in finishes, "one finish chunk per choice"
            finishes[c.index] = (c.finish_reason, c.model_extra.get("matched_stop"))
    assert roles == {0, 1}
    assert set(finishes) == {0, 1}
    for ch in full.choices:
        # seeded sampling: the stream reproduces the non-streamed choices
        assert texts[ch.index] == ch.message.content
        assert not any(s in ch.message.content for s in stop)
        if ch.finish_reason == "stop":
            assert ch.model_extra["matched_stop"] in stop
            assert finishes[ch.index] == ("stop", ch.model_extra["matched_stop"])
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], temperature=0, max_tokens=5,
        logprobs=True, top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token is the top one
        assert item.bytes == list(item.token.encode())


def test_max_tokens_length_and_seed(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Write a story."}], max_tokens=7, temperature=1.0, seed=11)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 7
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_prompt_forms_echo_and_logprobs(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode("1, 2, 3,")) and r.usage.completion_tokens == 5
    text = r.choices[0].text
    ids = tokenizer.encode("1, 2, 3,")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == text
    many = client.completions.create(model=MODEL, prompt=["1, 2, 3,", "a, b, c,"], max_tokens=5, temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == text
    lists = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=5, temperature=0)
    assert lists.choices[0].text == text and len(lists.choices) == 2
    echo = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0, echo=True, logprobs=2)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text == "1, 2, 3," + text
    assert len(lp.tokens) == len(ids) + 5 and lp.token_logprobs[0] is None
    assert "".join(lp.tokens) == echo.choices[0].text
    assert lp.text_offset[len(ids)] == len("1, 2, 3,")
    assert all(len(t) == 2 for t in lp.top_logprobs[len(ids):])


def test_completions_stream(client):
    full = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 12


def test_cached_tokens_reported(client):
    messages = [{"role": "user", "content": "Cache me: " + "words " * 50}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400),
        ("/v1/chat/completions", {"messages": []}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 5}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True, "temperature": -3}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True, "model": "gpt-9"}, 404),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
        ("/v1/completions", {"prompt": "word " * 9000}, 400),
        ("/v1/completions", {"prompt": []}, 400),
        ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400),
        ("/v1/completions", {"prompt": [1, "a"]}, 400),
        ("/v1/completions", {"prompt": "x", "stream": True, "max_tokens": -1}, 400),
        ("/v1/completions", {}, 400),
        # The default model's tokenizer has no fill-in-the-middle tokens.
        ("/v1/completions", {"prompt": "def f():", "suffix": "return 1"}, 400),
    ],
)
def test_errors_in_openai_format(server, path, body, status):
    body = {"model": MODEL, **body} if "model" not in body else body
    r = httpx.post(server.base_url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if status == 404:
        assert err["code"] == "model_not_found"


def test_model_may_be_omitted(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_dropped_streams_free_their_kv(server):
    """Streams cut at random points, mixed with normal greedy requests that must complete
    with the same text as when each runs alone (fp32 server: batch-invariant kernels)."""
    rng = random.Random(0)
    errors = []

    def complete(i: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"{i}, {i + 1}, {i + 2},", "max_tokens": 8, "temperature": 0}
        return httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)

    alone = {i: complete(i).json()["choices"][0]["text"] for i in range(6)}

    def dropped(i: int, cut: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Story {i}"}], "max_tokens": 400,
                "stream": True, "ignore_eos": True}
        try:
            with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
                for k, _ in enumerate(r.iter_lines()):
                    if k >= cut:
                        break
        except httpx.HTTPError as e:
            errors.append(e)

    def normal(i: int) -> None:
        r = complete(i)
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        if choice.get("finish_reason") != "length" or choice.get("text") != alone[i]:
            errors.append((i, r.text, alone[i]))

    threads = [threading.Thread(target=dropped, args=(i, rng.randint(0, 12))) for i in range(24)]
    threads += [threading.Thread(target=normal, args=(i,)) for i in range(6)]
    rng.shuffle(threads)
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    info = wait_kv_idle(server)
    assert info["kv_used_tokens"] == 0 and info["num_running_reqs"] == 0 and info["invariant_ok"]


def test_non_streaming_disconnect_aborts(server):
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True}
    aborted = load(server)["num_aborted_reqs"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.5)
    info = wait_kv_idle(server)
    assert info["num_running_reqs"] == 0 and info["kv_used_tokens"] == 0
    assert info["num_aborted_reqs"] == aborted + 1  # ended by the abort, not by its length
