"""Follows one tool call's JSON object, `{"name": ..., "arguments": {...}}`, as its text arrives.

The framers (tool_call_framing.py) find where a call object starts; from there `CallLexer`
reads it lexically, with no full JSON parse: keys, strings with their escapes, bracket depth
(the values' part is tool_call_values.py's ValueLexer). That is enough to know exactly where
the arguments value ends, so each of its characters is released as it arrives. The call is
accepted the moment its "name" string closes (and names a known tool). Full validation
happens only for the rare call whose arguments come before its name, which is decoded with
`json` once its object closes.

The lexer never reads past the call object's closing "}": what follows is the framer's.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable

from srt_lite.parser.tool_call_values import (
    ARGUMENT_KEYS,
    SCALAR,
    Cursor,
    StateEnum,
    ValueLexer,
    arguments_from_string,
    call_from_object,
)

logger = logging.getLogger(__name__)

# A streamed piece of a call: (index, name on the first piece of each call else None, text).
Piece = tuple[int, "str | None", str]


class Lex(StateEnum):
    """Where the lexer is inside a call object."""

    OBJECT_OPEN = enum.auto()  # expecting "{"
    KEY_OR_END = enum.auto()  # expecting a key or "}"
    KEY = enum.auto()  # in a key string
    COLON = enum.auto()
    VALUE = enum.auto()  # expecting a member's value
    NAME = enum.auto()  # in the "name" string
    AFTER_VALUE = enum.auto()  # expecting "," or "}"
    CONTAINER = enum.auto()  # in an object or array value
    STRING = enum.auto()  # in a string value
    SCALAR = enum.auto()  # in a number or literal value
    BUFFER = enum.auto()  # arguments before the name: waiting for the object to close


class CallEnd(enum.Enum):
    """How the scan of a call ended."""

    CLOSED = enum.auto()  # the accepted call's object closed
    BROKEN = enum.auto()  # the accepted call went malformed; it keeps what it sent
    REJECTED = enum.auto()  # not a call after all: its text is content


class CallLexer:
    """Reads call objects from `cursor`, one at a time: `begin` at an object's start, then
    `run` as text arrives until it returns how the call ended. Accepted calls go to
    `pieces`, numbered from 0 across the output.

    A handler per state advances the cursor and returns True to go on in the new state, or
    False to stop: the text ran out, or the call ended and `end` says how."""

    def __init__(self, cursor: Cursor, tool_names: frozenset[str] | None) -> None:
        self.cursor = cursor
        self.tool_names = tool_names
        self.pieces: list[Piece] = []
        self.n_calls = 0  # accepted so far
        self.state = Lex.OBJECT_OPEN
        self.end: CallEnd | None = None
        self.accepted = False
        self.object_start = 0
        self.key = ""
        self.args_started = False
        self.value_is_args = False  # the value being scanned is the arguments (else skipped)
        self.value_start = 0  # where the current value (or key/name string) starts
        self.released_to = 0  # argument text released up to here
        self.values = ValueLexer(cursor)
        self._handlers: dict[Lex, Callable[[], bool]] = {
            Lex.OBJECT_OPEN: self._object_open,
            Lex.KEY_OR_END: self._key_or_end,
            Lex.KEY: self._key,
            Lex.COLON: self._colon,
            Lex.VALUE: self._value,
            Lex.NAME: self._name,
            Lex.AFTER_VALUE: self._after_value,
            Lex.CONTAINER: self._container,
            Lex.STRING: self._string,
            Lex.SCALAR: self._scalar,
            Lex.BUFFER: self._buffer,
        }

    def begin(self) -> None:
        """A call object is expected at the cursor, after optional whitespace."""
        self.state = Lex.OBJECT_OPEN
        self.accepted = self.args_started = False

    def run(self) -> CallEnd | None:
        """Advances as far as the text allows: None while the call needs more text, else how
        it ended (CLOSED and BROKEN only for an accepted call)."""
        handlers = self._handlers
        while handlers[self.state]():
            pass
        end, self.end = self.end, None
        return end

    def end_of_text(self) -> bool:
        """The output ended inside the call: True if it was accepted (it is ended now, keeping
        what it sent), False if it is no call."""
        if not self.accepted:
            return False
        logger.debug("output ended inside tool call %d", self.n_calls - 1)
        self._finish()
        return True

    # -- outputs and the call's end ----------------------------------------------------

    def _emit(self, text: str) -> None:
        if text:
            self.pieces.append((self.n_calls - 1, None, text))

    def _accept(self, name: str) -> bool:
        """True if the call is accepted (and its name sent); False if the name is unknown."""
        if self.tool_names is not None and name not in self.tool_names:
            logger.warning("tool call to unknown function %r is kept as content", name)
            return False
        self.accepted = True
        self.pieces.append((self.n_calls, name, ""))
        self.n_calls += 1
        return True

    def _finish(self) -> None:
        if not self.args_started:
            self._emit("{}")
        elif self.state is Lex.STRING and self.value_is_args:  # cut off inside a string: as written
            self._emit(self.cursor.text[self.value_start : self.cursor.pos])

    def _end(self, end: CallEnd) -> bool:
        self.end = end
        return False

    def _reject(self, why: str) -> bool:
        logger.debug("not a tool call (%s)", why)
        return self._end(CallEnd.REJECTED)

    def _broken(self, why: str) -> bool:
        """Malformed call text at the cursor."""
        if not self.accepted:
            return self._reject(why)
        logger.warning("tool call %d is malformed (%s); keeping what it sent", self.n_calls - 1, why)
        self._finish()
        return self._end(CallEnd.BROKEN)

    def _closed(self) -> bool:
        if not self.accepted:
            return self._reject("no name")
        self._finish()
        return self._end(CallEnd.CLOSED)

    def _open_string(self) -> None:
        self.value_start = self.cursor.pos
        self.values.open_string()

    def _release_arguments(self) -> None:
        if self.value_is_args:
            self._emit(self.cursor.text[self.released_to : self.cursor.pos])
            self.released_to = self.cursor.pos

    # -- the object's members ----------------------------------------------------------

    def _object_open(self) -> bool:
        cur = self.cursor
        if not cur.skip_ws():
            return False
        if cur.text[cur.pos] != "{":
            return self._broken("no JSON object")
        self.object_start = cur.pos
        cur.pos += 1
        self.state = Lex.KEY_OR_END
        return True

    def _key_or_end(self) -> bool:
        cur = self.cursor
        if not cur.skip_ws():
            return False
        c = cur.text[cur.pos]
        if c == '"':
            self._open_string()
            self.state = Lex.KEY
            return True
        if c == "}":
            cur.pos += 1
            return self._closed()
        return self._broken("expected a key")

    def _key(self) -> bool:
        if not self.values.scan_string():
            return False
        try:
            self.key = json.loads(self.cursor.text[self.value_start : self.cursor.pos])
        except ValueError:
            return self._broken("bad key string")
        self.state = Lex.COLON
        return True

    def _colon(self) -> bool:
        cur = self.cursor
        if not cur.skip_ws():
            return False
        if cur.text[cur.pos] != ":":
            return self._broken("expected ':'")
        cur.pos += 1
        self.state = Lex.VALUE
        return True

    def _value(self) -> bool:
        cur = self.cursor
        if not cur.skip_ws():
            return False
        c = cur.text[cur.pos]
        if self.key == "name" and not self.accepted:
            if c != '"':
                return self._broken("the name is not a string")
            self._open_string()
            self.state = Lex.NAME
            return True
        self.value_is_args = self.key in ARGUMENT_KEYS and not self.args_started
        if self.value_is_args and not self.accepted:
            # Arguments before the name: the call is known only once its object closes.
            self.values.open_container(1)
            self.state = Lex.BUFFER
            return True
        self.value_start = self.released_to = cur.pos
        if c in "{[":
            self.values.open_container(0)
            self.state = Lex.CONTAINER
        elif c == '"':
            self._open_string()
            self.state = Lex.STRING
        elif SCALAR.match(cur.text, cur.pos).end() > cur.pos:
            self.state = Lex.SCALAR
        else:
            return self._broken("expected a value")
        self.args_started = self.args_started or self.value_is_args
        return True

    def _name(self) -> bool:
        if not self.values.scan_string():
            return False
        try:
            name = json.loads(self.cursor.text[self.value_start : self.cursor.pos])
        except ValueError:
            return self._broken("bad name string")
        if not self._accept(name):
            return self._reject("unknown function")
        self.state = Lex.AFTER_VALUE
        return True

    def _after_value(self) -> bool:
        cur = self.cursor
        if not cur.skip_ws():
            return False
        c = cur.text[cur.pos]
        if c == ",":
            cur.pos += 1
            self.state = Lex.KEY_OR_END  # a trailing comma before "}" is forgiven
            return True
        if c == "}":
            cur.pos += 1
            return self._closed()
        return self._broken("expected ',' or '}'")

    # -- the values --------------------------------------------------------------------

    def _container(self) -> bool:
        closed = self.values.scan_container()
        self._release_arguments()
        if closed:
            self.state = Lex.AFTER_VALUE
            return True
        return self._broken("bad character in a value") if self.values.broken else False

    def _string(self) -> bool:
        # Held until it closes: whether it holds an object decides what the arguments are.
        if not self.values.scan_string():
            return False
        if self.value_is_args:
            self._emit(arguments_from_string(self.cursor.text[self.value_start : self.cursor.pos]))
        self.state = Lex.AFTER_VALUE
        return True

    def _scalar(self) -> bool:
        cur = self.cursor
        cur.pos = SCALAR.match(cur.text, cur.pos).end()
        self._release_arguments()
        if cur.pos == len(cur.text) and not cur.final:
            return False
        self.state = Lex.AFTER_VALUE
        return True

    def _buffer(self) -> bool:
        if not self.values.scan_container():
            return self._reject("bad character") if self.values.broken else False
        call = call_from_object(self.cursor.text[self.object_start : self.cursor.pos])
        if call is None:
            return self._reject("not a call object")
        name, arguments = call
        if not self._accept(name):
            return self._reject("unknown function")
        self.args_started = True
        self._emit(arguments)
        return self._closed()
