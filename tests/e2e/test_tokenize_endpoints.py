"""/tokenize and /detokenize (vLLM's shape): round trips, chat messages through the template as
the chat endpoint renders them, and bad input."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from openai_helpers import MODEL, client_for
from srt_lite.model_loader.default_model import resolve_model_path

TEXTS = ["The capital of France is", "héllo wörld — 你好 🙂", "  two  spaces\nand a newline", ""]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_prompt_round_trip(server):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    for text in TEXTS:
        r = post(server, "/tokenize", {"model": MODEL, "prompt": text})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 8192 and body["token_strs"] is None
        back = post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": text}
    strs = post(server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(strs["tokens"])


def test_messages_count_what_chat_counts(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    body = post(server, "/tokenize", {"messages": messages}).json()
    chat = client_for(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert body["count"] == chat.usage.prompt_tokens
    text = post(server, "/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+2?" in text
    no_prompt = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < body["count"]


@pytest.mark.parametrize(
    "path,body,word",
    [
        ("/tokenize", {}, "exactly one"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "role"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "other"),
        ("/detokenize", {"tokens": [1, -3]}, "-3"),
        ("/detokenize", {"tokens": [10**9]}, "not a token id"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_input(server, path, body, word):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert word in r.json()["error"]["message"]
