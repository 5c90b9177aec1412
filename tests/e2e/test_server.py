"""The native HTTP API (/generate and friends) of a real server process."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
import torch

from server_utils import ServerProcess
from srt_lite import cpu_caps
from srt_lite.layers.cpu_linear.paths import cpu_linear_path
from srt_lite.model_executor.dtype import resolve_dtype


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-total-tokens", "8192", warmup=True) as s:  # its banner test reads the warm-up lines
        yield s


def post(server, path, body, timeout=120):
    return httpx.post(server.base_url + path, json=body, timeout=timeout)


def test_generate_text_and_input_ids(server):
    r = post(server, "/generate", {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200
    out = r.json()
    assert "Paris" in out["text"]
    assert out["meta_info"]["completion_tokens"] == 8
    ids = post(server, "/generate", {"input_ids": [504, 3575, 282, 4649, 314], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    assert ids["meta_info"]["prompt_tokens"] == 5


def test_generate_batch(server):
    r = post(server, "/generate", {"text": ["Hello, my name is", "1, 2, 3,"], "sampling_params": [{"max_new_tokens": 4, "temperature": 0}, {"max_new_tokens": 6, "temperature": 0}]})
    outs = r.json()
    assert r.status_code == 200 and isinstance(outs, list) and len(outs) == 2
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [4, 6]
    single = post(server, "/generate", {"text": "1, 2, 3,", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert single["text"] == outs[1]["text"]


def test_generate_stream_sse(server):
    body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    events = []
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    # SGLang's /generate stream: each event holds the whole text so far.
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
    full = post(server, "/generate", {**body, "stream": False}).json()
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    "body",
    [
        {"text": "Hi", "sampling_params": {"temperature": -1}},
        {"text": "Hi", "sampling_params": {"top_p": 0}},
        {"text": "Hi", "sampling_params": {"max_new_tokens": "ten"}},
        {"text": "Hi", "sampling_params": {"nope": 1}},
        {"text": "Hi", "sampling_params": "hot"},
        {"text": 5},
        {},
        {"text": "Hi", "input_ids": [1]},
        {"input_ids": [1, -5]},
        {"input_ids": []},
        {"input_ids": [7] * 9000},
        {"text": "Hi", "stream": "yes"},
        {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": -1}},
        [1, 2],
    ],
)
def test_bad_requests_get_openai_style_400(server, body):
    r = post(server, "/generate", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and isinstance(err["message"], str) and err["message"]


def test_non_json_body_is_400(server):
    r = httpx.post(server.base_url + "/generate", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_info_endpoints(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/health_generate", timeout=30).status_code == 200
    info = httpx.get(server.base_url + "/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"]
    sinfo = httpx.get(server.base_url + "/get_server_info").json()
    assert sinfo["max_total_num_tokens"] == 8192 and sinfo["port"] == server.port
    assert sinfo["load"]["invariant_ok"] is True
    # What sglang-router reads: the resolved model path and name (never the flags' None),
    # under SGLang's current endpoint names too.
    current = httpx.get(server.base_url + "/server_info").json()
    assert current.keys() == sinfo.keys()
    assert current["model_path"] == info["model_path"] and current["served_model_name"] == info["served_model_name"]
    assert current["dp_size"] == 1 and current["tp_size"] == 1
    assert httpx.get(server.base_url + "/model_info").json()["model_path"] == info["model_path"]
    load = httpx.get(server.base_url + "/get_load").json()
    assert len(load) == 1 and load[0].keys() == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    # Idle: no request holds KV and none waits.
    assert load[0] == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_flush_cache_and_cached_tokens(server):
    prompt = "Cached prompt for the server test: " + "lorem ipsum dolor sit amet " * 6
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200
    post(server, "/generate", body)
    second = post(server, "/generate", body).json()["meta_info"]
    assert second["cached_tokens"] == second["prompt_tokens"] - 1
    assert httpx.post(server.base_url + "/flush_cache").status_code == 200
    assert post(server, "/generate", body).json()["meta_info"]["cached_tokens"] == 0


def test_abort_request_endpoint(server):
    result = {}

    def run():
        result["out"] = post(server, "/generate", {"text": "Tell a long story", "rid": "to-abort", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}).json()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.5)
    assert post(server, "/abort_request", {"rid": "to-abort"}).status_code == 200
    t.join(30)
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["out"]["meta_info"]["completion_tokens"] < 4000
    load = httpx.get(server.base_url + "/get_server_info").json()["load"]
    assert load["kv_used_tokens"] == 0 and load["invariant_ok"]


def server_load(server) -> dict:
    return httpx.get(server.base_url + "/get_server_info").json()["load"]


def wait_load_idle(server, timeout: float = 10.0) -> dict:
    """The load report once no request runs or holds KV (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        load = server_load(server)
        if (load["num_running_reqs"] == 0 and load["kv_used_tokens"] == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.1)


def test_client_disconnect_aborts_stream(server):
    body = {"text": "Count to a million:", "stream": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    aborted = server_load(server)["num_aborted_reqs"]
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    load = wait_load_idle(server)
    assert load["num_running_reqs"] == 0 and load["kv_used_tokens"] == 0 and load["invariant_ok"]
    assert load["num_aborted_reqs"] == aborted + 1  # ended by the abort, not by its length


def test_non_streaming_generate_disconnect_aborts(server):
    aborted = server_load(server)["num_aborted_reqs"]
    body = {"text": "Count to a million:", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/generate", json=body, timeout=1.5)
    load = wait_load_idle(server)
    assert load["num_running_reqs"] == 0 and load["kv_used_tokens"] == 0 and load["invariant_ok"]
    assert load["num_aborted_reqs"] == aborted + 1


def test_metrics_endpoint_is_off_by_default(server):
    assert httpx.get(server.base_url + "/metrics", timeout=10).status_code == 404


def test_startup_banner_and_progress_lines(server):
    log = server.read_log()
    port = server.base_url.rsplit(":", 1)[1]
    assert "srt_lite is ready" in log
    assert "  KV cache     8192 tokens" in log
    assert "  max context  8192 tokens" in log
    from srt_lite.model_config import ModelConfig

    dtype = resolve_dtype("auto", "cpu", ModelConfig.load(None).approx_num_params())
    assert f"  dtype        {str(dtype).removeprefix('torch.')} on cpu, tensor parallel 1" in log
    assert f"  compute      linears: {cpu_linear_path(dtype)}; CPU {cpu_caps.get().describe()}" in log
    assert f"  URL          http://127.0.0.1:{port}  (OpenAI API: http://127.0.0.1:{port}/v1)" in log
    # Not a terminal: progress is plain log lines (weights, then warm-up).
    assert re.search(r"Loading weights: (\d+)/\1 done", log) and re.search(r"Warming up: (\d+)/\1 done", log)


@pytest.mark.cpu_caps
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_dtype_starts_and_answers(dtype):
    """Whatever this CPU can do (make test repeats this capped at AVX2), each dtype starts,
    reports the linear path it chose, and answers a chat question greedily."""
    with ServerProcess("--max-total-tokens", "2048", "--dtype", dtype, warmup=True) as s:
        info = httpx.get(s.base_url + "/get_server_info", timeout=10).json()
        assert info["dtype"] == dtype and info["linear_path"] == cpu_linear_path(getattr(torch, dtype))
        assert info["cpu"] == cpu_caps.get().describe()
        r = post(s, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0, "max_tokens": 24,
        })
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
