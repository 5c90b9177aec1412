"""Incremental detokenization and stop-string hold-back, checked against full decodes."""

from __future__ import annotations

import random

import pytest

from srt_lite.managers.detokenizer.incremental_detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from srt_lite.sampling.stop_strings import StopStringMatcher, find_stop

EOS_ID = 2
IM_START_ID = 1

TEXTS = [
    "Hello, world!",
    "👍🏽 thumbs up, 🇫🇷 flag, 👨‍👩‍👧‍👦 family",
    "你好世界",
    "日本語のテキスト",
    "Café naïve résumé, Ελληνικά, русский, ﬁ ligature",
    "def f(x):\n    if x:\n        return  x  *  2\n\n\n\treturn None    \n",
    "<|im_start|>user\n你好 👍🏽<|im_end|>\n<|im_start|>assistant\nçà 🇫🇷<|im_end|>",
    "a<|im_end|><|im_end|>b<|endoftext|>",
    "   leading spaces and trailing   ",
    "",
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from srt_lite.model_loader.default_model import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(None))


@pytest.fixture(scope="module")
def byte_token_ids(tok) -> dict[int, int]:
    """byte value -> id of the token that is exactly that one byte, to build sequences that
    split every multi-byte character over several tokens. SmolLM2's vocabulary lacks a few
    bytes never seen in training (C0, C1, F1, F2, F5-FF, some controls)."""
    vocab = tok.get_vocab()
    out = {b: vocab[ch] for b, ch in bytes_to_unicode().items() if ch in vocab}
    needed = set(range(0x20, 0x7F)) | set(range(0x80, 0xC0)) | set(range(0xC2, 0xF1)) | {0xF3, 0xF4}
    assert needed <= out.keys()
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def stream(tok, ids: list[int], skip: bool, chunk_sizes: list[int] | None = None):
    """Feeds ids in chunks; returns (detokenizer, deltas, flushed)."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas: list[str] = []
    i = 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.step(ids[i : i + n]))
        i += n
    return detok, deltas, detok.flush()


def check_stream(tok, ids: list[int], skip: bool, chunk_sizes: list[int] | None = None) -> None:
    full = tok.decode(ids, skip_special_tokens=skip)
    detok, deltas, flushed = stream(tok, ids, skip, chunk_sizes)
    assert "".join(deltas) + flushed == full
    assert detok.text == full
    # The detokenizer's own decode options give the same full text (no cleanup surprises).
    assert tok.decode(ids, **detok.decode_kwargs) == full
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
        assert flushed == ""
    # Emitted text is never taken back: every running total is a prefix of the final text.
    total = ""
    for d in deltas:
        total += d
        assert full.startswith(total)


# ----------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_texts_one_token_at_a_time(tok, text, skip):
    ids = tok.encode(text, add_special_tokens=False)
    check_stream(tok, ids, skip)


@pytest.mark.parametrize("skip", [True, False])
def test_texts_in_random_chunks(tok, skip):
    rng = random.Random(1)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False) + [EOS_ID]
        for _ in range(5):
            check_stream(tok, ids, skip, [rng.randint(1, 4) for _ in ids])


def test_special_tokens_skipped_or_kept(tok):
    ids = [IM_START_ID] + tok.encode("hi", add_special_tokens=False) + [EOS_ID]
    _, deltas, _ = stream(tok, ids, skip=True)
    assert "".join(deltas) == "hi"
    _, deltas, _ = stream(tok, ids, skip=False)
    assert "".join(deltas) == "<|im_start|>hi<|im_end|>"


def test_split_emoji_is_held_until_complete(tok):
    ids = tok.encode("👍🏽", add_special_tokens=False)
    assert len(ids) > 2  # byte-level BPE splits it, so some steps must hold text back
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) == "👍🏽"
    assert "" in deltas
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert detok.flush() == ""


def test_flush_emits_incomplete_character(tok):
    ids = tok.encode("ok 👍", add_special_tokens=False)
    partial = ids[:-1]
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.step([i]) for i in partial)
    assert REPLACEMENT_CHAR not in out
    flushed = detok.flush()
    assert flushed.endswith(REPLACEMENT_CHAR)
    assert out + flushed == tok.decode(partial) == detok.text
    assert detok.flush() == ""


def test_empty_steps(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.step([]) == ""
    assert detok.flush() == ""
    assert detok.text == ""


@pytest.mark.parametrize("skip", [True, False])
def test_random_vocab_ids(tok, skip):
    rng = random.Random(1234 + skip)
    vocab_size = len(tok)
    for _ in range(300):
        n = rng.randint(1, 30)
        ids = []
        for _ in range(n):
            r = rng.random()
            if r < 0.1:
                ids.append(rng.randint(0, 16))  # special / added tokens
            elif r < 0.5:
                ids.append(rng.randint(17, 300))  # includes the single-byte tokens
            else:
                ids.append(rng.randrange(vocab_size))
        chunks = [rng.randint(1, 3) for _ in ids] if rng.random() < 0.5 else None
        check_stream(tok, ids, skip, chunks)


@pytest.mark.parametrize("skip", [True, False])
def test_random_byte_tokens_split_characters(tok, byte_token_ids, skip):
    """Every byte its own token: multi-byte characters are always split over tokens."""
    rng = random.Random(99)
    ranges = [(0x20, 0x7E), (0xA0, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFD)]
    # Four-byte characters whose lead byte (F0, F3, F4) has a token.
    ranges += [(0x10000, 0x3FFFF), (0xC0000, 0x10FFFF)]
    for _ in range(200):
        chars = []
        for _ in range(rng.randint(1, 8)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        text = "".join(chars)
        ids = [byte_token_ids[b] for b in text.encode("utf-8")]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), EOS_ID)
        # Sometimes cut a character short or drop a byte, to get genuinely invalid UTF-8.
        damaged = rng.random() < 0.2
        if damaged:
            del ids[rng.randrange(len(ids))]
        if skip and not damaged:
            assert tok.decode(ids, skip_special_tokens=True) == text
        chunks = [rng.randint(1, 3) for _ in ids] if rng.random() < 0.5 else None
        check_stream(tok, ids, skip, chunks)


def test_decode_window_stays_small(tok):
    """Each step decodes a few tokens around the new ones, not the whole sequence."""

    class CountingTokenizer:
        def __init__(self) -> None:
            self.max_len = 0

        def decode(self, ids, **kwargs):
            self.max_len = max(self.max_len, len(ids))
            return tok.decode(ids, **kwargs)

    text = ("The quick brown fox 🦊 jumps over 懒狗. " * 60).strip()
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 500
    counting = CountingTokenizer()
    detok = IncrementalDetokenizer(counting)
    out = "".join(detok.step([i]) for i in ids) + detok.flush()
    assert out == text
    assert counting.max_len <= 8


# ----------------------------------------------------------------------------- stop strings


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> list[tuple[str, str | None]]:
    return [matcher.feed(d) for d in deltas]


def test_find_stop():
    assert find_stop("hello world", ["world", "lo"]) == (3, "lo")
    assert find_stop("abc###", ["##", "###"]) == (3, "###")  # tie: the longer stop
    assert find_stop("abc", ["x"]) is None
    assert find_stop("abc", []) is None
    assert find_stop("abc", [""]) is None
    assert find_stop("stop here, stop", ["stop"], start=1) == (11, "stop")
    assert find_stop("日本語。終わり", ["。"]) == (3, "。")


def test_stop_spanning_deltas():
    m = StopStringMatcher(["###"])
    assert feed_all(m, ["a#", "#", "#b"]) == [("a", None), ("", None), ("", "###")]
    assert m.feed("more") == ("", "###")
    assert m.flush() == ""
    assert m.matched == "###"


def test_false_start_is_released():
    m = StopStringMatcher(["###"])
    assert m.feed("##") == ("", None)
    assert m.feed("x") == ("##x", None)
    assert m.feed("#") == ("", None)
    assert m.flush() == "#"


def test_holds_only_a_possible_stop_prefix():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abcdef") == ("abcdef", None)  # no suffix can start "STOP"
    assert m.feed("xS") == ("x", None)
    assert m.feed("Tx") == ("STx", None)
    assert m.feed("ST") == ("", None)
    assert m.feed("OP!") == ("", "STOP")


def test_multiple_stops_of_different_lengths():
    m = StopStringMatcher(["\n\n", "<END>", "x"])
    assert m.feed("hello\n") == ("hello", None)
    assert m.feed("<EN") == ("\n", None)
    assert m.feed("D> tail") == ("", "<END>")

    m = StopStringMatcher(["\n\n", "<END>", "x"])
    assert m.feed("<E") == ("", None)
    assert m.feed("ax") == ("<Ea", "x")


def test_stop_at_the_very_beginning():
    m = StopStringMatcher(["Stop", "S"])
    assert m.feed("Stop now") == ("", "Stop")
    m = StopStringMatcher(["</s>"])
    assert feed_all(m, ["<", "/", "s", ">"]) == [("", None), ("", None), ("", None), ("", "</s>")]


def test_no_stop_trim():
    m = StopStringMatcher(["###"], no_stop_trim=True)
    assert feed_all(m, ["a#", "#", "#b"]) == [("a", None), ("", None), ("###", "###")]
    m = StopStringMatcher(["END"], no_stop_trim=True)
    assert m.feed("the END is near") == ("the END", "END")
    assert m.feed("x") == ("", "END")


def test_unicode_stops():
    m = StopStringMatcher(["。終", "👍🏽"])
    assert m.feed("日本語。") == ("日本語", None)
    assert m.feed("終わり") == ("", "。終")
    m = StopStringMatcher(["👍🏽"])
    assert m.feed("ok 👍") == ("ok ", None)
    # "👍👍" is not a start of "👍🏽", but the last "👍" is: only it stays held.
    assert m.feed("👍") == ("👍", None)
    assert m.feed("🏽!") == ("", "👍🏽")


def test_no_stops_is_pass_through():
    m = StopStringMatcher([])
    assert feed_all(m, ["a#", "#", ""]) == [("a#", None), ("#", None), ("", None)]
    assert m.flush() == ""
    m = StopStringMatcher([""])  # an empty stop is ignored, not matched everywhere
    assert m.feed("abc") == ("abc", None)


def random_split(rng: random.Random, text: str) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(0, 4)  # empty deltas happen too (held-back tokens)
        pieces.append(text[i : i + n])
        i += n
    return pieces


def random_stops(rng: random.Random, alphabet: str, max_len: int, max_count: int) -> list[str]:
    count = rng.randint(1, max_count)
    return sorted({"".join(rng.choices(alphabet, k=rng.randint(1, max_len))) for _ in range(count)})


def run_matcher(stops: list[str], pieces: list[str], no_stop_trim: bool):
    """Returns (joined output, matched, most text sent before the match was known)."""
    m = StopStringMatcher(stops, no_stop_trim=no_stop_trim)
    out, sent_before_match = "", 0
    for piece in pieces:
        sent, matched = m.feed(piece)
        out += sent
        if matched is None:
            sent_before_match = len(out)
        else:
            assert m.feed("zzz") == ("", matched)
            assert m.flush() == ""
            return out, matched, sent_before_match
    out += m.flush()
    return out, None, len(out)


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_random_splittings_match_find_stop(no_stop_trim):
    """With no stop inside another, the result cannot depend on how text is split."""
    rng = random.Random(7)
    alphabet = "ab#é👍 "
    checked = 0
    while checked < 1500:
        stops = random_stops(rng, alphabet, max_len=4, max_count=3)
        if any(a != b and a in b for a in stops for b in stops):
            continue
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
        hit = find_stop(text, stops)
        out, matched, sent_before_match = run_matcher(stops, random_split(rng, text), no_stop_trim)
        if hit is None:
            assert (out, matched) == (text, None)
        else:
            pos, stop = hit
            assert matched == stop
            assert out == (text[: pos + len(stop)] if no_stop_trim else text[:pos])
            # No part of the stop left before the match was known.
            assert sent_before_match <= pos
        checked += 1


def test_random_splittings_any_stops():
    """Overlapping stop sets ("#", "##", "a#a"): what matches may depend on the split, but
    the output is always the text up to a real stop occurrence, with no stop inside it."""
    rng = random.Random(11)
    alphabet = "a#b"
    for _ in range(1500):
        stops = random_stops(rng, alphabet, max_len=3, max_count=4)
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 25)))
        out, matched, sent_before_match = run_matcher(stops, random_split(rng, text), False)
        assert find_stop(out, stops) is None
        if matched is None:
            assert out == text and find_stop(text, stops) is None
        else:
            assert text.startswith(out + matched)
            assert sent_before_match <= len(out)
            # The first stop to complete was in the buffer when the match was made, and
            # find_stop takes the earliest start, so the cut is at or before its start.
            occurrences = [
                (i + len(s), i) for s in stops for i in range(len(text)) if text.startswith(s, i)
            ]
            first_end = min(end for end, _ in occurrences)
            assert len(out) <= min(start for end, start in occurrences if end == first_end)


def test_detokenizer_with_stop_matcher(tok):
    """The two together, as the detokenizer uses them: a stop split over tokens never leaks."""
    text = "Sure! Here it is: 👍🏽 done. never sent"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    m = StopStringMatcher(["🏽 done", "STOP"])
    out, matched = "", None
    for i in ids:
        sent, matched = m.feed(detok.step([i]))
        assert "🏽" not in sent and REPLACEMENT_CHAR not in sent
        out += sent
    assert (out, matched) == ("Sure! Here it is: 👍", "🏽 done")
    assert text.startswith(out)
