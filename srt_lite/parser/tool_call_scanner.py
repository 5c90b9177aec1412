"""The incremental scanner behind ToolCallParser (tool_call_parser.py states the rules).

One scanner serves both parse paths: parse_non_stream feeds it the whole output at once,
streaming feeds it delta by delta. Every decision waits for the text that decides it, so
the results cannot depend on where the deltas were cut:

- It keeps all received text and a position `pos`; a handler per state (`_st_<state>`)
  advances `pos` as far as the text allows and returns False when it needs more.
- Text that is not decided yet is not released: trailing whitespace and a possible tag
  start in content, and a call until its name is known. A rejected call is re-read as
  content from where it started, which is why the text is kept (outputs are bounded by
  max_tokens).
- Inside a call, JSON is followed lexically (strings with their escapes, bracket depth),
  so the scanner knows exactly where the arguments value ends and can release each of its
  characters as it arrives. Full validation happens only for the rare call whose
  arguments come before its name, which is decoded with `json` once its object closes.
- `finish` tells the handlers that no more text will come, and resolves the state the
  output ended in (an unaccepted call is rejected, an accepted one is ended).
"""

from __future__ import annotations

import json
import logging
import re

logger = logging.getLogger(__name__)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")

# A streamed piece of a call: (index, name on the first piece of each call else None, text).
Piece = tuple[int, "str | None", str]

_WS = re.compile(r"\s*")
_STRING_SPECIAL = re.compile(r'["\\]')
# Inside an object or array, outside strings: brackets, quotes, and anything JSON never has
# there (a "<" of a closing tag, a ";" separator), which ends the value as malformed.
_CONTAINER_SPECIAL = re.compile(r'[{}\[\]"]|[^\s\w,:.+\-]')
_SCALAR = re.compile(r"[\w.+\-]*")  # numbers, true/false/null (lexically)

# States outside calls.
_CONTENT = "content"  # hermes: plain text, looking for <tool_call>
_CLOSE_TAG = "close_tag"  # hermes: call object closed, expecting </tool_call>
_JUNK = "junk"  # hermes: dropping the rest of a broken call up to </tool_call>
_AFTER_CALL = "after_call"  # after </tool_call> (or json_array's "]"), holding whitespace
_START = "start"  # llama3/json_array: before the first call
_AFTER_PYTHON_TAG = "after_python_tag"  # llama3: expecting "{"
_ARRAY_FIRST = "array_first"  # json_array: after "[", expecting "{" or "]"
_NEXT = "next"  # llama3/json_array: after a call, expecting a separator (or "]")
_SEPARATOR = "separator"  # llama3/json_array: after a separator, expecting "{"
_PLAIN = "plain"  # llama3/json_array: the rest is content
_DONE = "done"
# States inside a call object.
_OBJECT_OPEN = "object_open"
_KEY_OR_END = "key_or_end"
_KEY = "key"
_COLON = "colon"
_VALUE = "value"
_NAME = "name"
_AFTER_VALUE = "after_value"
_CONTAINER = "container"  # an object or array value
_STRING = "string"  # a string value
_SCALAR_VALUE = "scalar"  # a number or literal value
_BUFFER = "buffer"  # arguments before the name: waiting for the object to close

_UNDECIDED_STATES = (_START, _AFTER_PYTHON_TAG, _ARRAY_FIRST, _SEPARATOR)

# Outcomes of scanning an object or array.
_MORE, _CLOSED, _BROKEN = "more", "closed", "broken"


def _partial_suffix(text: str, start: int, tag: str) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _arguments_from_string(literal: str) -> str:
    """Arguments written as a JSON string: its contents if they are a JSON object's text,
    else the literal as written."""
    try:
        inner = json.loads(literal)
        if isinstance(json.loads(inner), dict):
            return inner
    except ValueError:
        pass
    return literal


def _raw_members(obj_text: str) -> list[tuple[str, str]]:
    """(key, raw value text) of each member of a valid JSON object's text, in order."""
    decoder = json.JSONDecoder()
    members = []
    pos = _WS.match(obj_text, 1).end()
    while obj_text[pos] != "}":
        key, pos = decoder.raw_decode(obj_text, pos)
        pos = _WS.match(obj_text, _WS.match(obj_text, pos).end() + 1).end()  # past ":"
        _, end = decoder.raw_decode(obj_text, pos)
        members.append((key, obj_text[pos:end]))
        pos = _WS.match(obj_text, end).end()
        if obj_text[pos] == ",":
            pos = _WS.match(obj_text, pos + 1).end()
    return members


def _call_from_object(obj_text: str) -> tuple[str, str] | None:
    """(name, arguments) of a complete call object's text, or None if it is not a call.
    The first "name" and the first arguments member count, as when streaming."""
    try:
        if not isinstance(json.loads(obj_text), dict):
            return None
    except ValueError:
        return None
    members = _raw_members(obj_text)
    name = next((json.loads(v) for k, v in members if k == "name"), None)
    if not isinstance(name, str):
        return None
    raw = next((v for k, v in members if k in ARGUMENT_KEYS), "{}")
    return name, _arguments_from_string(raw) if raw.startswith('"') else raw


class ToolCallScanner:
    """Scans one output for calls in format `fmt` ("hermes", "llama3" or "json_array").
    `feed` appends text and advances as far as it decides; `finish` ends the output; `take`
    returns the content and call pieces produced since the last take."""

    def __init__(self, fmt: str, tool_names: frozenset[str] | None) -> None:
        self.fmt = fmt
        self.tool_names = tool_names
        self.text = ""
        self.pos = 0  # next character to scan
        self.final = False
        self.state = _CONTENT if fmt == "hermes" else _START
        self.content: list[str] = []
        self.pieces: list[Piece] = []
        self.n_calls = 0
        # Undecided text starts here: it becomes content if the call is rejected (hermes:
        # the whitespace before the tag; llama3/json_array: the separator, or 0).
        self.pending_start = 0
        self.after_tag = 0  # hermes: end of the current call's <tool_call>
        # The call object being scanned.
        self.in_call = False
        self.accepted = False
        self.object_start = 0
        self.key = ""
        self.args_started = False
        self.value_is_args = False  # the value being scanned is the arguments (else skipped)
        self.value_start = 0  # where the current value (or key/name string) starts
        self.released_to = 0  # argument text released up to here
        # Lexer state for objects/arrays and strings.
        self.depth = 0
        self.in_string = False
        self.escape = False

    # -- driving ---------------------------------------------------------------------

    def feed(self, text: str) -> None:
        self.text += text
        self._run()

    def finish(self) -> None:
        self.final = True
        self._run()

    def take(self) -> tuple[str, list[Piece]]:
        content, pieces = "".join(self.content), self.pieces
        self.content, self.pieces = [], []
        return content, pieces

    def _run(self) -> None:
        while getattr(self, "_st_" + self.state)() or (self.final and self._end_of_text()):
            pass

    def _end_of_text(self) -> bool:
        """The output ended where a handler waits for more: resolve. True to go on."""
        if self.state in _UNDECIDED_STATES or (self.in_call and not self.accepted):
            return self._reject("the output ended inside it")
        if self.in_call:
            logger.debug("output ended inside tool call %d", self.n_calls - 1)
            self._finish_call()
            self.state = _DONE
        return False

    # -- outputs and call boundaries -----------------------------------------------------

    def _emit_content(self, start: int, end: int) -> None:
        if end > start:
            self.content.append(self.text[start:end])

    def _emit_arguments(self, text: str) -> None:
        if text:
            self.pieces.append((self.n_calls - 1, None, text))

    def _begin_call(self) -> bool:
        self.in_call, self.accepted, self.args_started = True, False, False
        self.state = _OBJECT_OPEN
        return True

    def _accept(self, name: str) -> bool:
        """True if the call is accepted (and its name sent); False if the name is unknown."""
        if self.tool_names is not None and name not in self.tool_names:
            logger.warning("tool call to unknown function %r is kept as content", name)
            return False
        self.accepted = True
        self.pieces.append((self.n_calls, name, ""))
        self.n_calls += 1
        return True

    def _finish_call(self) -> None:
        if not self.args_started:
            self._emit_arguments("{}")
        elif self.state == _STRING and self.value_is_args:  # cut off inside a string: as written
            self._emit_arguments(self.text[self.value_start : self.pos])
        self.in_call = False

    def _reject(self, why: str) -> bool:
        """The call being scanned is no call: its text is content."""
        logger.debug("not a tool call (%s)", why)
        self.in_call = False
        if self.fmt == "hermes":
            self._emit_content(self.pending_start, self.after_tag)
            self.pos, self.state = self.after_tag, _CONTENT
        else:
            self.pos, self.state = self.pending_start, _PLAIN
        return True

    def _broken(self, why: str) -> bool:
        """Malformed call text at self.pos."""
        if not self.accepted:
            return self._reject(why)
        logger.warning("tool call %d is malformed (%s); keeping what it sent", self.n_calls - 1, why)
        self._finish_call()
        self.state = _JUNK if self.fmt == "hermes" else _PLAIN
        return True

    def _object_closed(self) -> bool:
        if not self.accepted:
            return self._reject("no name")
        self._finish_call()
        self.state = _CLOSE_TAG if self.fmt == "hermes" else _NEXT
        return True

    # -- lexing ------------------------------------------------------------------------

    def _skip_ws(self) -> bool:
        """Advances past whitespace; False if the text ran out."""
        self.pos = _WS.match(self.text, self.pos).end()
        return self.pos < len(self.text)

    def _hold_ws(self) -> bool:
        """Like _skip_ws, but leaves pos before the whitespace: the caller decides later
        whether it is content (text follows) or dropped (the output ends)."""
        start = self.pos
        more = self._skip_ws()
        self.pos = start
        return more

    def _at_tag_prefix(self, tag: str) -> bool:
        """The rest of the text is a proper prefix of tag, and more text may come."""
        rest = self.text[self.pos :]
        return not self.final and len(rest) < len(tag) and tag.startswith(rest)

    def _open_string(self) -> None:
        self.value_start = self.pos
        self.pos += 1
        self.escape = False

    def _scan_string(self) -> bool:
        """Advances through a string's body; True once past its closing quote."""
        text, pos = self.text, self.pos
        while True:
            if self.escape:
                if pos >= len(text):
                    break
                pos, self.escape = pos + 1, False
            m = _STRING_SPECIAL.search(text, pos)
            if m is None:
                pos = len(text)
                break
            pos = m.end()
            if m.group() == '"':
                self.pos = pos
                return True
            self.escape = True
        self.pos = pos
        return False

    def _scan_container(self) -> str:
        """Advances through an object or array by its strings and brackets (no further
        validation): _CLOSED past its last bracket, _MORE at the end of the text, or
        _BROKEN at a character that cannot stand outside a JSON string."""
        text = self.text
        while True:
            if self.in_string:
                if not self._scan_string():
                    return _MORE
                self.in_string = False
            m = _CONTAINER_SPECIAL.search(text, self.pos)
            if m is None:
                self.pos = len(text)
                return _MORE
            c, self.pos = m.group(), m.start()
            if c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos += 1
                    return _CLOSED
            elif c == '"':
                self.in_string, self.escape = True, False
            else:
                return _BROKEN
            self.pos += 1

    def _release_arguments(self) -> None:
        if self.value_is_args:
            self._emit_arguments(self.text[self.released_to : self.pos])
            self.released_to = self.pos

    # -- outside calls -------------------------------------------------------------------

    def _st_content(self) -> bool:
        text, pos = self.text, self.pos
        tag = text.find(TOOL_CALL_START, pos)
        if tag < 0:
            end = len(text)
            if not self.final:  # hold a possible tag start, and whitespace that may precede one
                end = pos + len(text[pos : end - _partial_suffix(text, pos, TOOL_CALL_START)].rstrip())
            self._emit_content(pos, end)
            self.pos = end
            return False
        start = pos + len(text[pos:tag].rstrip())
        self._emit_content(pos, start)
        self.pending_start = start
        self.pos = self.after_tag = tag + len(TOOL_CALL_START)
        return self._begin_call()

    def _st_close_tag(self) -> bool:
        if not self._skip_ws():
            return False
        if self.text.startswith(TOOL_CALL_END, self.pos):
            self.pos += len(TOOL_CALL_END)
            self.state = _AFTER_CALL
            return True
        if self._at_tag_prefix(TOOL_CALL_END):
            return False
        logger.warning("dropping text after tool call %d before its %s", self.n_calls - 1, TOOL_CALL_END)
        self.state = _JUNK
        return True

    def _st_junk(self) -> bool:
        end = self.text.find(TOOL_CALL_END, self.pos)
        if end >= 0:
            self.pos = end + len(TOOL_CALL_END)
            self.state = _AFTER_CALL
            return True
        self.pos = len(self.text) - (0 if self.final else _partial_suffix(self.text, self.pos, TOOL_CALL_END))
        return False

    def _st_after_call(self) -> bool:
        # Whitespace here is content if text follows, and dropped if the output ends (or if
        # another call starts: the content state drops whitespace before a tag).
        if not self._hold_ws():
            return False
        self.state = _CONTENT if self.fmt == "hermes" else _PLAIN
        return True

    def _st_start(self) -> bool:
        if not self._skip_ws():
            return False
        c = self.text[self.pos]
        if self.fmt == "json_array":
            if c != "[":
                return self._reject("not a JSON array")
            self.pos += 1
            self.state = _ARRAY_FIRST
            return True
        if c == "{":
            return self._begin_call()
        if self.text.startswith(PYTHON_TAG, self.pos):
            self.pos += len(PYTHON_TAG)
            self.state = _AFTER_PYTHON_TAG
            return True
        return False if self._at_tag_prefix(PYTHON_TAG) else self._reject("plain text")

    def _st_after_python_tag(self) -> bool:
        if not self._skip_ws():
            return False
        return self._begin_call() if self.text[self.pos] == "{" else self._reject("no JSON after the tag")

    def _st_array_first(self) -> bool:
        if not self._skip_ws():
            return False
        if self.text[self.pos] == "]":
            self.pos += 1
            self.state = _AFTER_CALL
            return True
        return self._begin_call() if self.text[self.pos] == "{" else self._reject("array of non-objects")

    def _st_next(self) -> bool:
        if not self._hold_ws():
            return False
        start = self.pos
        self._skip_ws()
        c = self.text[self.pos]
        if c == (";" if self.fmt == "llama3" else ","):
            self.pending_start = self.pos
            self.pos += 1
            self.state = _SEPARATOR
        elif c == "]" and self.fmt == "json_array":
            self.pos += 1
            self.state = _AFTER_CALL
        else:  # text after the calls, with the whitespace before it
            self.pos, self.state = start, _PLAIN
        return True

    def _st_separator(self) -> bool:
        if not self._skip_ws():
            return False
        return self._begin_call() if self.text[self.pos] == "{" else self._reject("no object after a separator")

    def _st_plain(self) -> bool:
        self._emit_content(self.pos, len(self.text))
        self.pos = len(self.text)
        return False

    def _st_done(self) -> bool:
        return False

    # -- inside a call object ------------------------------------------------------------

    def _st_object_open(self) -> bool:
        if not self._skip_ws():
            return False
        if self.text[self.pos] != "{":
            return self._broken("no JSON object")
        self.object_start = self.pos
        self.pos += 1
        self.state = _KEY_OR_END
        return True

    def _st_key_or_end(self) -> bool:
        if not self._skip_ws():
            return False
        c = self.text[self.pos]
        if c == '"':
            self._open_string()
            self.state = _KEY
            return True
        if c == "}":
            self.pos += 1
            return self._object_closed()
        return self._broken("expected a key")

    def _st_key(self) -> bool:
        if not self._scan_string():
            return False
        try:
            self.key = json.loads(self.text[self.value_start : self.pos])
        except ValueError:
            return self._broken("bad key string")
        self.state = _COLON
        return True

    def _st_colon(self) -> bool:
        if not self._skip_ws():
            return False
        if self.text[self.pos] != ":":
            return self._broken("expected ':'")
        self.pos += 1
        self.state = _VALUE
        return True

    def _st_value(self) -> bool:
        if not self._skip_ws():
            return False
        c = self.text[self.pos]
        if self.key == "name" and not self.accepted:
            if c != '"':
                return self._broken("the name is not a string")
            self._open_string()
            self.state = _NAME
            return True
        self.value_is_args = self.key in ARGUMENT_KEYS and not self.args_started
        if self.value_is_args and not self.accepted:
            # Arguments before the name: the call is known only once its object closes.
            self.depth, self.in_string = 1, False
            self.state = _BUFFER
            return True
        self.value_start = self.released_to = self.pos
        if c in "{[":
            self.depth, self.in_string = 0, False
            self.state = _CONTAINER
        elif c == '"':
            self._open_string()
            self.state = _STRING
        elif _SCALAR.match(self.text, self.pos).end() > self.pos:
            self.state = _SCALAR_VALUE
        else:
            return self._broken("expected a value")
        self.args_started = self.args_started or self.value_is_args
        return True

    def _st_name(self) -> bool:
        if not self._scan_string():
            return False
        try:
            name = json.loads(self.text[self.value_start : self.pos])
        except ValueError:
            return self._broken("bad name string")
        if not self._accept(name):
            return self._reject("unknown function")
        self.state = _AFTER_VALUE
        return True

    def _st_after_value(self) -> bool:
        if not self._skip_ws():
            return False
        c = self.text[self.pos]
        if c == ",":
            self.pos += 1
            self.state = _KEY_OR_END  # a trailing comma before "}" is forgiven
            return True
        if c == "}":
            self.pos += 1
            return self._object_closed()
        return self._broken("expected ',' or '}'")

    def _st_container(self) -> bool:
        outcome = self._scan_container()
        self._release_arguments()
        if outcome == _MORE:
            return False
        if outcome == _BROKEN:
            return self._broken("bad character in a value")
        self.state = _AFTER_VALUE
        return True

    def _st_string(self) -> bool:
        # Held until it closes: whether it holds an object decides what the arguments are.
        if not self._scan_string():
            return False
        if self.value_is_args:
            self._emit_arguments(_arguments_from_string(self.text[self.value_start : self.pos]))
        self.state = _AFTER_VALUE
        return True

    def _st_scalar(self) -> bool:
        self.pos = _SCALAR.match(self.text, self.pos).end()
        self._release_arguments()
        if self.pos == len(self.text) and not self.final:
            return False
        self.state = _AFTER_VALUE
        return True

    def _st_buffer(self) -> bool:
        outcome = self._scan_container()
        if outcome == _MORE:
            return False
        if outcome == _BROKEN:
            return self._reject("bad character")
        call = _call_from_object(self.text[self.object_start : self.pos])
        if call is None:
            return self._reject("not a call object")
        name, arguments = call
        if not self._accept(name):
            return self._reject("unknown function")
        self.args_started = True
        self._emit_arguments(arguments)
        return self._object_closed()
