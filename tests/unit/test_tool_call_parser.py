"""Tool-call parser: one-shot results per format, and streaming deltas that concatenate exactly
to them for every way of chunking the output."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from srt_lite.parser.tool_call_parser import (
    PYTHON_TAG,
    SUPPORTED_FORMATS,
    TOOL_CALL_END,
    TOOL_CALL_START,
    ToolCallDelta,
    ToolCallItem,
    ToolCallParser,
    detect_tool_call_format,
)

TOOL_NAMES = {"get_weather", "get_time", "search"}
PARIS = '{"city": "Paris"}'
NESTED = '{"q": "a {b} [c]", "filters": [{"x": [1, 2.5e3, -3]}, {}], "deep": {"a": {"b": null}}, "ok": true}'
QUOTES = r'{"q": "say \"hi\" </tool_call> <tool_call> ; } ] \\"}'
UNICODE = r'{"q": "日本語 👍🏽 \u00e9"}'


def hermes(call: str) -> str:
    return f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}"


def weather(key: str = "arguments", args: str = PARIS) -> str:
    return f'{{"name": "get_weather", "{key}": {args}}}'


# (output, expected content, expected calls as (name, arguments)).
Case = tuple[str, str, list[tuple[str, str]]]

HERMES_CASES: list[Case] = [
    ("The weather is nice.", "The weather is nice.", []),
    ("", "", []),
    (" \n", " \n", []),
    (hermes(weather()), "", [("get_weather", PARIS)]),
    # Whitespace before a call and at the end after one is dropped.
    (
        "\n" + hermes(weather()) + "\n" + hermes('{"name": "get_time", "arguments": {}}') + "\n",
        "",
        [("get_weather", PARIS), ("get_time", "{}")],
    ),
    ("Let me check.\n\n" + hermes(weather()), "Let me check.", [("get_weather", PARIS)]),
    ("Checking." + hermes(weather()) + "\nDone.", "Checking.\nDone.", [("get_weather", PARIS)]),
    ("a <tool_call>" + weather() + "</tool_call> b", "a b", [("get_weather", PARIS)]),
    ("<tool_call>" + weather() + "</tool_call>", "", [("get_weather", PARIS)]),  # no whitespace in the tags
    (hermes(f'{{"name": "search", "arguments": {NESTED}}}'), "", [("search", NESTED)]),
    (hermes(f'{{"name": "search", "arguments": {QUOTES}}}'), "", [("search", QUOTES)]),
    (hermes(f'{{"name": "search", "arguments": {UNICODE}}}'), "", [("search", UNICODE)]),
    (hermes('{"name": "get_time", "arguments": {}}'), "", [("get_time", "{}")]),
    (hermes('{"name": "get_time"}'), "", [("get_time", "{}")]),  # no arguments member
    (hermes('{ "name" : "get_\\u0074ime" , "parameters" : [1] }'), "", [("get_time", "[1]")]),
    # Members before the name are skipped; after the arguments, ignored.
    (hermes('{"id": 7, "type": "function", "name": "get_time", "arguments": {}, "x": [{}]}'), "",
     [("get_time", "{}")]),
    # Arguments before the name: held until the object closes, then the same rules.
    (hermes('{"arguments": {"city": "Paris"}, "name": "get_weather"}'), "", [("get_weather", PARIS)]),
    (hermes('{"arguments": {"a": "</tool_call>"}, "name": "nope"}'),
     hermes('{"arguments": {"a": "</tool_call>"}, "name": "nope"}'), []),
    # Arguments written as a JSON string: decoded when they hold an object, else kept as written.
    (hermes(weather(args='"{\\"city\\": \\"Paris\\"}"')), "", [("get_weather", PARIS)]),
    (hermes(weather(args='"Paris"')), "", [("get_weather", '"Paris"')]),
    # Not calls: the text stays content, verbatim.
    (hermes('{"name": "nope", "arguments": {}}'), hermes('{"name": "nope", "arguments": {}}'), []),
    (hermes('{"name": get_weather}'), hermes('{"name": get_weather}'), []),
    (hermes("not json"), hermes("not json"), []),
    (hermes('{"nam": "get_time"}'), hermes('{"nam": "get_time"}'), []),
    (hermes('{"arguments": {}, "name": "get_time"'), hermes('{"arguments": {}, "name": "get_time"'), []),
    ("Use <tool_call> tags.", "Use <tool_call> tags.", []),
    ("x <tool_call>oops " + hermes('{"name": "get_time"}'), "x <tool_call>oops", [("get_time", "{}")]),
    ("Sure.\n<tool_call>\n{\"name\": \"get_wea", "Sure.\n<tool_call>\n{\"name\": \"get_wea", []),
    ("a <tool_ca", "a <tool_ca", []),
    ("a </tool_call>", "a </tool_call>", []),
    # Accepted calls are kept when they go wrong later, or when the output ends inside them.
    ("<tool_call>\n" + '{"name": "get_weather", "arguments": {"city": "Pa', "", [("get_weather", '{"city": "Pa')]),
    ("<tool_call>\n" + '{"name": "get_weather", "arguments": "{\\"ci', "",
     [("get_weather", '"{\\"ci')]),
    ("<tool_call>\n" + '{"name": "get_time", ', "", [("get_time", "{}")]),
    (hermes(weather()[:-1]), "", [("get_weather", PARIS)]),  # missing "}": the tag ends the call
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>', "",
     [("get_weather", '{"city": "Paris"')]),
    (hermes(weather() + " oops") + "after", "after", [("get_weather", PARIS)]),
    (hermes(weather(args='{"city": Paris}')), "", [("get_weather", '{"city": Paris}')]),  # not validated
    ("<tool_call>" + weather() + " and no closing tag", "", [("get_weather", PARIS)]),
    (hermes(weather()) + hermes('{"name": "nope"}'), hermes('{"name": "nope"}'), [("get_weather", PARIS)]),
]

LLAMA3_CASES: list[Case] = [
    ("The weather is nice.", "The weather is nice.", []),
    ("", "", []),
    (weather("parameters"), "", [("get_weather", PARIS)]),
    (PYTHON_TAG + weather(), "", [("get_weather", PARIS)]),
    (" \n" + PYTHON_TAG + " " + weather("parameters") + "\n", "", [("get_weather", PARIS)]),
    (
        weather("parameters") + '; {"name": "get_time", "parameters": {}};{"name": "search", "parameters": '
        + NESTED + "}",
        "",
        [("get_weather", PARIS), ("get_time", "{}"), ("search", NESTED)],
    ),
    ('{"name": "search", "parameters": ' + QUOTES + "}", "", [("search", QUOTES)]),
    ('{"name": "search", "parameters": ' + UNICODE + "}", "", [("search", UNICODE)]),
    ('{"type": "function", "name": "get_time", "parameters": {}}', "", [("get_time", "{}")]),
    ("Sure: " + weather(), "Sure: " + weather(), []),
    ('{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    ("{not json}", "{not json}", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}', "", [("get_weather", PARIS)]),
    ('{"name": "get_time", "parameters": {}} Done.', " Done.", [("get_time", "{}")]),
    ('{"name": "get_time", "parameters": {}}; {"name": "nope"}', '; {"name": "nope"}', [("get_time", "{}")]),
    ('{"name": "get_time", "parameters": {}};', ";", [("get_time", "{}")]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"} x}', "x}", [("get_weather", PARIS)]),
    ("<|python", "<|python", []),
    (PYTHON_TAG + 'brave_search.call(query="x")', PYTHON_TAG + 'brave_search.call(query="x")', []),
]

JSON_ARRAY_CASES: list[Case] = [
    ("[" + weather("parameters") + "]", "", [("get_weather", PARIS)]),
    (
        ' [\n  {"name": "get_time", "parameters": {}},\n  ' + '{"name": "search", "parameters": ' + QUOTES + "}\n]\n",
        "",
        [("get_time", "{}"), ("search", QUOTES)],
    ),
    ("[]", "", []),
    ("The weather is nice.", "The weather is nice.", []),
    ('[{"name": 1}]', '[{"name": 1}]', []),
    ('[{"name": "nope", "parameters": {}}]', '[{"name": "nope", "parameters": {}}]', []),
    ('[{"name": "get_weather", "parameters": {"ci', "", [("get_weather", '{"ci')]),
    ('[{"name": "get_time", "parameters": {}}, 3]', ", 3]", [("get_time", "{}")]),
]

CASES = [("hermes", c) for c in HERMES_CASES] + [("llama3", c) for c in LLAMA3_CASES]
CASES += [("json_array", c) for c in JSON_ARRAY_CASES]
CASE_IDS = [f"{fmt}-{i}" for i, (fmt, _) in enumerate(CASES)]
TAG_FRAGMENTS = sorted({t[:i] for t in (TOOL_CALL_START, TOOL_CALL_END, PYTHON_TAG) for i in range(2, len(t) + 1)})


def stream(parser: ToolCallParser, chunks: list[str]) -> tuple[list[str], list[list[ToolCallDelta]]]:
    contents, deltas = [], []
    for chunk in chunks:
        c, d = parser.parse_stream_chunk(chunk)
        contents.append(c)
        deltas.append(d)
    c, d = parser.flush()
    contents.append(c)
    deltas.append(d)
    return contents, deltas


def assemble(deltas: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """The calls that a client builds from the deltas, checking how they are shaped."""
    calls: list[list[str]] = []
    for d in deltas:
        if d.name is not None:
            assert d.index == len(calls), deltas  # a new call, next index
            calls.append([d.name, d.arguments])
        else:
            assert d.index == len(calls) - 1 and d.arguments, deltas  # the open call, something new
            calls[-1][1] += d.arguments
    return [(n, a) for n, a in calls]


def random_splits(text: str, rng: random.Random) -> list[str]:
    """Cuts text at random positions; repeated cuts give empty chunks, which must be harmless."""
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, max(1, len(text) // 3))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


def all_chunkings(text: str) -> list[list[str]]:
    chunkings = [[text], list(text)]
    chunkings += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    rng = random.Random(sum(map(ord, text)))  # not hash(): str hashes are salted per process
    chunkings += [random_splits(text, rng) for _ in range(20)]
    return chunkings


@pytest.mark.parametrize(("fmt", "case"), CASES, ids=CASE_IDS)
def test_non_stream(fmt: str, case: Case) -> None:
    text, content, calls = case
    assert ToolCallParser(fmt, TOOL_NAMES).parse_non_stream(text) == (
        content,
        [ToolCallItem(n, a) for n, a in calls],
    )


@pytest.mark.parametrize(("fmt", "case"), CASES, ids=CASE_IDS)
def test_stream_matches_non_stream(fmt: str, case: Case) -> None:
    text = case[0]
    content, items = ToolCallParser(fmt, TOOL_NAMES).parse_non_stream(text)
    calls = [(c.name, c.arguments) for c in items]
    # Tags that survive in the one-shot content are literal text; anything else in a content
    # delta would be a tag (or a fragment of one) leaking through.
    forbidden = [f for f in TAG_FRAGMENTS if f not in content]
    for chunks in all_chunkings(text):
        contents, deltas = stream(ToolCallParser(fmt, TOOL_NAMES), chunks)
        assert "".join(contents) == content, chunks
        assert assemble([d for ds in deltas for d in ds]) == calls, chunks
        for delta in contents:
            assert not any(f in delta for f in forbidden), (chunks, delta)
        for ds in deltas:  # within one chunk, a call's pieces come merged
            assert len({d.index for d in ds}) == len(ds), (chunks, ds)


def test_no_tool_names_accepts_any_name() -> None:
    text = hermes('{"name": "anything", "arguments": {}}')
    assert ToolCallParser("hermes").parse_non_stream(text) == ("", [ToolCallItem("anything", "{}")])
    assert ToolCallParser("hermes", set()).parse_non_stream(text) == (text, [])


@pytest.mark.parametrize(
    ("fmt", "head", "tail"),
    [
        ("hermes", 'Sure.\n<tool_call>\n{"name": "search", "arguments": ', "}\n</tool_call>\n"),
        ("qwen25", '<tool_call>{"name": "search", "arguments": ', "}</tool_call>"),
        ("llama3", '<|python_tag|>{"name": "search", "parameters": ', "}"),
        ("json_array", '[{"name": "search", "parameters": ', "}]"),
    ],
)
def test_arguments_stream_before_the_call_ends(fmt: str, head: str, tail: str) -> None:
    args = '{"query": "' + "long text, " * 30 + '", "n": [1, {"k": 2}]}'
    parser = ToolCallParser(fmt, TOOL_NAMES)
    sent: list[ToolCallDelta] = []
    body = head + args
    for i in range(0, len(body), 5):
        sent += parser.parse_stream_chunk(body[i : i + 5])[1]
    # Everything of the arguments is out before the end of the call arrives.
    assert sent[0] == ToolCallDelta(0, "search", "")
    assert "".join(d.arguments for d in sent) == args
    assert len(sent) > 10
    assert parser.parse_stream_chunk(tail) == ("", [])
    assert parser.flush() == ("", [])


def test_name_is_sent_as_soon_as_it_is_known() -> None:
    parser = ToolCallParser("hermes", TOOL_NAMES)
    assert parser.parse_stream_chunk("I'll check. ") == ("I'll check.", [])  # trailing space held
    assert parser.parse_stream_chunk('<tool_call>\n{"name": "get_wea') == ("", [])
    assert parser.parse_stream_chunk('ther"') == ("", [ToolCallDelta(0, "get_weather", "")])
    assert parser.parse_stream_chunk(', "arguments": {"ci') == ("", [ToolCallDelta(0, None, '{"ci')])
    assert parser.parse_stream_chunk('ty": "Paris"}}\n</tool') == ("", [ToolCallDelta(0, None, 'ty": "Paris"}')])
    assert parser.parse_stream_chunk("_call>\n\n") == ("", [])
    assert parser.parse_stream_chunk("<tool_call>") == ("", [])
    assert parser.parse_stream_chunk('{"name": "get_time"}</tool_call>') == (
        "", [ToolCallDelta(1, "get_time", "{}")]
    )
    assert parser.flush() == ("", [])


def test_arguments_before_the_name_wait_for_the_object() -> None:
    parser = ToolCallParser("hermes", TOOL_NAMES)
    assert parser.parse_stream_chunk('<tool_call>{"arguments": {"city": "Paris"}, ') == ("", [])
    assert parser.parse_stream_chunk('"name": "get_weather"') == ("", [])
    assert parser.parse_stream_chunk("}") == ("", [ToolCallDelta(0, "get_weather", PARIS)])


def test_content_holds_back_only_a_possible_tag_and_trailing_whitespace() -> None:
    parser = ToolCallParser("hermes", TOOL_NAMES)
    out = [parser.parse_stream_chunk(c) for c in ["Hello", " wor", "ld <", "b> <tool", "_cal", "l> x\n"]]
    assert out == [
        ("Hello", []),
        (" wor", []),
        ("ld", []),  # " <" might start a call
        (" <b>", []),  # " <tool" held
        ("", []),
        (" <tool_call> x", []),  # not a tag after all; the newline is held
    ]
    assert parser.flush() == ("\n", [])


def test_unknown_name_is_released_once_the_name_is_known() -> None:
    parser = ToolCallParser("hermes", TOOL_NAMES)
    assert parser.parse_stream_chunk('<tool_call>{"name": "rm_rf"') == ('<tool_call>{"name": "rm_rf"', [])
    assert parser.parse_stream_chunk(', "arguments": {}}</tool_call>') == (', "arguments": {}}</tool_call>', [])


def test_non_stream_leaves_streaming_state_alone() -> None:
    parser = ToolCallParser("hermes", TOOL_NAMES)
    assert parser.parse_stream_chunk('<tool_call>{"name": "get_time"') == ("", [ToolCallDelta(0, "get_time", "")])
    assert parser.parse_non_stream("plain") == ("plain", [])
    assert parser.parse_stream_chunk("}</tool_call>") == ("", [ToolCallDelta(0, None, "{}")])


def test_formats() -> None:
    assert {"hermes", "qwen25", "llama3", "json_array"} <= set(SUPPORTED_FORMATS)
    assert ToolCallParser("Qwen25").fmt == "hermes"  # case-insensitive alias
    with pytest.raises(ValueError, match="hermes.*llama3"):
        ToolCallParser("mistral")


QWEN25_TEMPLATE_PART = (
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}'
)
LLAMA31_TEMPLATE_PART = (
    '{{- "Given the following functions, please respond with a JSON for a function call with its proper '
    'arguments that best answers the given prompt.\\n\\n" }}'
)


@pytest.mark.parametrize(
    ("template", "fmt"),
    [
        (QWEN25_TEMPLATE_PART, "hermes"),
        (LLAMA31_TEMPLATE_PART, "llama3"),
        ("{%- if builtin_tools is defined or tool_call is defined %}{{- '<|python_tag|>' }}", "llama3"),
        ("{{- '<|eom_id|>' }}", "llama3"),
        ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}{% endfor %}", None),
        ("", None),
        (None, None),
    ],
)
def test_detect_tool_call_format(template: str | None, fmt: str | None) -> None:
    assert detect_tool_call_format(template) == fmt
