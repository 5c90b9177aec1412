"""Tool calling: the checks on `tools` / `tool_choice`, and what a request's tool choice
means for its prompt, its grammar and the parsing of its output.

| tool_choice | prompt lists the tools | grammar | output parsed with |
| --- | --- | --- | --- |
| none | no | none | nothing (plain content) |
| auto | yes | none | the server's tool-call parser (--tool-call-parser) |
| required | yes | a JSON array of 1+ calls (1 without parallel_tool_calls) | json_array |
| {"function": {"name": f}} | yes | f's parameters schema | nothing: the output is f's arguments |

"none" leaves the tools out of the prompt: a small model shown tools tends to call them
anyway, and with "none" such a call would reach the client as garbled content. vLLM keeps
them in by default; OpenAI's models can be told not to call, ours often cannot.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from srt_lite.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from srt_lite.sampling.sampling_params import Grammar
from srt_lite.managers.validation import RequestError

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

# The parameters of a function declared without any: an empty argument object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools and tool_choice mean for this request (the table above)."""

    mode: str = "none"  # "none" | "auto" | "required" | "named"
    functions: list[dict[str, Any]] = field(default_factory=list)  # the `function` objects, as sent
    named: str | None = None  # the function of mode "named"
    parallel: bool = True

    @property
    def render_tools(self) -> bool:
        return self.mode != "none" and bool(self.functions)

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def tools_for_template(self) -> list[dict[str, Any]]:
        """The tools in OpenAI's own layout, which is what chat templates take as `tools`."""
        return [{"type": "function", "function": f} for f in self.functions]

    def parameters(self, name: str) -> dict[str, Any]:
        for f in self.functions:
            if f["name"] == name:
                return f.get("parameters") or NO_PARAMETERS
        raise KeyError(name)

    def grammar(self) -> Grammar | None:
        """The json_schema grammar that forces the call(s), for "required" and "named"."""
        if self.mode == "named":
            i = [f["name"] for f in self.functions].index(self.named)
            return Grammar("json_schema", json.dumps(self.parameters(self.named)), f"tools[{i}].function.parameters")
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "parameters": self.parameters(f["name"])},
                "required": ["name", "parameters"],
            }
            for f in self.functions
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return Grammar("json_schema", json.dumps(schema), "tools")

    def parser_format(self, auto_format: str) -> str | None:
        """The tool-call parser format for this request's output; None: no parsing."""
        if self.mode == "auto" and self.functions:
            return auto_format
        if self.mode == "required":
            return "json_array"
        return None


def plan_tools(req: ChatCompletionRequest) -> ToolPlan:
    """Checks `tools` and `tool_choice` (400 naming the field) and returns the plan."""
    functions = _check_tools(req.tools or [])
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if not functions:
            raise RequestError(f"tool_choice names function {name!r}, but the request has no tools")
        if name not in {f["name"] for f in functions}:
            raise RequestError(f"tool_choice names function {name!r}, which is not among the request's tools")
        return ToolPlan("named", functions, name, req.parallel_tool_calls)
    if choice == "required" and not functions:
        raise RequestError('tool_choice "required" needs at least one entry in tools')
    return ToolPlan(choice, functions, None, req.parallel_tool_calls)


def _check_tools(tools: list) -> list[dict[str, Any]]:
    functions: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise RequestError(f'tools[{i}].type must be "function", got {tool.type!r}')
        if tool.function is None:
            raise RequestError(f"tools[{i}].function is required")
        fn = tool.function
        if not TOOL_NAME.match(fn.name):
            raise RequestError(
                f"tools[{i}].function.name must be 1-64 letters, digits, underscores or dashes, got {fn.name!r}"
            )
        if fn.name in seen:
            raise RequestError(f"tools[{i}].function.name {fn.name!r} is already the name of tools[{seen[fn.name]}]")
        seen[fn.name] = i
        params = fn.parameters
        if params is not None and params.get("type", "object") != "object":
            raise RequestError(f'tools[{i}].function.parameters must be a JSON schema of "type": "object"')
        functions.append(fn.model_dump(exclude_none=True))
    return functions


def new_tool_call_id() -> str:
    """OpenAI's id layout: "call_" and 24 random characters."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One entry of `message.tool_calls`."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
