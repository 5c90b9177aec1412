"""Reading request bodies and writing JSON and server-sent-event responses, shared by the
native and the OpenAI endpoints."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response

from srt_lite.entrypoints.errors import PayloadTooLarge
from srt_lite.managers.validation import RequestError

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


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


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_event(name: str, obj: Any) -> bytes:
    """A server-sent event with its name (the Responses and Anthropic streams name theirs)."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


async def anext_or_none(it: AsyncIterator[T]) -> T | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Runs a non-streaming handler, cancelling it if the client goes away (which closes
    its generators and so aborts the request in the scheduler)."""
    task = asyncio.ensure_future(work)
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
