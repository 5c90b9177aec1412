"""The Responses API's request, and its translation into the chat request srt_lite runs.

A Responses request is a chat request in other clothes: `input` items become chat messages
(`function_call` items an assistant turn's tool calls, `function_call_output` items tool
messages), `instructions` a system message, flat function `tools` chat tools, and
`text.format` a response_format. What has no chat counterpart (built-in tools such as
web_search, images and files, background mode) is a 400 that names the field.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from srt_lite.entrypoints.openai.protocol import ChatCompletionRequest, join_text_parts
from srt_lite.managers.validation import RequestError

# Text part types a message's content may hold: the user's and, in replayed history, the model's.
TEXT_PARTS = ("input_text", "output_text", "text")


def item_id(prefix: str) -> str:
    """OpenAI's id layout for response objects and items: a prefix and 48 hex characters."""
    return f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"


class TextFormat(BaseModel):
    """`text.format`: text, json_object, or json_schema with the schema inline (not nested as
    in chat's response_format)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    background: bool = False
    # vLLM's and SGLang's sampling extras
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512.
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 pairs, keys of at most 64 characters and values of at most 512")
        return v


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as a list of items, each with an id (what input_items lists)."""
    if isinstance(req.input, str):
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}]
    else:
        items = [dict(item) for item in req.input]
    for item in items:
        item.setdefault("type", "message")
        if "id" not in item:
            item["id"] = item_id({"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(item["type"], "item"))
    return items


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items -> chat messages. Consecutive function calls join one assistant turn (after
    its text, if the turn has any); reasoning items are dropped, as chat templates drop the
    reasoning of earlier turns."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role must be user, system, developer or assistant, got {role!r}")
            messages.append({"role": role, "content": join_text_parts(item.get("content"), f"{where}.content", TEXT_PARTS)})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise RequestError(f"{where}.{key} must be a string")
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}.call_id must be a string")
            output = item.get("output")
            text = output if isinstance(output, str) else join_text_parts(output, f"{where}.output", TEXT_PARTS)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise RequestError(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output, reasoning)")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools -> chat tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise RequestError(f"tools[{i}].type {tool.get('type')!r} is not supported: only function tools are")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        if "name" not in fn:
            raise RequestError(f"tools[{i}].name is required")
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}')
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise RequestError('text.format.schema is required when text.format.type is "json_schema"')
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]], items: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """(the chat request to run, the conversation it continues: history + this input, without
    the instructions, which apply to this turn only)."""
    if req.background:
        raise RequestError("background is not supported")
    conversation = history + items_to_messages(items)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    if not messages:
        raise RequestError("input must not be empty")
    chat = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "user": req.user,
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": chat_response_format(req.text),
    }
    return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None}), conversation
