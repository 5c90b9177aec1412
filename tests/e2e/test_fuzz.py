"""Hypothesis-generated request bodies against a running server: whatever a client sends,
the answer is a 2xx or a 4xx in the OpenAI error format (never a 5xx or a hang), and the
server stays healthy with its KV cache back to idle."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server_utils import ServerProcess

# A short context bounds the work of any accepted request (at most ~48 generated tokens).
ARGS = ("--context-length", "48", "--max-total-tokens", "2048", "--served-model-name", "m")

# Any JSON value, including the awkward ones: huge and negative numbers, NaN/Infinity (which
# Python's json module writes and strict parsers reject), deep nesting, odd unicode.
unicode_text = st.text(
    # Lone surrogates ("\ud800") cannot be UTF-8: json.dumps writes them as \\u escapes.
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from(["\u0000", "\ufeff", "\u202e", "🙂", "\U0010ffff", "\ud800"]),
    max_size=40,
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | unicode_text
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(unicode_text, inner, max_size=4), max_leaves=12)

# Plausible values for the fields that matter (edges included); arbitrary JSON comes in
# through one `wrong` field per body, so most bodies are valid and get generated.
small_ints = st.integers(min_value=-3, max_value=70)
unit = st.floats(min_value=-0.5, max_value=1.5)
token_ids = st.lists(st.integers(-5, 60000), max_size=8)
plausible = {
    "max_tokens": small_ints,
    "max_completion_tokens": small_ints,
    "temperature": st.floats(min_value=-1, max_value=3),
    "top_p": unit,
    "top_k": small_ints,
    "min_p": unit,
    "n": st.integers(min_value=-1, max_value=4),
    "stop": unicode_text | st.lists(unicode_text, max_size=5),
    "seed": st.integers(min_value=-(2**65), max_value=2**65),
    "logprobs": st.booleans() | small_ints,
    "top_logprobs": small_ints,
    "logit_bias": st.dictionaries(st.integers(-5, 60000).map(str) | unicode_text, st.floats(-200, 200), max_size=3),
    "frequency_penalty": st.floats(-3, 3),
    "presence_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "echo": st.booleans(),
    "ignore_eos": st.booleans(),
    "min_tokens": small_ints,
    "model": st.just("m") | unicode_text,
}
sampling_params = st.fixed_dictionaries({}, optional={
    "max_new_tokens": small_ints, "min_new_tokens": small_ints, "temperature": st.floats(-1, 3), "top_p": unit,
    "top_k": small_ints, "stop": plausible["stop"], "n": st.integers(-1, 4), "ignore_eos": st.booleans(),
    "stop_token_ids": token_ids, "regex": unicode_text,
})
prompts = unicode_text | st.lists(unicode_text, max_size=3) | token_ids | st.lists(token_ids, max_size=3)
content = unicode_text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": unicode_text}), max_size=2)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "bogus"]), "content": content | st.none()}),
    max_size=3,
)
MAIN = {"/v1/completions": ("prompt", prompts), "/v1/chat/completions": ("messages", messages), "/generate": ("text", prompts)}


def body_for(path: str) -> st.SearchStrategy[dict]:
    main, main_values = MAIN[path]
    extra = {"sampling_params": sampling_params, "input_ids": prompts} if path == "/generate" else {}
    fields = st.fixed_dictionaries({main: main_values}, optional={**plausible, **extra})
    # At most one field replaced by arbitrary JSON (or an unknown field added).
    wrong = st.none() | st.tuples(st.sampled_from([main, *plausible, *extra, "unknown_field"]), json_values)
    return st.tuples(fields, wrong).map(lambda t: t[0] if t[1] is None else {**t[0], t[1][0]: t[1][1]})


requests = st.sampled_from(sorted(MAIN)).flatmap(lambda path: st.tuples(st.just(path), body_for(path)))


@pytest.fixture(scope="module")
def server():
    with ServerProcess(*ARGS) as s:
        yield s


def post(server, path: str, body: dict) -> httpx.Response:
    # allow_nan: Python writes NaN/Infinity literals, which the server must reject cleanly.
    data = json.dumps(body, allow_nan=True)
    with httpx.stream("POST", server.base_url + path, content=data, headers={"content-type": "application/json"}, timeout=60) as r:
        r.read()  # a stream is read to its end: it must terminate
        return r


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(req=requests)
def test_fuzzed_bodies_never_5xx(server, req):
    path, body = req
    r = post(server, path, body)
    event(f"{path} -> {r.status_code}")  # shown by pytest --hypothesis-show-statistics
    assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"], r.text


def test_server_healthy_and_kv_idle_after_fuzzing(server):
    # Runs after the fuzz test in file order; a fresh module run of this test alone also passes.
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    deadline = time.monotonic() + 15
    while True:
        load = httpx.get(server.base_url + "/get_server_info", timeout=10).json()["load"]
        if (load["kv_used_tokens"] == 0 and load["num_running_reqs"] == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert load["kv_used_tokens"] == 0 and load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert load["invariant_ok"]
