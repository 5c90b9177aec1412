"""Every HTTP error in the OpenAI format, `{"error": {"message", "type", "param", "code"}}`:
the body builder, the HTTP layer's own exceptions, and the app's exception handlers."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class ErrorKind:
    """How one kind of failure is answered: its HTTP status, its error type in OpenAI's body
    (None: named after the status) and in Anthropic's, and OpenAI's `code` (None: the status)."""

    status: int
    openai_type: str | None
    anthropic_type: str
    code: str | None = None


# The one table of the failures a request can meet, for every API's error shape.
ERROR_KINDS: dict[type[Exception], ErrorKind] = {
    RequestError: ErrorKind(400, None, "invalid_request_error"),
    ValidationError: ErrorKind(400, None, "invalid_request_error"),
    ModelNotFound: ErrorKind(404, "invalid_request_error", "not_found_error", "model_not_found"),
    NotFound: ErrorKind(404, "invalid_request_error", "not_found_error", "not_found"),
    PayloadTooLarge: ErrorKind(413, "invalid_request_error", "request_too_large"),
    Overloaded: ErrorKind(503, "service_unavailable", "overloaded_error"),
}


def describe(exc: Exception) -> tuple[ErrorKind, str, str | None]:
    """(kind, message, param) of a failure in ERROR_KINDS; a body that does not fit the request
    schema is described by its first problem, by field."""
    kind = next(k for cls, k in ERROR_KINDS.items() if isinstance(exc, cls))
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return kind, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param
    if isinstance(exc, ModelNotFound):
        return kind, str(exc), "model"
    return kind, str(exc), exc.param if isinstance(exc, NotFound) else None


def with_retry_after(response: Response, kind: ErrorKind) -> Response:
    if kind.status == 503:
        response.headers["Retry-After"] = "1"
    return response


async def on_error(request: Request, exc: Exception) -> Response:
    """The app's handler of every failure in ERROR_KINDS, in OpenAI's error body."""
    kind, message, param = describe(exc)
    return with_retry_after(error_response(message, kind.status, kind.openai_type, param, kind.code), kind)


EXCEPTION_HANDLERS = {cls: on_error for cls in ERROR_KINDS}
