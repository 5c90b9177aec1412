"""The HTTP server: a starlette app over the TokenizerManager.

`build_app` assembles the routes, the exception handlers and the API-key check. Handlers are
plain functions that find what they need on `request.app.state`: `server` (a ServerState)
and the OpenAI serving objects. The native (SGLang-compatible) endpoints live here, the
OpenAI-compatible ones in `entrypoints/openai/`, and every error is returned in the OpenAI
format (`entrypoints/errors.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any, AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from srt_lite.entrypoints.anthropic.serving_messages import AnthropicServingMessages, count_tokens, create_message
from srt_lite.entrypoints.anthropic.serving_messages import error_response as anthropic_error
from srt_lite.entrypoints.errors import EXCEPTION_HANDLERS, error_response
from srt_lite.entrypoints.http_io import SSE_DONE, anext_or_none, json_response, read_json, sse, until_disconnected
from srt_lite.entrypoints.openai.serving_chat import OpenAIServingChat, create_chat_completion
from srt_lite.entrypoints.openai.serving_completions import OpenAIServingCompletion, create_completion
from srt_lite.entrypoints.openai.serving_embeddings import create_embeddings
from srt_lite.entrypoints.openai.serving_models import list_models, retrieve_model
from srt_lite.entrypoints.openai.serving_tokenize import detokenize, tokenize
from srt_lite.entrypoints.server_state import ServerState
from srt_lite.entrypoints.openai.serving_responses import (
    OpenAIServingResponses,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from srt_lite.managers.tokenizer.generate_request import normalize_generate_request
from srt_lite.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt_lite.managers.validation import LogprobOptions, RequestError

logger = logging.getLogger(__name__)

# After the grace period's abort, how long the aborted requests get to send their final output.
ABORT_WAIT_S = 5.0


def _server(request: Request) -> ServerState:
    return request.app.state.server


# ---- native endpoints --------------------------------------------------------------------


async def health(request: Request) -> Response:
    reason = _server(request).unavailable()
    return error_response(reason, 503) if reason else Response(status_code=200)


async def health_generate(request: Request) -> Response:
    """A one-token generation through the whole pipeline."""
    state = _server(request)
    reason = state.unavailable()
    if reason:
        return error_response(reason, 503)
    tm = state.tm
    params = tm.make_sampling_params({"max_new_tokens": 1, "temperature": 0})
    try:
        async for _ in tm.generate([tm.tokenizer.eos_token_id or 0], params, internal=True):
            pass
    except Exception as e:  # noqa: BLE001
        return error_response(f"generation failed: {e}", 503)
    return Response(status_code=200)


async def get_model_info(request: Request) -> Response:
    state = _server(request)
    return json_response({
        "model_path": state.model_dir,
        "tokenizer_path": state.model_dir,
        "served_model_name": state.served_model_name,
        "is_generation": True,
        "max_context_length": state.tm.context_len,
        "model_type": getattr(state.hf_config, "model_type", None),
        "architectures": getattr(state.hf_config, "architectures", None),
    })


async def get_server_info(request: Request) -> Response:
    """The flags, the launch info and the scheduler's load. A gateway (sglang-router) reads
    its model id from `served_model_name` and loads its tokenizer from `model_path`, so both
    are the resolved values, never the flags' None."""
    state = _server(request)
    tm = state.tm
    info = dataclasses.asdict(tm.server_args)
    info.update(dataclasses.asdict(tm.info))
    info.update(
        model_path=state.model_dir,
        tokenizer_path=state.model_dir,
        served_model_name=state.served_model_name,
        dp_size=1,
        version=_version(),
    )
    try:
        info["load"] = dataclasses.asdict(await tm.get_load())
    except asyncio.TimeoutError:
        pass  # the scheduler is busy or gone; the rest is still worth answering
    return json_response(info)


async def get_load(request: Request) -> Response:
    """SGLang's load report, one entry per data-parallel rank (here one): what a gateway's
    power_of_two policy compares. num_tokens counts the KV that requests hold plus the prompt
    tokens still waiting."""
    load = await _server(request).tm.get_load()
    return json_response([{
        "dp_rank": 0,
        "num_reqs": load.num_running_reqs + load.num_waiting_reqs,
        "num_waiting_reqs": load.num_waiting_reqs,
        "num_tokens": load.kv_used_tokens + load.num_waiting_tokens,
    }])


async def flush_cache(request: Request) -> Response:
    out = await _server(request).tm.flush_cache()
    if out.success:
        return Response("Cache flushed.\n", status_code=200)
    return error_response(out.message or "cache flush refused", 400)


async def abort_request(request: Request) -> Response:
    body = await read_json(request)
    rid = body.get("rid", "") if isinstance(body, dict) else ""
    if not isinstance(rid, str):
        raise RequestError("rid must be a string")
    await _server(request).tm.abort(rid)
    return Response(status_code=200)


async def generate(request: Request) -> Response:
    """SGLang's /generate: one prompt or a batch, whole results or (one prompt) a stream."""
    tm = _server(request).tm
    body = await read_json(request)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    logprobs = LogprobOptions.from_body(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be a boolean")
    req = normalize_generate_request(
        tm, text=body.get("text"), input_ids=body.get("input_ids"), sampling_params=body.get("sampling_params"),
        rid=body.get("rid"), stream=stream, logprobs=logprobs,
    )
    if stream:
        agen = tm.generate(req.input_ids[0], req.params[0], stream=True, rid=req.rids[0], logprobs=logprobs)
        first = await anext_or_none(agen)  # errors surface here, before the 200 is sent
        return StreamingResponse(_sse_cumulative(first, agen), media_type="text/event-stream")

    async def collect() -> Response:
        outs = await tm.generate_all(req.input_ids, req.params, logprobs, req.choice_rids())
        return json_response(req.shape(outs))

    # A client that goes away aborts its requests, as on the OpenAI endpoints.
    return await until_disconnected(request, collect())


async def _sse_cumulative(first: dict | None, agen: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """SGLang's /generate stream: each event carries the whole text so far."""
    text, ids, lists = "", [], {}
    try:
        chunk = first
        while chunk is not None:
            text += chunk["text"]
            ids += chunk["output_ids"]
            meta = chunk["meta_info"]
            for key, value in meta.items():
                if key.endswith("logprobs"):  # incremental lists -> cumulative, like the text
                    lists.setdefault(key, []).extend(value)
                    meta[key] = list(lists[key])
            yield sse({"text": text, "output_ids": ids, "meta_info": meta})
            chunk = await anext_or_none(agen)
        yield SSE_DONE
    finally:
        await agen.aclose()


async def metrics(request: Request) -> Response:
    body, content_type = await _server(request).tm.render_metrics()
    return Response(body, media_type=content_type)


def _version() -> str:
    try:
        return version("srt_lite")
    except PackageNotFoundError:
        return "unknown"


# ---- the app -----------------------------------------------------------------------------


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's clients)
    matches; /health stays open for probes."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            bearer = headers.get(b"authorization", b"")
            given = bearer[len(b"Bearer ") :] if bearer.startswith(b"Bearer ") else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(given, self.key):
                message = "Incorrect API key provided."
                if scope["path"].startswith("/v1/messages"):
                    response = anthropic_error(message, 401, "authentication_error")
                else:
                    response = error_response(message, 401, "invalid_request_error", None, "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> Starlette:
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        # SGLang's current names and the older get_* ones, which clients still call.
        Route("/model_info", get_model_info, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/server_info", get_server_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/get_load", get_load, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", list_input_items, methods=["GET"]),
        Route("/v1/embeddings", create_embeddings, methods=["POST"]),
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    ]
    if state.tm.metrics is not None:
        routes.append(Route("/metrics", metrics, methods=["GET"]))
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    if state.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.api_key)
    app.state.server = state
    app.state.openai_chat = OpenAIServingChat(state)
    app.state.openai_responses = OpenAIServingResponses(state, app.state.openai_chat)
    app.state.anthropic_messages = AnthropicServingMessages(state, app.state.openai_chat)
    app.state.openai_completions = OpenAIServingCompletion(state)
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of exiting at once: new
    requests get 503 and /health turns 503, in-flight requests run for up to `grace` seconds,
    then whatever is left is aborted (clients get finish_reason abort) and the server stops.
    A second signal takes uvicorn's own path (stop now)."""

    def __init__(self, config: uvicorn.Config, tm: TokenizerManager, grace: float):
        super().__init__(config)
        self.tm = tm
        self.grace = grace
        self.drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain_task is not None or self.should_exit:
            return super().handle_exit(sig, frame)
        # Signal handlers run on the main thread, which is the one running the loop.
        self.drain_task = asyncio.get_event_loop().create_task(self.drain())

    async def drain(self) -> None:
        tm = self.tm
        tm.drain()
        if tm.num_in_flight():
            logger.info("Shutting down: waiting up to %.0f s for %d request(s) in flight", self.grace, tm.num_in_flight())
        if not await tm.wait_idle(self.grace):
            logger.info("Shutting down: aborting %d request(s)", tm.num_in_flight())
            await tm.abort("")  # "" = every request
            await tm.wait_idle(ABORT_WAIT_S)
        self.should_exit = True
