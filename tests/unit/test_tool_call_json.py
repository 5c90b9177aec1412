"""The call-object lexer on its own: where it stops, what it releases and when, and how a
call ends, without any format's framing around it."""

from __future__ import annotations

from srt_lite.parser.tool_call_json import CallEnd, CallLexer, Piece
from srt_lite.parser.tool_call_values import Cursor

NAMES = frozenset({"f"})


def lex(chunks: list[str], final: bool = False) -> tuple[list[CallEnd | None], list[Piece], Cursor]:
    """Feeds chunks to one lexer: what `run` said after each chunk (until the call ended),
    the pieces, and the cursor."""
    cursor = Cursor()
    lexer = CallLexer(cursor, NAMES)
    lexer.begin()
    ends: list[CallEnd | None] = []
    for chunk in chunks:
        cursor.append(chunk)
        ends.append(lexer.run())
        if ends[-1] is not None:
            break
    if final and ends[-1] is None:
        cursor.final = True
        assert lexer.end_of_text()
    return ends, lexer.pieces, cursor


def test_stops_right_after_the_object() -> None:
    obj = '{"name": "f", "arguments": {"a": [1, "}]"]}, "x": {"y": "{"}}'
    ends, pieces, cursor = lex([f"  {obj}</tool_call> more"])
    assert ends == [CallEnd.CLOSED]
    assert cursor.pos == len(obj) + 2  # the closing tag is left to the framer
    assert pieces == [(0, "f", ""), (0, None, '{"a": [1, "}]"]}')]


def test_arguments_are_released_as_they_arrive() -> None:
    head, args = '{"name": "f", "arguments": ', '{"q": "a \\"b\\" c", "n": [1, 2]}'
    ends, pieces, _ = lex(list(head + args) + ["}"])
    assert ends == [None] * len(head + args) + [CallEnd.CLOSED]
    assert pieces[0] == (0, "f", "")
    # One piece per character of the value, each as soon as its character came.
    assert [text for _, _, text in pieces[1:]] == list(args)


def test_name_decides_acceptance() -> None:
    assert lex(['{"name": "f"'])[:2] == ([None], [(0, "f", "")])
    assert lex(['{"name": "g"'])[:2] == ([CallEnd.REJECTED], [])
    assert lex(['{"name": 7}'])[:2] == ([CallEnd.REJECTED], [])
    assert lex(["[1]"])[:2] == ([CallEnd.REJECTED], [])


def test_arguments_before_the_name_wait_for_the_object() -> None:
    assert lex(['{"arguments": {"a": 1}, ', '"name": "f"'])[:2] == ([None, None], [])
    ends, pieces, _ = lex(['{"arguments": {"a": 1}, ', '"name": "f"', "}"])
    assert ends == [None, None, CallEnd.CLOSED]
    assert pieces == [(0, "f", ""), (0, None, '{"a": 1}')]  # both at once, when it closed
    assert lex(['{"arguments": {"a": 1}, "name": "g"}'])[:2] == ([CallEnd.REJECTED], [])


def test_accepted_call_keeps_what_it_sent() -> None:
    ends, pieces, _ = lex(['{"name": "f", "arguments": {"a": 1} <'])
    assert ends == [CallEnd.BROKEN]
    assert pieces == [(0, "f", ""), (0, None, '{"a": 1}')]
    # Ended by the output inside a string argument: the literal as written.
    assert lex(['{"name": "f", "arguments": "{\\"a'], final=True)[1] == [(0, "f", ""), (0, None, '"{\\"a')]
    # Ended before any arguments: an empty object.
    assert lex(['{"name": "f", '], final=True)[1] == [(0, "f", ""), (0, None, "{}")]
