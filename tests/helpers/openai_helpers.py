"""Shared by the structured-output and tool-calling tests (a helper module, not a test file):
the default-model server they run against and the KV check after each test."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import httpx
import openai

from server_utils import ServerProcess

MODEL = "smol"

# A function tool the tool-calling tests share.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@contextmanager
def default_server(*args: str) -> Iterator[ServerProcess]:
    """The default model in fp32 (greedy outputs do not depend on the batch)."""
    with ServerProcess("--dtype", "float32", "--max-total-tokens", "8192", "--served-model-name", MODEL, *args) as s:
        yield s


def client_for(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def load(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/get_server_info", timeout=30).json()["load"]


def assert_kv_idle(server: ServerProcess, timeout: float = 15.0) -> None:
    """No request runs or holds KV (waiting up to `timeout` for the last ones to end), and
    free + cached + in use == capacity."""
    deadline = time.monotonic() + timeout
    while True:
        info = load(server)
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_used_tokens"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle, info
    assert info["invariant_ok"], info


def post_error(server: ServerProcess, path: str, body: dict) -> dict:
    """The OpenAI error body of a request that must fail with 400."""
    r = httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err
