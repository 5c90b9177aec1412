"""The prompt side of tool calling: chat messages (with tool calls and tool results in the
history) and the request's tools -> the messages and kwargs for `apply_chat_template`.

Two paths, chosen by the chat template:

- native: the template knows tools (its source mentions `tools`, as Qwen2.5's, Llama 3.1's
  and Hermes' do). The tools go in as `tools=[...]`, and history messages keep `tool_calls`
  (arguments as parsed objects: those templates print them with `| tojson`, so a JSON string
  would come out quoted twice) and `tool_call_id`.
- preamble: the template knows nothing of tools (SmolLM2's). The tools are described in a
  Hermes-style system preamble (Qwen2.5's wording), merged into the first system message;
  past calls become `<tool_call>` blocks in the assistant's text and tool results a user turn
  of `<tool_response>` blocks, so the template sees only plain role/content messages.
  docs/api.md shows the preamble.
"""

from __future__ import annotations

import json
from typing import Any

from srt_lite.entrypoints.openai.protocol import ChatMessage
from srt_lite.entrypoints.openai.tools import ToolPlan
from srt_lite.managers.validation import RequestError

PREAMBLE_HEAD = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>"
)
# How to answer, by tool_choice mode: the forced modes ask for what their grammar forces
# (tools.py), so the model is not told one format and made to write another.
PREAMBLE_TAIL = {
    "auto": (
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
    ),
    "required": (
        "You must call {how_many}. Answer with only a JSON array of calls:\n"
        '[{{"name": <function-name>, "parameters": <args-json-object>}}]'
    ),
    "named": 'Call the function "{name}" now. Answer with only its arguments, as one JSON object.',
}


def template_source(tokenizer: Any, override: str | None) -> str | None:
    """The chat template's text: --chat-template's file, else the tokenizer's (a tokenizer
    may hold several named templates; "tool_use" is the one transformers picks for tools)."""
    if override is not None:
        return override
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        return tpl.get("tool_use") or tpl.get("default")
    return tpl


def template_supports_tools(source: str | None) -> bool:
    return bool(source) and "tools" in source


def render_inputs(
    messages: list[ChatMessage], plan: ToolPlan, native: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages for apply_chat_template, extra kwargs such as `tools`)."""
    if native:
        kwargs = {"tools": plan.tools_for_template()} if plan.render_tools else {}
        return [native_message(m, i) for i, m in enumerate(messages)], kwargs
    return preamble_messages(messages, plan), {}


# ---- native path ---------------------------------------------------------------------------


def native_message(m: ChatMessage, i: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": _text(m, i)}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.get("id"), "type": "function", "function": {"name": name, "arguments": _loads(args)}}
            for name, args, c in _calls(m, i)
        ]
    if m.role == "tool":
        if m.tool_call_id is not None:
            out["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            out["name"] = m.name
    return out


def _loads(arguments: str) -> Any:
    """Arguments as an object for templates that `tojson` them; text that is not JSON stays
    as sent (the template shows it as a string, which is still what the client wrote)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---- preamble path -------------------------------------------------------------------------


def preamble(plan: ToolPlan) -> str:
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.tools_for_template())
    how_many = "one or more of these functions" if plan.parallel else "exactly one of these functions"
    tail = PREAMBLE_TAIL[plan.mode].format(how_many=how_many, name=plan.named)
    return PREAMBLE_HEAD.format(tools=tools) + "\n\n" + tail


def preamble_messages(messages: list[ChatMessage], plan: ToolPlan) -> list[dict[str, Any]]:
    """Plain role/content messages: the tools preamble in the system message, past calls as
    <tool_call> blocks, tool results (consecutive ones merged) as one user turn."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role == "tool":
            block = f"<tool_response>\n{_text(m, i)}\n</tool_response>"
            if i > 0 and messages[i - 1].role == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        content = _text(m, i)
        if m.tool_calls:
            blocks = [
                "<tool_call>\n" + json.dumps({"name": name, "arguments": _loads(args)}, ensure_ascii=False) + "\n</tool_call>"
                for name, args, _ in _calls(m, i)
            ]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": m.role, "content": content})
    if plan.render_tools:
        text = preamble(plan)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = (out[0]["content"] + "\n\n" + text) if out[0]["content"] else text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# ---- shared --------------------------------------------------------------------------------


def _text(m: ChatMessage, i: int) -> str:
    try:
        return m.text()
    except ValueError as e:
        raise RequestError(f"messages[{i}].content: {e}") from None


def _calls(m: ChatMessage, i: int) -> list[tuple[str, str, dict]]:
    """(name, arguments text, the call as sent) of an assistant message's tool_calls."""
    if m.role != "assistant":
        raise RequestError(f"messages[{i}].tool_calls is only allowed on assistant messages")
    calls = []
    for j, c in enumerate(m.tool_calls or []):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = c.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.function.name is required")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):  # lenient: some clients send the object itself
            args = json.dumps(args)
        if not isinstance(args, str):
            raise RequestError(f"{where}.function.arguments must be a JSON string")
        calls.append((fn["name"], args, c))
    return calls
