"""The HTTP server: a starlette app over the TokenizerManager.

Native (SGLang-compatible) endpoints live here; the OpenAI-compatible ones are mounted from
`entrypoints/openai/`. Every error is returned in the OpenAI error format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from http import HTTPStatus
from typing import Any, AsyncIterator

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from srt_lite.managers.tokenizer_manager import LogprobOptions, Overloaded, RequestError, TokenizerManager
from srt_lite.metrics import MetricsCollector

logger = logging.getLogger(__name__)


def error_response(
    message: str, status: int = 400, err_type: str | None = None, param: str | None = None, code: Any = None
) -> JSONResponse:
    """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
    err_type = err_type or ("BadRequestError" if status == 400 else HTTPStatus(status).phrase.replace(" ", ""))
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": param, "code": code if code is not None else status}},
        status_code=status,
    )


def orjson_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


class PayloadTooLarge(Exception):
    pass


async def read_json(request: Request) -> Any:
    """The JSON body, read up to --max-request-bytes (413 beyond; 400 if not JSON or UTF-8)."""
    limit = request.app.state.server.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
        chunks.append(chunk)
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class ServerState:
    """What the endpoints share: the manager, the launch info, options, and liveness."""

    def __init__(
        self,
        tokenizer_manager: TokenizerManager,
        model_dir: str,
        served_model_name: str,
        generation_defaults: dict | None = None,
    ):
        args = tokenizer_manager.server_args
        self.tm = tokenizer_manager
        self.model_dir = model_dir
        self.served_model_name = served_model_name
        # Names a request's `model` may use: the served name and the path it was started with.
        self.model_names = {served_model_name, model_dir} | ({args.model_path} if args.model_path else set())
        self.generation_defaults = generation_defaults or {}
        self.reasoning_parser = args.reasoning_parser
        self.enable_cache_report = args.enable_cache_report
        self.enable_metrics = args.enable_metrics
        self.api_key = args.api_key
        self.max_request_bytes = args.max_request_bytes
        self.chat_template = open(args.chat_template).read() if args.chat_template else None
        self.dead: str | None = None

    @staticmethod
    def json(obj: Any, status: int = 200) -> Response:
        return orjson_response(obj, status)

    @staticmethod
    def sse(obj: Any) -> bytes:
        return sse(obj)

    @staticmethod
    async def until_disconnected(request: Request, coro) -> Response:
        """Runs a non-streaming handler, cancelling it if the client goes away (which closes
        its generators and so aborts the request in the scheduler)."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    return Response(status_code=499)
        finally:
            if not task.done():
                task.cancel()


def build_app(state: ServerState) -> Starlette:
    tm = state.tm

    async def health(request: Request) -> Response:
        if state.dead:
            return error_response(state.dead, 503)
        if tm.draining:
            return error_response("the server is shutting down", 503)
        return Response(status_code=200)

    async def health_generate(request: Request) -> Response:
        if state.dead or tm.draining:
            return error_response(state.dead or "the server is shutting down", 503)
        params = tm.make_sampling_params({"max_new_tokens": 1, "temperature": 0})
        try:
            async for _ in tm.generate([tm.tokenizer.eos_token_id or 0], params, internal=True):
                pass
        except Exception as e:  # noqa: BLE001
            return error_response(f"generation failed: {e}", 503)
        return Response(status_code=200)

    async def get_model_info(request: Request) -> Response:
        return orjson_response(
            {
                "model_path": state.model_dir,
                "tokenizer_path": state.model_dir,
                "served_model_name": state.served_model_name,
                "is_generation": True,
                "max_context_length": tm.context_len,
            }
        )

    async def get_server_info(request: Request) -> Response:
        info = dataclasses.asdict(tm.server_args)
        info.update(dataclasses.asdict(tm.info))
        info["version"] = _version()
        try:
            load = await tm.get_load()
            info["load"] = dataclasses.asdict(load)
        except asyncio.TimeoutError:
            pass
        return orjson_response(info)

    async def flush_cache(request: Request) -> Response:
        out = await tm.flush_cache()
        if out.success:
            return Response("Cache flushed.\n", status_code=200)
        return error_response(out.message or "cache flush refused", 400)

    async def abort_request(request: Request) -> Response:
        body = await read_json(request)
        rid = body.get("rid", "") if isinstance(body, dict) else ""
        if not isinstance(rid, str):
            raise RequestError("rid must be a string")
        await tm.abort(rid)
        return Response(status_code=200)

    async def generate(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        items, is_batch = _generate_items(tm, body)
        logprobs = LogprobOptions.from_body(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError("stream must be a boolean")
        if stream:
            if is_batch or items[0][1].n > 1:
                raise RequestError("stream=true takes a single prompt with n == 1")
            ids, params, rid = items[0]
            agen = tm.generate(ids, params, stream=True, rid=rid, logprobs=logprobs)
            first = await _first(agen)  # errors surface here, before the 200 is sent
            return StreamingResponse(_sse_cumulative(first, agen), media_type="text/event-stream")

        async def one(ids, params, rid):
            if params.n > 1:
                return await tm.generate_n(ids, params, logprobs)
            out = None
            async for out in tm.generate(ids, params, rid=rid, logprobs=logprobs):
                pass
            return [out]

        groups = await asyncio.gather(*(one(*it) for it in items))
        outs = [o for g in groups for o in g]
        return orjson_response(outs if is_batch or len(outs) > 1 else outs[0])

    from pydantic import ValidationError

    from srt_lite.entrypoints.openai.serving_base import ModelNotFound
    from srt_lite.entrypoints.openai.serving_chat import OpenAIServingChat
    from srt_lite.entrypoints.openai.serving_completions import OpenAIServingCompletion

    chat = OpenAIServingChat(state)
    completions = OpenAIServingCompletion(state)

    async def chat_completions(request: Request) -> Response:
        return await chat.create(request, await read_json(request))

    async def openai_completions(request: Request) -> Response:
        return await completions.create(request, await read_json(request))

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "srt_lite", "root": state.model_dir,
                "max_model_len": tm.context_len}

    async def list_models(request: Request) -> Response:
        return orjson_response({"object": "list", "data": [model_card(state.served_model_name)]})

    async def retrieve_model(request: Request) -> Response:
        name = request.path_params["model"]
        if name not in state.model_names:
            return error_response(f"The model `{name}` does not exist.", 404, "invalid_request_error", "model", "model_not_found")
        return orjson_response(model_card(state.served_model_name))

    async def on_request_error(request: Request, exc: RequestError) -> Response:
        return error_response(str(exc), 400)

    async def on_validation_error(request: Request, exc: ValidationError) -> Response:
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return error_response(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), 400, param=param)

    async def on_too_large(request: Request, exc: PayloadTooLarge) -> Response:
        return error_response(str(exc), 413, "invalid_request_error")

    async def on_overloaded(request: Request, exc: Overloaded) -> Response:
        response = error_response(str(exc), 503, "service_unavailable")
        response.headers["Retry-After"] = "1"
        return response

    async def on_model_not_found(request: Request, exc: ModelNotFound) -> Response:
        return error_response(str(exc), 404, "invalid_request_error", "model", "model_not_found")

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
    ]
    if state.enable_metrics:
        tm.metrics = MetricsCollector(state.served_model_name)

        async def metrics(request: Request) -> Response:
            body, content_type = tm.metrics.render(await tm.get_load())
            return Response(body, media_type=content_type)

        routes.append(Route("/metrics", metrics, methods=["GET"]))
    handlers = {
        RequestError: on_request_error,
        ValidationError: on_validation_error,
        ModelNotFound: on_model_not_found,
        PayloadTooLarge: on_too_large,
        Overloaded: on_overloaded,
    }
    app = Starlette(routes=routes, exception_handlers=handlers)
    if state.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.api_key)
    app.state.server = state
    return app


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches; /health stays open for probes."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            import hmac

            if not hmac.compare_digest(auth, self.expected):
                response = error_response("Incorrect API key provided.", 401, "invalid_request_error", None, "invalid_api_key")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _generate_items(tm: TokenizerManager, body: dict) -> tuple[list[tuple[list[int], Any, str | None]], bool]:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("give exactly one of text or input_ids")
    if text is not None:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a non-empty list of strings")
        ids = [tm.tokenize(t) for t in texts]
    else:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids must be a non-empty list of token ids or of lists of token ids")
        is_batch = isinstance(input_ids[0], list)
        ids = input_ids if is_batch else [input_ids]
        if not all(isinstance(x, list) for x in ids):
            raise RequestError("input_ids must not mix token ids and lists")
    sp = body.get("sampling_params")
    if isinstance(sp, list):
        if len(sp) != len(ids):
            raise RequestError("sampling_params list must have one entry per prompt")
        params = [tm.make_sampling_params(p if isinstance(p, dict) else _bad_params()) for p in sp]
    else:
        if sp is not None and not isinstance(sp, dict):
            raise RequestError("sampling_params must be an object")
        params = [tm.make_sampling_params(sp)] * len(ids)
    rid = body.get("rid")
    rids = rid if isinstance(rid, list) else [rid] * len(ids)
    if rid is not None and is_batch and not isinstance(rid, list):
        raise RequestError("rid must be a list for a batch")
    if len(rids) != len(ids) or not all(r is None or isinstance(r, str) for r in rids):
        raise RequestError("rid must be a string (or a list of strings for a batch)")
    for i, p in zip(ids, params):
        tm.validate(i, p)
    return list(zip(ids, params, rids)), is_batch


def _bad_params():
    raise RequestError("each sampling_params entry must be an object")


async def _first(agen: AsyncIterator[dict]) -> dict | None:
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None


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
            chunk = await _first(agen)
        yield b"data: [DONE]\n\n"
    finally:
        await agen.aclose()


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("srt_lite")
    except Exception:  # noqa: BLE001
        return "unknown"


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
        tm, loop = self.tm, asyncio.get_running_loop()
        tm.draining = True
        if tm.rid_to_state:
            logger.info(
                "Shutting down: waiting up to %.0f s for %d request(s) in flight", self.grace, len(tm.rid_to_state)
            )
        await _wait_until_idle(tm, loop.time() + self.grace)
        if tm.rid_to_state:
            logger.info("Shutting down: aborting %d request(s)", len(tm.rid_to_state))
            await tm.abort("")  # "" = every request
            await _wait_until_idle(tm, loop.time() + 5.0)  # their final abort outputs
        self.should_exit = True


async def _wait_until_idle(tm: TokenizerManager, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while tm.rid_to_state and loop.time() < deadline:
        await asyncio.sleep(0.05)
