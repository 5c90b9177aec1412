"""Every HTTP error in the OpenAI format, `{"error": {"message", "type", "param", "code"}}`:
the body builder, the HTTP layer's own exceptions, and the app's exception handlers."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from srt_lite.managers.tokenizer.tokenizer_manager import Overloaded
from srt_lite.managers.validation import RequestError


class PayloadTooLarge(Exception):
    """A request body over --max-request-bytes (HTTP 413)."""


class ModelNotFound(Exception):
    """A request's `model` is neither the served name nor the model path (HTTP 404)."""


class NotFound(Exception):
    """An id that names nothing (a stored response that is unknown, expired or evicted): HTTP
    404; `param` is the request field that held it, if any."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_response(
    message: str, status: int = 400, err_type: str | None = None, param: str | None = None, code: Any = None
) -> JSONResponse:
    err_type = err_type or ("BadRequestError" if status == 400 else HTTPStatus(status).phrase.replace(" ", ""))
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": param, "code": code if code is not None else status}},
        status_code=status,
    )


def stream_error(message: str) -> dict:
    """The error event of a stream that fails after its 200 went out."""
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}


async def on_request_error(request: Request, exc: RequestError) -> Response:
    return error_response(str(exc), 400)


async def on_validation_error(request: Request, exc: ValidationError) -> Response:
    """A body that does not fit the OpenAI request schema: the first problem, by field."""
    first = exc.errors()[0]
    param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    return error_response(f"{param}: {first.get('msg')}" if param else str(first.get("msg")), 400, param=param)


async def on_model_not_found(request: Request, exc: ModelNotFound) -> Response:
    return error_response(str(exc), 404, "invalid_request_error", "model", "model_not_found")


async def on_not_found(request: Request, exc: NotFound) -> Response:
    return error_response(str(exc), 404, "invalid_request_error", exc.param, "not_found")


async def on_too_large(request: Request, exc: PayloadTooLarge) -> Response:
    return error_response(str(exc), 413, "invalid_request_error")


async def on_overloaded(request: Request, exc: Overloaded) -> Response:
    response = error_response(str(exc), 503, "service_unavailable")
    response.headers["Retry-After"] = "1"
    return response


EXCEPTION_HANDLERS = {
    RequestError: on_request_error,
    ValidationError: on_validation_error,
    ModelNotFound: on_model_not_found,
    NotFound: on_not_found,
    PayloadTooLarge: on_too_large,
    Overloaded: on_overloaded,
}
