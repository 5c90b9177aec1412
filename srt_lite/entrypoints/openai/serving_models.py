"""GET /v1/models and GET /v1/models/{model}: the one served model, and the check of a
request's `model` field."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from srt_lite.entrypoints.errors import ModelNotFound
from srt_lite.entrypoints.http_io import json_response

if TYPE_CHECKING:
    from srt_lite.entrypoints.server_state import ServerState


def check_model(state: ServerState, name: str) -> None:
    """Raises ModelNotFound (404) unless `name` is the served name or the model's path."""
    if name not in state.model_names:
        raise ModelNotFound(f"The model `{name}` does not exist.")


def model_card(state: ServerState) -> dict:
    return {
        "id": state.served_model_name, "object": "model", "created": 0, "owned_by": "srt_lite",
        "root": state.model_dir, "max_model_len": state.tm.context_len,
    }


async def list_models(request: Request) -> Response:
    return json_response({"object": "list", "data": [model_card(request.app.state.server)]})


async def retrieve_model(request: Request) -> Response:
    state = request.app.state.server
    check_model(state, request.path_params["model"])
    return json_response(model_card(state))
