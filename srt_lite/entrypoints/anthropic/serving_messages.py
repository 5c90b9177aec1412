"""The Anthropic Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A request is translated into a chat request (protocol.py) and runs through the chat machinery;
its parsed output becomes content blocks: `thinking` (reasoning models), `text`, and one
`tool_use` per call. Errors take Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, on these endpoints.
"""

from __future__ import annotations

import json
import uuid
from functools import wraps
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from srt_lite.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest, to_chat
from srt_lite.entrypoints.errors import ERROR_KINDS, describe, with_retry_after
from srt_lite.entrypoints.http_io import anext_or_none, json_response, read_json, sse_event
from srt_lite.entrypoints.openai.chat_output import ChoiceOutput
from srt_lite.entrypoints.openai.serving_base import abort_error, collect_one, finish_reason
from srt_lite.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from srt_lite.entrypoints.openai.tools import plan_tools

if TYPE_CHECKING:
    from srt_lite.entrypoints.server_state import ServerState


def error_response(message: str, status: int, err_type: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": err_type, "message": message}}, status_code=status)


def anthropic_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint's errors in Anthropic's shape instead of OpenAI's."""

    @wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except tuple(ERROR_KINDS) as e:
            kind, message, _ = describe(e)
            return with_retry_after(error_response(message, kind.status, kind.anthropic_type), kind)

    return wrapped


@anthropic_errors
async def create_message(request: Request) -> Response:
    """POST /v1/messages"""
    serving: AnthropicServingMessages = request.app.state.anthropic_messages
    return await serving.create(request, await read_json(request))


@anthropic_errors
async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens"""
    serving: AnthropicServingMessages = request.app.state.anthropic_messages
    return json_response({"input_tokens": serving.count_tokens(await read_json(request))})


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id(call_id: str) -> str:
    """Anthropic's "toolu_" ids, from the chat call ids ("call_" + 24 characters)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the `input` object; arguments that are not a JSON object (only
    possible when the model wrote the call freely, tool_choice auto) become {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class AnthropicServingMessages:
    def __init__(self, state: "ServerState", chat: OpenAIServingChat):
        self.state = state
        self.chat = chat

    def count_tokens(self, body: Any) -> int:
        req = CountTokensRequest.model_validate(body)
        chat_req = to_chat(req)
        self.chat.check_model(chat_req.model)
        _, ids = self.chat.build_prompt(chat_req, plan_tools(chat_req))
        return len(ids)

    async def create(self, request: Request, body: Any) -> Response:
        req = MessagesRequest.model_validate(body)
        run = self.chat.plan(to_chat(req))
        message = MessageBuilder(self.state.served_model_name, req, run)
        choices = self.chat.start(run, bool(req.stream))
        return await self.chat.respond(
            request, req.stream, choices, lambda first: message.stream(first, choices), lambda: message.collect(choices)
        )


class MessageBuilder:
    """One message being made: its content blocks, stop reason and usage."""

    def __init__(self, model: str, req: MessagesRequest, run: ChatRun):
        self.model = model
        self.req = req
        self.run = run
        self.id = message_id()
        self.blocks: list[dict[str, Any]] = []
        self.open = False  # whether the last block is still being streamed

    def stop(self, meta: dict, made_calls: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        reason, matched = finish_reason(meta)
        if reason == "length":
            return "max_tokens", None
        if made_calls:
            return "tool_use", None
        if isinstance(matched, str) and matched in (self.req.stop_sequences or []):
            return "stop_sequence", matched
        return "end_turn", None

    def usage(self, meta: dict) -> dict[str, int]:
        return {
            "input_tokens": meta.get("prompt_tokens", len(self.run.input_ids)),
            "output_tokens": meta.get("completion_tokens", 0),
            "cache_read_input_tokens": meta.get("cached_tokens", 0),
            "cache_creation_input_tokens": 0,
        }

    def body(self, stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": self.blocks,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage,
        }

    # ---- whole message ----------------------------------------------------------------------

    async def collect(self, choices: AsyncIterator) -> Response:
        text, meta = await collect_one(choices)
        msg = self.run.new_output().parse(text)
        if msg.reasoning:
            self.blocks.append({"type": "thinking", "thinking": msg.reasoning, "signature": ""})
        if msg.content:
            self.blocks.append({"type": "text", "text": msg.content})
        for call in msg.tool_calls or []:
            fn = call["function"]
            self.blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": fn["name"], "input": tool_input(fn["arguments"])})
        return json_response(self.body(*self.stop(meta, bool(msg.tool_calls)), self.usage(meta)))

    # ---- streaming --------------------------------------------------------------------------

    async def stream(self, first, choices: AsyncIterator) -> AsyncIterator[bytes]:
        out: ChoiceOutput = self.run.new_output()
        try:
            start = self.body(None, None, {**self.usage({}), "output_tokens": 0})
            yield sse_event("message_start", {"type": "message_start", "message": start})
            item, meta = first, {}
            while item is not None:
                _, chunk = item
                meta = chunk["meta_info"]
                err = abort_error(meta)
                if err:
                    yield sse_event("error", {"type": "error", "error": {"type": "invalid_request_error", "message": err}})
                    return
                reason, _ = finish_reason(meta)
                for delta in out.feed(chunk["text"], final=reason is not None):
                    for event in self.delta_events(delta):
                        yield event
                item = await anext_or_none(choices)
            for event in self.close_block():
                yield event
            stop_reason, stop_sequence = self.stop(meta, out.made_calls)
            usage = self.usage(meta)
            yield sse_event("message_delta", {
                "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": usage["output_tokens"], "input_tokens": usage["input_tokens"],
                          "cache_read_input_tokens": usage["cache_read_input_tokens"]},
            })
            yield sse_event("message_stop", {"type": "message_stop"})
        finally:
            await choices.aclose()

    def delta_events(self, delta: dict[str, Any]) -> list[bytes]:
        """Events for one chat delta of ChoiceOutput.feed; a change of kind closes the open block."""
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            out += self.open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self.block_delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self.open_block("text", {"type": "text", "text": ""})
            out.append(self.block_delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                out += self.close_block()
                block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"], "input": {}}
                out += self.open_block("tool_use", block, new=True)
            fragment = call["function"].get("arguments")
            if fragment:
                out.append(self.block_delta({"type": "input_json_delta", "partial_json": fragment}))
        return out

    def open_block(self, kind: str, block: dict[str, Any], new: bool = False) -> list[bytes]:
        if self.open and self.blocks[-1]["type"] == kind and not new:
            return []
        out = self.close_block()
        self.blocks.append(block)
        self.open = True
        out.append(sse_event("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}))
        return out

    def block_delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta})

    def close_block(self) -> list[bytes]:
        if not self.open:
            return []
        self.open = False
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]
