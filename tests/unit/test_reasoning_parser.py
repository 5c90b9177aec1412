"""Reasoning parser: one-shot results, and streaming deltas that concatenate exactly to them
for every way of chunking the output."""

from __future__ import annotations

import random

import pytest

from srt_lite.parser.reasoning_parser import (
    SUPPORTED_PARSERS,
    THINK_END,
    THINK_START,
    ReasoningParser,
    prompt_opens_reasoning,
)

# (model_type, force_reasoning): the three ways the server builds a parser.
CONFIGS = [("qwen3", False), ("qwen3", True), ("deepseek-r1", False)]
CONFIG_IDS = ["qwen3", "qwen3-forced", "deepseek-r1"]

# output -> expected (reasoning, content) for qwen3 without force, and for the forced
# parsers (qwen3 forced and deepseek-r1 agree: both start inside reasoning).
CASES: list[tuple[str, tuple[str | None, str], tuple[str | None, str]]] = [
    (
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        ("\nLet me think.\n", "The answer is 4."),
        ("\nLet me think.\n", "The answer is 4."),
    ),
    (
        "Let me think.</think>\n\nThe answer is 4.",
        (None, "Let me think.</think>\n\nThe answer is 4."),
        ("Let me think.", "The answer is 4."),
    ),
    ("The answer is 4.", (None, "The answer is 4."), ("The answer is 4.", "")),
    ("<think>still thinking when max_tokens hit", ("still thinking when max_tokens hit", ""),
     ("still thinking when max_tokens hit", "")),
    ("<think></think>answer", (None, "answer"), (None, "answer")),
    ("<think>\n\n</think>\n\n", ("\n\n", ""), ("\n\n", "")),
    ("</think> \t\n just the answer", (None, "</think> \t\n just the answer"), (None, "just the answer")),
    (
        "<think>if a < b and c <= d, </thinking> and <thinker> are not tags<</think>\n\n  a < b <",
        ("if a < b and c <= d, </thinking> and <thinker> are not tags<", "a < b <"),
        ("if a < b and c <= d, </thinking> and <thinker> are not tags<", "a < b <"),
    ),
    # Stray opening tags in reasoning are dropped; the first </think> ends reasoning and
    # everything after it is content, verbatim.
    (
        "<think>a <think>b</think> c</think>d <think>",
        ("a b", "c</think>d <think>"),
        ("a b", "c</think>d <think>"),
    ),
    ("<think><think>twice</think>ok", ("twice", "ok"), ("twice", "ok")),
    ("Hello <think>x</think> y", (None, "Hello <think>x</think> y"), ("Hello x", "y")),
    ("<thi", (None, "<thi"), ("<thi", "")),
    ("<", (None, "<"), ("<", "")),
    ("reasoning </thi", (None, "reasoning </thi"), ("reasoning </thi", "")),
    ("", (None, ""), (None, "")),
    ("<think>日本語で考える 👍🏽</think>\n答え", ("日本語で考える 👍🏽", "答え"), ("日本語で考える 👍🏽", "答え")),
]
TEXTS = [c[0] for c in CASES]
TAG_FRAGMENTS = sorted({t[:i] for t in (THINK_START, THINK_END) for i in range(2, len(t) + 1)})


def stream(parser: ReasoningParser, chunks: list[str]) -> tuple[list[str], list[str]]:
    reasoning, content = [], []
    for chunk in chunks:
        r, c = parser.parse_stream_chunk(chunk)
        reasoning.append(r)
        content.append(c)
    r, c = parser.flush()
    reasoning.append(r)
    content.append(c)
    return reasoning, content


def random_splits(text: str, rng: random.Random) -> list[str]:
    """Cuts text at random positions; repeated cuts give empty chunks, which must be harmless."""
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, max(1, len(text)))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def all_chunkings(text: str) -> list[list[str]]:
    chunkings = [[text], list(text)]
    chunkings += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    rng = random.Random(sum(map(ord, text)))  # not hash(): str hashes are salted per process
    chunkings += [random_splits(text, rng) for _ in range(40)]
    return chunkings


@pytest.mark.parametrize(("model_type", "force"), CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("case", CASES, ids=[repr(t[:24]) for t in TEXTS])
def test_non_stream(case, model_type: str, force: bool) -> None:
    text, expected_plain, expected_forced = case
    expected = expected_forced if (force or model_type == "deepseek-r1") else expected_plain
    for stream_reasoning in (True, False):
        parser = ReasoningParser(model_type, force_reasoning=force, stream_reasoning=stream_reasoning)
        assert parser.parse_non_stream(text) == expected


@pytest.mark.parametrize("stream_reasoning", [True, False], ids=["stream_reasoning", "whole_reasoning"])
@pytest.mark.parametrize(("model_type", "force"), CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("text", TEXTS, ids=[repr(t[:24]) for t in TEXTS])
def test_stream_matches_non_stream(text: str, model_type: str, force: bool, stream_reasoning: bool) -> None:
    reasoning, content = ReasoningParser(model_type, force_reasoning=force).parse_non_stream(text)
    reasoning = reasoning or ""
    # Tags that survive in the one-shot result are literal content; anything else in a
    # delta would be a tag (or a fragment of one) leaking through.
    allowed = [f for f in TAG_FRAGMENTS if f in reasoning or f in content]
    for chunks in all_chunkings(text):
        parser = ReasoningParser(model_type, force_reasoning=force, stream_reasoning=stream_reasoning)
        r_deltas, c_deltas = stream(parser, chunks)
        assert "".join(r_deltas) == reasoning, chunks
        assert "".join(c_deltas) == content, chunks
        for delta in r_deltas + c_deltas:
            assert THINK_START not in delta or THINK_START in allowed, (chunks, delta)
            assert THINK_END not in delta or THINK_END in allowed, (chunks, delta)
        if not stream_reasoning:
            # Reasoning arrives in one piece, before any content.
            nonempty = [i for i, r in enumerate(r_deltas) if r]
            assert len(nonempty) <= 1, (chunks, r_deltas)
            if nonempty:
                first_content = next((i for i, c in enumerate(c_deltas) if c), len(c_deltas))
                assert nonempty[0] <= first_content


def test_tag_split_across_every_boundary_never_leaks() -> None:
    # Every delta boundary cuts a tag, and each delta is checked on its own.
    chunks = ["<", "thi", "nk>", "x <", " y<", "/", "think", "> \n", "\n", "z <", "/think>"]
    parser = ReasoningParser("qwen3")
    out = [parser.parse_stream_chunk(c) for c in chunks] + [parser.flush()]
    assert out == [
        ("", ""),
        ("", ""),
        ("", ""),
        ("x ", ""),  # "<" held: might start a tag
        ("< y", ""),  # "< " cannot, released; the next "<" is held
        ("", ""),
        ("", ""),
        ("", ""),  # </think> done; whitespace after it dropped
        ("", ""),
        ("", "z <"),  # content is verbatim, nothing held
        ("", "/think>"),
        ("", ""),
    ]


def test_stream_reasoning_false_releases_on_end_tag() -> None:
    parser = ReasoningParser("deepseek-r1", stream_reasoning=False)
    assert parser.parse_stream_chunk("step one, ") == ("", "")
    assert parser.parse_stream_chunk("step two") == ("", "")
    assert parser.parse_stream_chunk("</think>\n\nAns") == ("step one, step two", "Ans")
    assert parser.parse_stream_chunk("wer") == ("", "wer")
    assert parser.flush() == ("", "")


def test_stream_reasoning_false_flushes_unfinished_reasoning() -> None:
    parser = ReasoningParser("qwen3", stream_reasoning=False)
    assert parser.parse_stream_chunk("<think>cut off <") == ("", "")
    assert parser.parse_stream_chunk("/thi") == ("", "")
    assert parser.flush() == ("cut off </thi", "")


def test_qwen3_without_think_streams_content_at_once() -> None:
    parser = ReasoningParser("qwen3")
    assert parser.parse_stream_chunk("<th") == ("", "")  # might be <think>
    assert parser.parse_stream_chunk("e") == ("", "<the")
    assert parser.parse_stream_chunk(" end</think>") == ("", " end</think>")


def test_model_type_validation() -> None:
    assert SUPPORTED_PARSERS == ("qwen3", "deepseek-r1")
    assert ReasoningParser("DeepSeek-R1").force_reasoning  # case-insensitive; R1 always forced
    assert not ReasoningParser("qwen3").force_reasoning
    with pytest.raises(ValueError, match="qwen3.*deepseek-r1"):
        ReasoningParser("llama3")


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
        # Qwen3 with enable_thinking=false: empty think block closed in the prompt.
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        # Qwen3-2507 thinking / DeepSeek-R1 templates open the block.
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
        ("<｜User｜>hi<｜Assistant｜><think>\n", True),
        # Earlier turns kept their closed reasoning; only the last <think> counts.
        ("<think>old</think>answer<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
        ("<think>old</think>answer<|im_end|>\n<|im_start|>assistant\n", False),
        ("", False),
        ("</think>", False),
    ],
)
def test_prompt_opens_reasoning(prompt: str, opens: bool) -> None:
    assert prompt_opens_reasoning(prompt) is opens
