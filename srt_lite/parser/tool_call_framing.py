"""What lies around and between tool-call objects: one framer per format.

A framer reads the output outside calls. It releases content, finds where a call object
starts and hands the object to the CallLexer (tool_call_json.py), and decides what follows
an ended call. Before handing over it notes where the undecided text began
(`pending_start`), since a call the lexer rejects is re-read as content from there:

- hermes: from the whitespace before `<tool_call>` up to the tag's end; scanning goes on
  right after the tag.
- llama3 / json_array: everything from the rejected call's separator (or from the start of
  the output, for the first call) is content.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

from srt_lite.parser.tool_call_json import CallEnd, CallLexer
from srt_lite.parser.tool_call_values import Cursor, StateEnum

logger = logging.getLogger(__name__)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class Frame(StateEnum):
    """Where a framer is: in a call object (the lexer's part), or around one."""

    CALL = enum.auto()
    CONTENT = enum.auto()  # hermes: plain text, looking for <tool_call>
    CLOSE_TAG = enum.auto()  # hermes: call object closed, expecting </tool_call>
    JUNK = enum.auto()  # hermes: dropping the rest of a broken call up to </tool_call>
    AFTER_CALL = enum.auto()  # after </tool_call> (or json_array's "]"), holding whitespace
    START = enum.auto()  # llama3/json_array: before the first call
    AFTER_PYTHON_TAG = enum.auto()  # llama3: expecting "{"
    ARRAY_FIRST = enum.auto()  # json_array: after "[", expecting "{" or "]"
    NEXT = enum.auto()  # llama3/json_array: after a call, expecting a separator (or "]")
    SEPARATOR = enum.auto()  # llama3/json_array: after a separator, expecting "{"
    PLAIN = enum.auto()  # llama3/json_array: the rest is content
    DONE = enum.auto()


def _partial_suffix(text: str, start: int, tag: str) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Framer:
    """Drives one output's states and hands call objects to the lexer; `content` collects
    the content released. Subclasses name their states and add their handlers: a handler
    advances the cursor and returns True to go on in the new state, False when it needs
    more text."""

    first: Frame  # the state the output starts in
    outside: Frame  # the state that reads text after the calls as content
    after_object: Frame  # after an accepted call's object closed
    after_broken: Frame  # after an accepted call went malformed
    # States in which the end of the output leaves what was read so far no call.
    undecided: frozenset[Frame] = frozenset()

    def __init__(self, cursor: Cursor, lexer: CallLexer) -> None:
        self.cursor = cursor
        self.lexer = lexer
        self.content: list[str] = []
        self.state = self.first
        self.pending_start = 0  # undecided text starts here
        self._handlers: dict[Frame, Callable[[], bool]] = {
            Frame.CALL: self._call,
            Frame.AFTER_CALL: self._after_call,
            Frame.DONE: self._done,
        }

    def run(self) -> None:
        """Advances as far as the text allows, and at its end resolves the state."""
        handlers, cur = self._handlers, self.cursor
        while handlers[self.state]() or (cur.final and self._end_of_text()):
            pass

    def _end_of_text(self) -> bool:
        """The output ended where a handler waits for more: resolve. True to go on."""
        if self.state is Frame.CALL and self.lexer.end_of_text():
            self.state = Frame.DONE
            return False
        if self.state is Frame.CALL or self.state in self.undecided:
            return self._reject("the output ended inside it")
        return False

    def _emit(self, start: int, end: int) -> None:
        if end > start:
            self.content.append(self.cursor.text[start:end])

    def _at_tag_prefix(self, tag: str) -> bool:
        """The rest of the text is a proper prefix of tag, and more text may come."""
        cur = self.cursor
        rest = cur.text[cur.pos :]
        return not cur.final and len(rest) < len(tag) and tag.startswith(rest)

    def _begin_call(self) -> bool:
        self.lexer.begin()
        self.state = Frame.CALL
        return True

    def _reject(self, why: str) -> bool:
        """What was read as a possible call is no call: its text is content."""
        logger.debug("not a tool call (%s)", why)
        self._reread()
        return True

    def _reread(self) -> None:
        """Moves back to re-read a rejected call's text as content; the format says from where."""
        raise NotImplementedError

    def _call(self) -> bool:
        end = self.lexer.run()
        if end is None:
            return False
        if end is CallEnd.REJECTED:  # the lexer logged why
            self._reread()
        else:
            self.state = self.after_object if end is CallEnd.CLOSED else self.after_broken
        return True

    def _after_call(self) -> bool:
        # Whitespace here is content if text follows, and dropped if the output ends (or, in
        # hermes, if another call starts: content drops whitespace before a tag).
        if not self.cursor.hold_ws():
            return False
        self.state = self.outside
        return True

    def _done(self) -> bool:
        return False


class HermesFramer(Framer):
    """Calls inside `<tool_call>...</tool_call>`, anywhere in the output; text outside the
    tags is content."""

    first = outside = Frame.CONTENT
    after_object = Frame.CLOSE_TAG
    after_broken = Frame.JUNK

    def __init__(self, cursor: Cursor, lexer: CallLexer) -> None:
        super().__init__(cursor, lexer)
        self.after_tag = 0  # end of the current call's <tool_call>
        self._handlers.update(
            {Frame.CONTENT: self._content, Frame.CLOSE_TAG: self._close_tag, Frame.JUNK: self._junk}
        )

    def _reread(self) -> None:
        self._emit(self.pending_start, self.after_tag)
        self.cursor.pos, self.state = self.after_tag, Frame.CONTENT

    def _content(self) -> bool:
        cur = self.cursor
        text, pos = cur.text, cur.pos
        tag = text.find(TOOL_CALL_START, pos)
        if tag < 0:
            end = len(text)
            if not cur.final:  # hold a possible tag start, and whitespace that may precede one
                end = pos + len(text[pos : end - _partial_suffix(text, pos, TOOL_CALL_START)].rstrip())
            self._emit(pos, end)
            cur.pos = end
            return False
        start = pos + len(text[pos:tag].rstrip())
        self._emit(pos, start)
        self.pending_start = start
        cur.pos = self.after_tag = tag + len(TOOL_CALL_START)
        return self._begin_call()

    def _close_tag(self) -> bool:
        cur = self.cursor
        if not cur.skip_ws():
            return False
        if cur.text.startswith(TOOL_CALL_END, cur.pos):
            cur.pos += len(TOOL_CALL_END)
            self.state = Frame.AFTER_CALL
            return True
        if self._at_tag_prefix(TOOL_CALL_END):
            return False
        logger.warning("dropping text after tool call %d before its %s", self.lexer.n_calls - 1, TOOL_CALL_END)
        self.state = Frame.JUNK
        return True

    def _junk(self) -> bool:
        cur = self.cursor
        end = cur.text.find(TOOL_CALL_END, cur.pos)
        if end >= 0:
            cur.pos = end + len(TOOL_CALL_END)
            self.state = Frame.AFTER_CALL
            return True
        cur.pos = len(cur.text) - (0 if cur.final else _partial_suffix(cur.text, cur.pos, TOOL_CALL_END))
        return False


class _SeparatedFramer(Framer):
    """Calls from the start of the output, one after another with a separator between
    them; from the first thing that does not fit, the rest is content."""

    first = Frame.START
    outside = after_broken = Frame.PLAIN
    after_object = Frame.NEXT
    separator: str
    closer: str | None = None  # ends the calls, if the format has an end

    def __init__(self, cursor: Cursor, lexer: CallLexer) -> None:
        super().__init__(cursor, lexer)
        self._handlers.update({Frame.NEXT: self._next, Frame.SEPARATOR: self._separator, Frame.PLAIN: self._plain})

    def _reread(self) -> None:
        self.cursor.pos, self.state = self.pending_start, Frame.PLAIN

    def _expect_object(self, why: str) -> bool:
        """A call object must start here (after whitespace), else `why` rejects."""
        cur = self.cursor
        if not cur.skip_ws():
            return False
        return self._begin_call() if cur.text[cur.pos] == "{" else self._reject(why)

    def _next(self) -> bool:
        cur = self.cursor
        if not cur.hold_ws():
            return False
        start = cur.pos
        cur.skip_ws()
        c = cur.text[cur.pos]
        if c == self.separator:
            self.pending_start = cur.pos
            cur.pos += 1
            self.state = Frame.SEPARATOR
        elif c == self.closer:
            cur.pos += 1
            self.state = Frame.AFTER_CALL
        else:  # text after the calls, with the whitespace before it
            cur.pos, self.state = start, Frame.PLAIN
        return True

    def _separator(self) -> bool:
        return self._expect_object("no object after a separator")

    def _plain(self) -> bool:
        cur = self.cursor
        self._emit(cur.pos, len(cur.text))
        cur.pos = len(cur.text)
        return False


class Llama3Framer(_SeparatedFramer):
    """After optional whitespace and an optional `<|python_tag|>`, call objects separated
    by ";"."""

    separator = ";"
    undecided = frozenset({Frame.START, Frame.AFTER_PYTHON_TAG, Frame.SEPARATOR})

    def __init__(self, cursor: Cursor, lexer: CallLexer) -> None:
        super().__init__(cursor, lexer)
        self._handlers.update({Frame.START: self._start, Frame.AFTER_PYTHON_TAG: self._after_python_tag})

    def _start(self) -> bool:
        cur = self.cursor
        if not cur.skip_ws():
            return False
        if cur.text[cur.pos] == "{":
            return self._begin_call()
        if cur.text.startswith(PYTHON_TAG, cur.pos):
            cur.pos += len(PYTHON_TAG)
            self.state = Frame.AFTER_PYTHON_TAG
            return True
        return False if self._at_tag_prefix(PYTHON_TAG) else self._reject("plain text")

    def _after_python_tag(self) -> bool:
        return self._expect_object("no JSON after the tag")


class JsonArrayFramer(_SeparatedFramer):
    """One JSON array of call objects."""

    separator = ","
    closer = "]"
    undecided = frozenset({Frame.START, Frame.ARRAY_FIRST, Frame.SEPARATOR})

    def __init__(self, cursor: Cursor, lexer: CallLexer) -> None:
        super().__init__(cursor, lexer)
        self._handlers.update({Frame.START: self._start, Frame.ARRAY_FIRST: self._array_first})

    def _start(self) -> bool:
        cur = self.cursor
        if not cur.skip_ws():
            return False
        if cur.text[cur.pos] != "[":
            return self._reject("not a JSON array")
        cur.pos += 1
        self.state = Frame.ARRAY_FIRST
        return True

    def _array_first(self) -> bool:
        cur = self.cursor
        if not cur.skip_ws():
            return False
        if cur.text[cur.pos] == "]":
            cur.pos += 1
            self.state = Frame.AFTER_CALL
            return True
        return self._expect_object("array of non-objects")


FRAMERS: dict[str, type[Framer]] = {"hermes": HermesFramer, "llama3": Llama3Framer, "json_array": JsonArrayFramer}
