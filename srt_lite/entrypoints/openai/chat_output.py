"""One chat choice's output text -> `reasoning_content`, `content` and `tool_calls`.

The reasoning parser (if any) splits off the reasoning first; the tool-call parser (if the
request's tool_choice asks for one, see tools.ToolPlan) then reads the content part only, so
a model that thinks before it calls works as one that does not. A ChoiceOutput holds one
choice's parser state: make one per choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from srt_lite.entrypoints.openai.tools import new_tool_call_id, tool_call_json
from srt_lite.parser.reasoning_parser import ReasoningParser
from srt_lite.parser.tool_call_parser import ToolCallDelta, ToolCallParser


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict[str, Any]] | None


class ChoiceOutput:
    """Parses one choice. Tool calls come from a parser of `tool_format`, or, with `named`
    (tool_choice naming a function), the whole content is that function's arguments."""

    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tool_format: str | None = None,
        tool_names: set[str] | None = None,
        named: str | None = None,
    ):
        self.reasoning = reasoning
        self.named = named
        self.tools = ToolCallParser(tool_format, tool_names) if tool_format and named is None else None
        self.ids: dict[int, str] = {}  # call index -> id, given at the call's first delta

    @property
    def made_calls(self) -> bool:
        return bool(self.ids)

    # ---- whole output --------------------------------------------------------------------

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse_non_stream(text)
        calls: list[tuple[str, str]] = []
        if self.named is not None:
            calls, content = ([(self.named, content)] if content.strip() else []), ""
        elif self.tools is not None:
            content, items = self.tools.parse_non_stream(content)
            calls = [(c.name, c.arguments) for c in items]
        if not calls:
            return ParsedMessage(reasoning, content, None)
        tool_calls = []
        for i, (name, arguments) in enumerate(calls):
            self.ids[i] = new_tool_call_id()
            tool_calls.append(tool_call_json(self.ids[i], name, arguments))
        # OpenAI sends null, not "", when a message holds only calls.
        return ParsedMessage(reasoning, content if content and content.strip() else None, tool_calls)

    # ---- streaming -----------------------------------------------------------------------

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The chat deltas for a chunk's new text (the choice's last chunk when `final`): one
        with the text parts if any, then one per tool-call step: a call's first delta
        (id, type, name, empty arguments), then its argument fragments."""
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse_stream_chunk(text)
            if final:
                r2, c2 = self.reasoning.flush()
                reasoning, content = reasoning + r2, content + c2
        calls: list[ToolCallDelta] = []
        if self.named is not None:
            calls = [ToolCallDelta(0, None if self.ids else self.named, content)] if content else []
            content = ""
        elif self.tools is not None:
            content, calls = self.tools.parse_stream_chunk(content)
            if final:
                c2, more = self.tools.flush()
                content, calls = content + c2, calls + more
        deltas: list[dict[str, Any]] = []
        text_delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
        if text_delta:
            deltas.append(text_delta)
        for d in calls:
            deltas.extend(self._call_deltas(d))
        return _merge_fragments(deltas)

    def _call_deltas(self, d: ToolCallDelta) -> list[dict[str, Any]]:
        out = []
        if d.name is not None:
            self.ids[d.index] = new_tool_call_id()
            head = {"index": d.index, "id": self.ids[d.index], "type": "function", "function": {"name": d.name, "arguments": ""}}
            out.append({"tool_calls": [head]})
        if d.arguments:
            out.append({"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments}}]})
        return out


def _merge_fragments(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent argument fragments of one call become one delta (fewer events)."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        prev = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
        cur = d["tool_calls"][0] if "tool_calls" in d else None
        if prev and cur and "id" not in prev and "id" not in cur and prev["index"] == cur["index"]:
            prev["function"]["arguments"] += cur["function"]["arguments"]
        else:
            out.append(d)
    return out
