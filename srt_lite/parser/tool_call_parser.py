"""Tool-call parser: splits a model's output into content and OpenAI `tool_calls`.

With `tools` and tool_choice "auto" the model decides itself whether to call a function, and
writes the call as text in its own format; the chat API returns the calls as structured
`tool_calls` (name + arguments JSON text), apart from the rest of the text in `content`.
Three formats, named as SGLang names its detectors:

- hermes (alias qwen25): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
  any number of them, anywhere in the output; text outside the tags is content.
- llama3 (Llama 3.1/3.2 JSON tool calling): the output is, after optional whitespace and an
  optional `<|python_tag|>`, one or more `{"name": "f", "parameters": {...}}` objects
  separated by `;`. An output that does not start that way is all content.
- json_array: the output of a grammar-forced tool_choice "required": one JSON array
  `[{"name": "f", "parameters": {...}}, ...]`.

Both "arguments" and "parameters" name the arguments, in every format. One-shot and
streaming run the same incremental scanner (tool_call_scanner.py; parse_non_stream feeds it
the whole text), which decides nothing before the text that decides it has arrived, so
streamed deltas concatenate exactly to the one-shot result for every chunking. Rules:

- A call is accepted the moment its name is known (the "name" member's string has closed)
  and is in `tool_names` (when given): its first delta carries the name, and the arguments
  then stream as they arrive. If members other than "name" come first they are skipped, but
  if the arguments come before the name, the call is held back until its object closes.
- Before it is accepted, a call that turns out malformed (not a JSON object, no string
  name), names an unknown function (logged as a warning), or is cut off by the end of the
  output is not a call: its text stays content, verbatim. hermes then looks for the next
  `<tool_call>` right after the rejected tag; in llama3/json_array everything from the
  rejected call's separator (or the whole output, for the first call) is content.
- `arguments` is the model's raw text of the arguments value (so it streams as written).
  A value written as a JSON string is held until the string closes: if its contents are a
  JSON object, they are the arguments (decoded); otherwise the string literal as written is.
  A call without arguments gets "{}".
- An accepted call is never taken back. If its text goes wrong later (invalid characters,
  a missing bracket) or the output ends inside it (max_tokens), the call keeps what it has
  sent: its arguments may then be truncated JSON, as OpenAI's are when a reply is cut off.
  (Arguments are followed by their strings and brackets only, not validated: a model that
  writes {"city": Paris} gets that text as its arguments.)
  hermes drops the rest of such a call up to its `</tool_call>` (logged as a warning), so
  content never carries a parsed call's tags; llama3/json_array return the rest as content.
- Whitespace before a parsed call, and whitespace ending the output after one, is dropped:
  models write newlines around and between calls, which SGLang strips. Other content is
  returned verbatim (text on both sides of a call is joined as written: "a <call> b" gives
  "a b").

Streaming holds back only what is undecided: trailing whitespace and a tail that could
still become `<tool_call>` (or `<|python_tag|>` at the start), and a call until it is
accepted. Argument text is released character by character as it arrives, since the
scanner knows where the value ends; nothing of the closing brackets or tag is withheld.
"""

from __future__ import annotations

from dataclasses import dataclass

from srt_lite.parser.tool_call_scanner import PYTHON_TAG, TOOL_CALL_END, TOOL_CALL_START, ToolCallScanner

__all__ = [
    "PYTHON_TAG",
    "SUPPORTED_FORMATS",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ToolCallDelta",
    "ToolCallItem",
    "ToolCallParser",
    "detect_tool_call_format",
]

SUPPORTED_FORMATS: tuple[str, ...] = ("hermes", "qwen25", "llama3", "json_array")
_ALIASES = {"qwen25": "hermes"}

# Llama 3.1/3.2 templates ask for JSON tool calls with this sentence.
_LLAMA3_JSON_INSTRUCTION = "respond with a JSON for a function call"


@dataclass
class ToolCallItem:
    """One complete call."""

    name: str
    arguments: str  # the arguments as JSON text, e.g. '{"city": "Paris"}'


@dataclass
class ToolCallDelta:
    """A streamed piece of one call."""

    index: int  # the call's position in this output: 0, 1, ...
    name: str | None  # set on (and only on) the first delta of each call
    arguments: str  # a fragment of the arguments JSON text ("" allowed on the first delta)


def detect_tool_call_format(chat_template: str | None) -> str | None:
    """Guesses the tool-call format from a chat template's source, or None if it shows none."""
    if not chat_template:
        return None
    if TOOL_CALL_START in chat_template:
        return "hermes"
    if any(s in chat_template for s in (PYTHON_TAG, "<|eom_id|>", _LLAMA3_JSON_INSTRUCTION)):
        return "llama3"
    return None


class ToolCallParser:
    """Splits one generated choice's output into content and tool calls, in one shot
    (parse_non_stream) or delta by delta (parse_stream_chunk, then flush). One instance per
    choice: the streaming methods keep state; parse_non_stream does not touch it."""

    def __init__(self, fmt: str, tool_names: set[str] | None = None) -> None:
        fmt = fmt.lower()
        if fmt not in SUPPORTED_FORMATS:
            supported = ", ".join(SUPPORTED_FORMATS)
            raise ValueError(f"unsupported tool-call format {fmt!r}; supported: {supported}")
        self.fmt = _ALIASES.get(fmt, fmt)
        self.tool_names = None if tool_names is None else frozenset(tool_names)
        self._scanner = ToolCallScanner(self.fmt, self.tool_names)

    def parse_non_stream(self, text: str) -> tuple[str, list[ToolCallItem]]:
        """(content, calls) for a full output."""
        scanner = ToolCallScanner(self.fmt, self.tool_names)
        scanner.feed(text)
        scanner.finish()
        content, pieces = scanner.take()
        calls: list[ToolCallItem] = []
        for index, name, arguments in pieces:
            if name is not None:
                calls.append(ToolCallItem(name, arguments))
            else:
                calls[index].arguments += arguments
        return content, calls

    def parse_stream_chunk(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content delta, call deltas) for the next piece of output; either may be empty.
        A call's pieces from one chunk come merged into one delta."""
        self._scanner.feed(text)
        return self._take()

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """End of the output: what was held back (a tag fragment that turned out to be text,
        an unaccepted call's text, the rest of a call cut off mid-way)."""
        self._scanner.finish()
        return self._take()

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content, pieces = self._scanner.take()
        deltas: list[ToolCallDelta] = []
        for index, name, arguments in pieces:
            if deltas and deltas[-1].index == index and name is None:
                deltas[-1].arguments += arguments
            else:
                deltas.append(ToolCallDelta(index, name, arguments))
        return content, deltas
