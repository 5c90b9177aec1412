"""POST /tokenize and POST /detokenize, in vLLM's shape.

/tokenize takes a `prompt` (encoded as the completions endpoint encodes it) or chat `messages`
(rendered with the chat template as /v1/chat/completions renders them, tools included) and
returns the `tokens`, their `count` and the server's `max_model_len`; /detokenize turns
`tokens` back into the `prompt` text.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from srt_lite.entrypoints.http_io import json_response, read_json
from srt_lite.entrypoints.openai.protocol import ChatCompletionRequest
from srt_lite.entrypoints.openai.serving_chat import OpenAIServingChat
from srt_lite.entrypoints.openai.tools import plan_tools
from srt_lite.managers.validation import RequestError


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(min_length=0)
    skip_special_tokens: Union[bool, None] = False


async def tokenize(request: Request) -> Response:
    chat: OpenAIServingChat = request.app.state.openai_chat
    req = TokenizeRequest.model_validate(await read_json(request))
    chat.check_model(req.model)
    tokenizer = chat.tm.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("give exactly one of prompt and messages")
    if req.prompt is not None:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tokenizer.encode(req.prompt, add_special_tokens=add)
    else:
        chat_req = ChatCompletionRequest.model_validate({k: v for k, v in {
            "messages": req.messages, "tools": req.tools, "chat_template_kwargs": req.chat_template_kwargs,
            "add_generation_prompt": req.add_generation_prompt, "continue_final_message": req.continue_final_message,
        }.items() if v is not None})
        text, ids = chat.build_prompt(chat_req, plan_tools(chat_req))
        if req.add_special_tokens:
            ids = tokenizer.encode(text, add_special_tokens=True)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": chat.tm.context_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return json_response(body)


async def detokenize(request: Request) -> Response:
    chat: OpenAIServingChat = request.app.state.openai_chat
    req = DetokenizeRequest.model_validate(await read_json(request))
    chat.check_model(req.model)
    vocab = chat.tm.info.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"tokens: {bad[0]} is not a token id of this model (0..{vocab - 1})")
    text = chat.tm.tokenizer.decode(req.tokens, skip_special_tokens=bool(req.skip_special_tokens))
    return json_response({"prompt": text})
