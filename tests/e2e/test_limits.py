"""Limits with clear errors: body size (413), n (400), queue length (503 + Retry-After),
bodies that are not JSON or not UTF-8 (400)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from server_utils import ServerProcess


@pytest.fixture(scope="module")
def server():
    with ServerProcess(
        "--max-request-bytes", "4096", "--max-queued-requests", "0", "--max-running-requests", "2",
        "--max-total-tokens", "4096",
    ) as s:
        yield s


def test_body_over_limit_is_413(server):
    big = {"prompt": "word " * 2000, "max_tokens": 1}
    for path in ("/v1/completions", "/generate"):
        r = httpx.post(server.base_url + path, json=big, timeout=30)
        assert r.status_code == 413
        assert "exceeds 4096 bytes" in r.json()["error"]["message"]
    # Without a Content-Length header (chunked upload) the limit still holds.
    def chunks():
        for _ in range(10):
            yield b"x" * 1000

    r = httpx.post(server.base_url + "/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413


@pytest.mark.parametrize("body", [b"\xff\xfe{\"prompt\": 1}", b"not json at all", b'{"prompt": "\xc3\x28"}'])
def test_non_json_or_bad_utf8_is_400(server, body):
    r = httpx.post(server.base_url + "/v1/completions", content=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_n_over_maximum_is_400(server):
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "n": 129, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and "n" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/generate", json={"text": "hi", "sampling_params": {"n": 1000}}, timeout=30)
    assert r.status_code == 400


def test_too_many_in_flight_is_503_with_retry_after(server):
    results = []

    def long_request():
        r = httpx.post(server.base_url + "/generate", json={"text": "Story", "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}, timeout=120)
        results.append(r.status_code)

    threads = [threading.Thread(target=long_request) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # both are running now: 2 in flight == 2 running + 0 queued
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable"
    s = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stream": True}, timeout=30)
    assert s.status_code == 503  # a stream is refused before it starts
    for t in threads:
        t.join()
    assert results == [200, 200]
    # Once they finished, requests are accepted again.
    assert httpx.post(server.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30).status_code == 200


@pytest.mark.parametrize("flag", [False, True], ids=["default", "log-requests"])
def test_request_text_is_logged_only_with_log_requests(flag):
    marker = "zebra-umbrella-private-text"
    with ServerProcess("--max-total-tokens", "2048", *(["--log-requests"] if flag else [])) as s:
        r = httpx.post(s.base_url + "/generate", json={"text": marker, "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        assert r.status_code == 200
        time.sleep(0.5)
        assert (marker in s.read_log()) == flag
