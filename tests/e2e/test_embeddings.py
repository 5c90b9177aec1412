"""/v1/embeddings: vectors equal transformers' last hidden states (last-token and mean
pooling, over chunked prompts), the input forms and encodings, `dimensions`, the openai and
LangChain clients, embeddings beside chat on one server, a Qwen3-Embedding-style checkpoint
(a base model without "model." prefixes or LM head), no KV held afterwards, and bad input."""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer, Qwen3Config

from openai_helpers import MODEL, assert_kv_idle, client_for
from server_utils import ServerProcess
from srt_lite.model_loader.default_model import resolve_model_path

TEXTS = ["The capital of France is Paris.", "A cat sat on the mat.", "def add(a, b): return a + b"]
LONG = "The old ship left the harbour at dawn, and the sea was grey and calm. " * 4  # > 2 chunks of 16


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path(None))


@pytest.fixture(scope="module")
def base_model():
    """The default model's decoder in fp32 (its last_hidden_state is after the final norm)."""
    return AutoModel.from_pretrained(resolve_model_path(None), dtype=torch.float32).eval()


def reference(model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]  # [T, hidden]
    return F.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)


def vectors(server, body: dict) -> list[torch.Tensor]:
    r = httpx.post(server.base_url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return [torch.tensor(d["embedding"]) for d in data]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def test_last_token_pooling_matches_transformers(server, tokenizer, base_model):
    ids = [tokenizer.encode(t) for t in TEXTS]
    for body in ({"input": TEXTS}, {"input": ids}):
        got = vectors(server, body)
        for g, x in zip(got, ids):
            want = reference(base_model, x, "last")
            assert (g - want).abs().max() < 1e-4 and abs(g.norm() - 1) < 1e-5
    [one] = vectors(server, {"input": TEXTS[0]})
    [by_ids] = vectors(server, {"input": ids[0]})
    assert torch.equal(one, by_ids)
    # The second time the prompt is a radix-cache hit but its last token is computed again.
    [again] = vectors(server, {"input": TEXTS[0]})
    assert (again - one).abs().max() < 1e-5
    assert_kv_idle(server)


def test_clients_encodings_and_dimensions(server):
    client = client_for(server)
    r = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64
    floats = vectors(server, {"input": TEXTS})
    assert [len(d.embedding) for d in r.data] == [576] * 3 and r.usage.prompt_tokens == r.usage.total_tokens > 0
    for d, f in zip(r.data, floats):
        assert np.allclose(d.embedding, f.numpy(), atol=1e-6)
    raw = httpx.post(server.base_url + "/v1/embeddings", json={"input": "hi", "encoding_format": "base64"}, timeout=60).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, vectors(server, {"input": "hi"})[0].numpy(), atol=1e-6)
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64).data[0].embedding
    assert len(short) == 64 and abs(np.linalg.norm(short) - 1) < 1e-5
    assert np.allclose(short, F.normalize(floats[0][:64], dim=0).numpy(), atol=1e-6)
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: LangChain would otherwise send tiktoken's token ids.
    lc = OpenAIEmbeddings(base_url=server.base_url + "/v1", api_key="unused", model=MODEL, check_embedding_ctx_length=False)
    docs = lc.embed_documents(TEXTS)
    assert np.allclose(docs, np.stack([f.numpy() for f in floats]), atol=1e-5)
    assert np.allclose(lc.embed_query(TEXTS[1]), floats[1].numpy(), atol=1e-5)


def test_embeddings_beside_chat(server):
    client = client_for(server)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    alone = client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=24).choices[0].message.content
    want = vectors(server, {"input": TEXTS})
    with ThreadPoolExecutor(6) as pool:
        chats = [pool.submit(lambda: client.chat.completions.create(model=MODEL, messages=question, temperature=0, max_tokens=24)) for _ in range(3)]
        embeds = [pool.submit(vectors, server, {"input": TEXTS}) for _ in range(3)]
        assert all(c.result().choices[0].message.content == alone for c in chats)
        for e in embeds:
            assert all((g - w).abs().max() < 1e-4 for g, w in zip(e.result(), want))
    assert_kv_idle(server)


@pytest.mark.parametrize(
    "body, word",
    [
        ({"input": []}, "empty"),
        ({"input": ""}, "empty"),
        ({"input": [[1, 2], []]}, "empty"),
        ({"input": [10**9]}, "49152"),
        ({"input": "hi", "dimensions": 100000}, "dimensions"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": ["a"] * 2049}, "2048"),
        ({"input": "word " * 9000}, "context"),
        ({"input": {"text": "hi"}}, "input"),
        ({"input": "hi", "model": "other"}, "other"),
    ],
)
def test_bad_input(server, body, word):
    r = httpx.post(server.base_url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code in (400, 404), r.text
    assert word in r.json()["error"]["message"].lower() or word in r.text


def test_mean_pooling_over_chunks(tokenizer, base_model):
    with ServerProcess("--dtype", "float32", "--served-model-name", MODEL, "--embedding-pooling", "mean",
                       "--chunked-prefill-size", "16", "--max-total-tokens", "4096") as s:
        ids = [tokenizer.encode(t) for t in (LONG, *TEXTS)]
        assert len(ids[0]) > 32
        got = vectors(s, {"input": ids})
        for g, x in zip(got, ids):
            assert (g - reference(base_model, x, "mean")).abs().max() < 1e-4
        # Mean pooling computes every token again: no prefix is taken from the cache.
        assert all((a - b).abs().max() < 1e-5 for a, b in zip(vectors(s, {"input": ids}), got))
        assert_kv_idle(s)


def test_qwen3_embedding_style_checkpoint(tmp_path, tokenizer):
    """A base Qwen3 model as Qwen3-Embedding ships it: tensors without the "model." prefix,
    no lm_head; served with last-token pooling, its vectors equal the base model's."""
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id)
    model = AutoModel.from_config(cfg, dtype=torch.float32).eval()  # Qwen3Model
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with ServerProcess("--model-path", str(tmp_path), "--dtype", "float32", "--served-model-name", MODEL) as s:
        ids = [tokenizer.encode(t) for t in TEXTS]
        for g, x in zip(vectors(s, {"input": ids}), ids):
            assert (g - reference(model, x, "last")).abs().max() < 1e-4
