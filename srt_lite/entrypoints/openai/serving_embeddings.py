"""POST /v1/embeddings.

Each input runs as a prefill-only request through the same scheduler and batches as
generation (TokenizedGenerateReqInput.embed): its prompt is computed, the last layer's hidden
states are pooled (`--embedding-pooling`, the last token by default) and L2-normalized, and
the request ends holding no KV. `dimensions` keeps the first n components and normalizes them
again (as Matryoshka-trained models such as Qwen3-Embedding expect).
"""

from __future__ import annotations

import asyncio
import base64
import math
from contextlib import aclosing
from typing import Any, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from srt_lite.entrypoints.http_io import json_response, read_json, until_disconnected
from srt_lite.entrypoints.openai.serving_base import abort_error
from srt_lite.entrypoints.openai.serving_chat import OpenAIServingChat
from srt_lite.managers.validation import RequestError

# OpenAI's limit on the inputs of one request.
MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: str = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


async def create_embeddings(request: Request) -> Response:
    """POST /v1/embeddings"""
    chat: OpenAIServingChat = request.app.state.openai_chat
    req = EmbeddingRequest.model_validate(await read_json(request))
    chat.check_model(req.model)
    if req.encoding_format not in ("float", "base64"):
        raise RequestError(f'encoding_format must be "float" or "base64", got {req.encoding_format!r}')
    tm = chat.tm
    prompts = _prompts(req, tm)
    params = tm.make_sampling_params({"max_new_tokens": 0, "temperature": 0})
    for ids in prompts:
        tm.validate(ids, params)

    async def one(ids: list[int]) -> dict:
        out: dict = {}
        # aclosing: a cancelled request (client gone) closes its generator now, which aborts
        # it in the scheduler, instead of whenever the generator is collected.
        async with aclosing(tm.generate(ids, params, embed=True)) as outputs:
            async for out in outputs:
                pass
        err = abort_error(out["meta_info"])
        if err:
            raise RequestError(err)
        return out["meta_info"]

    async def run() -> Response:
        metas = await asyncio.gather(*(one(ids) for ids in prompts))
        data = []
        for i, meta in enumerate(metas):
            vector = meta.get("embedding")
            if vector is None:
                raise RequestError("the request ended before its embedding was computed")
            if req.dimensions is not None:
                if req.dimensions > len(vector):
                    raise RequestError(f"dimensions must be at most {len(vector)} for this model, got {req.dimensions}")
                vector = _renormalize(vector[: req.dimensions])
            value: Any = vector
            if req.encoding_format == "base64":
                value = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = sum(len(ids) for ids in prompts)
        return json_response({
            "object": "list", "data": data, "model": chat.state.served_model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })

    return await until_disconnected(request, run())


def _prompts(req: EmbeddingRequest, tm: Any) -> list[list[int]]:
    x = req.input
    if isinstance(x, str):
        items: list = [x]
    elif x and all(isinstance(v, int) for v in x):
        items = [list(x)]
    else:
        items = list(x)
    if not items:
        raise RequestError("input must not be empty")
    if len(items) > MAX_INPUTS:
        raise RequestError(f"input holds {len(items)} items; at most {MAX_INPUTS} are allowed")
    prompts = []
    for i, item in enumerate(items):
        ids = tm.tokenize(item) if isinstance(item, str) else list(item)
        if not ids:
            raise RequestError(f"input[{i}] is empty")
        prompts.append(ids)
    return prompts


def _renormalize(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]
