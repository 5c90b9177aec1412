"""The starlette app on its own, over a TokenizerManager with no scheduler behind it: the
answers that never reach the scheduler (health, models, every error path) in the OpenAI
error format; and, with a stand-in scheduler, how the endpoints ask it for tokens. The served
endpoints are tested end to end in test_server.py and test_openai_api.py."""

from __future__ import annotations

import shutil

import pytest
from starlette.testclient import TestClient

from fake_scheduler import FakeScheduler
from srt_lite.entrypoints.http_server import build_app
from srt_lite.entrypoints.server_state import ServerState
from srt_lite.managers.io_struct import PortArgs, SchedulerReady
from srt_lite.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt_lite.model_config import ModelConfig
from srt_lite.server_args import ServerArgs

MODEL_NAME = "test-model"


@pytest.fixture
def make_client(default_model_dir):
    made = []

    def make(**args) -> tuple[TestClient, ServerState]:
        port_args = PortArgs.create()
        info = SchedulerReady(
            tp_rank=0, max_total_num_tokens=4096, max_context_len=512, max_running_requests=8,
            vocab_size=49152, device="cpu", dtype="float32",
        )
        tm = TokenizerManager(ServerArgs(**args), port_args, default_model_dir, info)
        state = ServerState(tm, ModelConfig.load(default_model_dir), MODEL_NAME)
        client = TestClient(build_app(state), raise_server_exceptions=False).__enter__()
        made.append((client, tm, port_args))
        return client, state

    yield make
    for client, tm, port_args in made:
        async def close() -> None:
            tm.close()  # in the app's loop, where its sockets were made

        client.portal.call(close)
        client.__exit__(None, None, None)
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


def assert_openai_error(r, status: int, code=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == (status if code is None else code)
    return err


def test_health_follows_draining_and_a_dead_child(make_client):
    client, state = make_client()
    assert client.get("/health").status_code == 200
    state.tm.drain()
    err = assert_openai_error(client.get("/health"), 503)
    assert err["message"] == "the server is shutting down"
    state.dead = "scheduler_TP0 died unexpectedly (exit code 9)"
    assert assert_openai_error(client.get("/health"), 503)["message"] == state.dead
    assert assert_openai_error(client.get("/health_generate"), 503)["message"] == state.dead


def test_models_and_model_info(make_client, default_model_dir):
    client, _ = make_client()
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL_NAME] and data[0]["max_model_len"] == 512
    assert client.get(f"/v1/models/{MODEL_NAME}").json()["id"] == MODEL_NAME
    assert client.get(f"/v1/models/{default_model_dir}").json()["id"] == MODEL_NAME  # the path works too
    err = assert_openai_error(client.get("/v1/models/nope"), 404, "model_not_found")
    assert err["param"] == "model" and err["type"] == "invalid_request_error"
    info = client.get("/get_model_info").json()
    assert info["served_model_name"] == MODEL_NAME and info["max_context_length"] == 512
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert client.get("/model_info").json() == info  # SGLang's current name for it


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        ("/generate", {"text": "Hi", "sampling_params": {"temperature": -1}}, 400, None),
        ("/generate", {"input_ids": []}, 400, None),
        ("/generate", {"text": ["a", "b"], "stream": True}, 400, None),
        ("/generate", [1, 2], 400, None),
        ("/generate", {"text": "Hi", "stream": "yes"}, 400, None),
        ("/abort_request", {"rid": 5}, 400, None),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}, 404, "model_not_found"),
        ("/v1/chat/completions", {"messages": "Hi"}, 400, None),
        ("/v1/completions", {"prompt": "Hi", "suffix": "x"}, 400, None),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 10_000}, 400, None),
    ],
)
def test_bad_requests_get_openai_errors_without_reaching_the_scheduler(make_client, path, body, status, code):
    client, _ = make_client()
    assert_openai_error(client.post(path, json=body), status, code)


def test_schema_errors_name_the_field(make_client):
    client, _ = make_client()
    err = assert_openai_error(client.post("/v1/completions", json={"prompt": "Hi", "n": "two"}), 400)
    assert err["param"] == "n" and err["message"].startswith("n: ")


def test_body_limits(make_client):
    client, _ = make_client(max_request_bytes=1024)
    assert_openai_error(client.post("/generate", content=b"{not json"), 400)
    err = assert_openai_error(client.post("/generate", json={"text": "x" * 2000}), 413)
    assert "1024 bytes" in err["message"]


def test_draining_server_refuses_requests_with_503_and_retry_after(make_client):
    client, state = make_client()
    state.tm.drain()
    r = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
    assert_openai_error(r, 503)
    assert r.headers["Retry-After"] == "1"


def test_api_key_guards_everything_but_health(make_client):
    client, _ = make_client(api_key="sesame")
    assert client.get("/health").status_code == 200
    err = assert_openai_error(client.get("/v1/models"), 401, "invalid_api_key")
    assert err["type"] == "invalid_request_error"
    assert client.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_metrics_route_exists_only_with_a_collector(make_client):
    client, _ = make_client()
    assert client.get("/metrics").status_code == 404


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 3}),
    ],
)
def test_only_a_streamed_request_has_the_scheduler_send_every_token(make_client, path, body):
    """A collected response asks the scheduler for the request's tokens once, at its end:
    a message a step would cost the decode loop and wake the detokenizer for nothing."""
    client, state = make_client()

    async def start() -> FakeScheduler:
        return FakeScheduler(state.tm.port_args)

    scheduler = client.portal.call(start)
    task = client.portal.start_task_soon(scheduler.run)
    try:
        collected = client.post(path, json={"model": MODEL_NAME, **body, "stream": False})
        assert collected.status_code == 200, collected.text
        assert "xxx" in collected.text  # the stand-in's three tokens, whole
        streamed = client.post(path, json={"model": MODEL_NAME, **body, "stream": True})
        assert streamed.status_code == 200, streamed.text
        assert [r.stream for r in scheduler.requests] == [False, True]
    finally:
        task.cancel()
        client.portal.call(_close_soon, scheduler)


async def _close_soon(scheduler: FakeScheduler) -> None:
    scheduler.close()
