"""The incremental scanner behind ToolCallParser (tool_call_parser.py states the rules).

One scanner serves both parse paths: parse_non_stream feeds it the whole output at once,
streaming feeds it delta by delta. Every decision waits for the text that decides it, so
the results cannot depend on where the deltas were cut:

- It keeps all received text and a position in it (tool_call_values.py's Cursor). The
  format's framer (tool_call_framing.py) reads the text around calls and the CallLexer
  (tool_call_json.py) reads each call object; both are state machines with a handler per
  state that advances the position as far as the text allows and stops when it needs more.
- Text that is not decided yet is not released: trailing whitespace and a possible tag
  start in content, and a call until its name is known. A rejected call is re-read as
  content from where it started, which is why the text is kept (outputs are bounded by
  max_tokens).
- Inside a call, JSON is followed lexically (strings with their escapes, bracket depth),
  so the lexer knows exactly where the arguments value ends and can release each of its
  characters as it arrives. Full validation happens only for the rare call whose
  arguments come before its name, which is decoded with `json` once its object closes.
- `finish` tells the handlers that no more text will come, and resolves the state the
  output ended in (an unaccepted call is rejected, an accepted one is ended).
"""

from __future__ import annotations

from srt_lite.parser.tool_call_framing import FRAMERS, PYTHON_TAG, TOOL_CALL_END, TOOL_CALL_START
from srt_lite.parser.tool_call_json import CallLexer, Piece
from srt_lite.parser.tool_call_values import Cursor

__all__ = ["PYTHON_TAG", "TOOL_CALL_END", "TOOL_CALL_START", "Piece", "ToolCallScanner"]


class ToolCallScanner:
    """Scans one output for calls in format `fmt` ("hermes", "llama3" or "json_array").
    `feed` appends text and advances as far as it decides; `finish` ends the output; `take`
    returns the content and call pieces produced since the last take."""

    def __init__(self, fmt: str, tool_names: frozenset[str] | None) -> None:
        self.fmt = fmt
        self.tool_names = tool_names
        self.cursor = Cursor()
        self.lexer = CallLexer(self.cursor, tool_names)
        self.framer = FRAMERS[fmt](self.cursor, self.lexer)

    def feed(self, text: str) -> None:
        self.cursor.append(text)
        self.framer.run()

    def finish(self) -> None:
        self.cursor.final = True
        self.framer.run()

    def take(self) -> tuple[str, list[Piece]]:
        content, pieces = "".join(self.framer.content), self.lexer.pieces
        self.framer.content, self.lexer.pieces = [], []
        return content, pieces
