"""The Anthropic Messages API's request, and its translation into the chat request srt_lite
runs: `system` becomes a system message, `tool_use` blocks an assistant turn's tool calls,
`tool_result` blocks tool messages, `tools` (name, description, input_schema) chat function
tools, and `tool_choice` auto / any / tool / none the chat choices auto / required / named /
none. Image and document blocks are a 400 that names the block.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from srt_lite.entrypoints.openai.protocol import ChatCompletionRequest, join_text_parts
from srt_lite.managers.validation import RequestError


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent; server tools (web_search, ...) are refused


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class CountTokensRequest(BaseModel):
    """What /v1/messages/count_tokens reads (the prompt's parts, no sampling)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # `format`: {"type": "json_schema", "schema": ...}


def to_chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": join_text_parts(req.system, "system")})
    for i, msg in enumerate(req.messages):
        where = f"messages[{i}].content"
        if isinstance(msg.content, str):
            messages.append({"role": msg.role, "content": msg.content})
            continue
        text, calls, results = [], [], []
        for j, block in enumerate(msg.content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and msg.role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise RequestError(f"{where}[{j}]: a tool_use block needs a string id and name")
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}})
            elif kind == "tool_result" and msg.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise RequestError(f"{where}[{j}]: a tool_result block needs a string tool_use_id")
                content = join_text_parts(block.get("content", ""), f"{where}[{j}].content")
                if block.get("is_error"):
                    content = f"Error: {content}"
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
            elif kind in ("thinking", "redacted_thinking") and msg.role == "assistant":
                continue  # templates drop earlier turns' reasoning
            else:
                raise RequestError(f"{where}[{j}]: block type {kind!r} is not supported in a {msg.role} message")
        # Tool results answer the previous assistant turn, so they come before any new text.
        messages.extend(results)
        if msg.role == "assistant":
            messages.append({"role": "assistant", "content": "".join(text) or None, **({"tool_calls": calls} if calls else {})})
        elif text or not results:
            messages.append({"role": "user", "content": "".join(text)})
    return messages


def to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    chat: dict[str, Any] = {"model": req.model, "messages": to_chat_messages(req)}
    if req.tools is not None:
        for i, tool in enumerate(req.tools):
            if tool.type not in (None, "custom"):
                raise RequestError(f"tools[{i}].type {tool.type!r} is not supported: only custom tools (name, input_schema) are")
        chat["tools"] = [
            {"type": "function", "function": {k: v for k, v in
             (("name", t.name), ("description", t.description), ("parameters", t.input_schema)) if v is not None}}
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise RequestError('tool_choice of type "tool" needs a name')
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.thinking is not None:
        # Qwen3-style templates switch thinking with enable_thinking; others ignore it.
        chat["chat_template_kwargs"] = {"enable_thinking": req.thinking.get("type") == "enabled"}
    if isinstance(req, MessagesRequest):
        fmt = (req.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise RequestError('output_config.format must be {"type": "json_schema", "schema": {...}}')
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
        chat.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k)
    return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
