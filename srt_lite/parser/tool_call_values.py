"""JSON values as the tool-call lexer reads them: lexically while they stream, decoded whole
only where the rules need the decoded value.

`Cursor` holds the output received so far; `ValueLexer` advances it through a string or an
object/array by quotes, escapes and brackets alone, so it can stop anywhere in the text and go
on when more arrives. It does not validate: a container is followed by its brackets and
strings, and ends early only at a character JSON never has outside a string.
"""

from __future__ import annotations

import enum
import json
import re

ARGUMENT_KEYS = ("arguments", "parameters")

_WS = re.compile(r"\s*")
SCALAR = re.compile(r"[\w.+\-]*")  # numbers, true/false/null (lexically)
_STRING_SPECIAL = re.compile(r'["\\]')
# Inside an object or array, outside strings: brackets, quotes, and anything JSON never has
# there (a "<" of a closing tag, a ";" separator), which ends the value as malformed.
_CONTAINER_SPECIAL = re.compile(r'[{}\[\]"]|[^\s\w,:.+\-]')


class Cursor:
    """The output received so far and the next position to scan, shared by the framer and
    the lexers. All of it is kept: a rejected call is re-read as content from where it
    started (outputs are bounded by max_tokens)."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.final = False  # no more text will come

    def append(self, text: str) -> None:
        # CPython extends a string in place when nothing else refers to it; `self.text +=
        # text` holds the attribute's reference during the add, so it would copy the whole
        # output on every delta.
        received, self.text = self.text, ""
        received += text
        self.text = received

    def skip_ws(self) -> bool:
        """Advances past whitespace; False if the text ran out."""
        self.pos = _WS.match(self.text, self.pos).end()
        return self.pos < len(self.text)

    def hold_ws(self) -> bool:
        """Like skip_ws, but leaves pos before the whitespace: the caller decides later
        whether it is content (text follows) or dropped (the output ends)."""
        start = self.pos
        more = self.skip_ws()
        self.pos = start
        return more


class StateEnum(enum.Enum):
    """Base of the states that key the lexer's and framers' dispatch tables. Enum hashes a
    member by its name in Python code, a cost paid on every handler lookup, i.e. several
    times per streamed delta; members are singletons, so identity hashing gives the same table."""

    __hash__ = object.__hash__


class ValueLexer:
    """Follows one string, object or array value through `cursor`, across feeds."""

    def __init__(self, cursor: Cursor) -> None:
        self.cursor = cursor
        self.depth = 0  # open brackets
        self.in_string = False  # in a string inside a container
        self.escape = False  # after a backslash in a string
        self.broken = False  # the container scan stopped at a character JSON cannot have there

    def open_string(self) -> None:
        """Steps past a string's opening quote at the cursor."""
        self.cursor.pos += 1
        self.escape = False

    def open_container(self, depth: int) -> None:
        """A container scan starts at the cursor, `depth` brackets deep already."""
        self.depth, self.in_string, self.broken = depth, False, False

    def scan_string(self) -> bool:
        """Advances through a string's body; True once past its closing quote."""
        cur = self.cursor
        text, pos = cur.text, cur.pos
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
                cur.pos = pos
                return True
            self.escape = True
        cur.pos = pos
        return False

    def scan_container(self) -> bool:
        """Advances through an object or array; True once past its last bracket. False when
        it stopped at the end of the text, or at a character that cannot stand outside a
        JSON string (then `broken` is set and the cursor is on that character)."""
        cur = self.cursor
        text = cur.text
        while True:
            if self.in_string:
                if not self.scan_string():
                    return False
                self.in_string = False
            m = _CONTAINER_SPECIAL.search(text, cur.pos)
            if m is None:
                cur.pos = len(text)
                return False
            c, cur.pos = m.group(), m.start()
            if c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    cur.pos += 1
                    return True
            elif c == '"':
                self.in_string, self.escape = True, False
            else:
                self.broken = True
                return False
            cur.pos += 1


def arguments_from_string(literal: str) -> str:
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


def call_from_object(obj_text: str) -> tuple[str, str] | None:
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
    return name, arguments_from_string(raw) if raw.startswith('"') else raw
