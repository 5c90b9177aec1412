"""Reasoning parser: splits a model's output into reasoning_content and content.

Reasoning models write their chain of thought between <think> and </think>; the OpenAI
chat API returns it as `reasoning_content`, separate from the answer in `content`. We
support the two formats SGLang calls `qwen3` and `deepseek-r1` (both use <think> tags):

- deepseek-r1: the chat template already ends the prompt with "<think>\\n", so the output
  starts inside reasoning (force_reasoning is always on). R1-0528 re-emits the opening tag
  anyway, so an opening tag in the output is accepted and dropped.
- qwen3: the model emits <think> itself, so the output is reasoning only if it starts with
  <think>; otherwise (e.g. enable_thinking=false, where the template closed an empty think
  block in the prompt) it is all content. Templates that leave <think> open in the prompt
  (Qwen3-2507 thinking models) need force_reasoning=True, which the server sets when
  prompt_opens_reasoning() says so.

Rules, identical for the one-shot and the streaming paths (the tests check that streaming
deltas concatenate exactly to the one-shot result for every chunking):

- Inside reasoning the text is scanned left to right; the first "</think>" ends it, and
  any "<think>" met on the way is dropped (the leading one R1/Qwen emit, or a stray repeat),
  so reasoning never carries a tag.
- Whitespace right after "</think>" is dropped: models write "</think>\\n\\n" before the
  answer and SGLang strips it from content. The rest of the content is returned verbatim,
  including any tag-like text, since the model has left reasoning for good.
- If the output ends without "</think>" (e.g. max_tokens hit), all of it is reasoning and
  content is empty, as in SGLang.
- Reasoning text itself is returned verbatim (no stripping), so streamed pieces need no
  look-ahead beyond tag fragments.

Streaming holds back the longest tail that could still become a tag ("<", "</thi", ...)
and releases it once the next delta shows it cannot, so no tag fragment is ever sent.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

THINK_START = "<think>"
THINK_END = "</think>"
SUPPORTED_PARSERS = ("qwen3", "deepseek-r1")

# Every proper prefix of either tag: the only tails worth holding back while in reasoning.
_TAG_PREFIXES = frozenset(t[:i] for t in (THINK_START, THINK_END) for i in range(1, len(t)))
_MAX_HOLD = max(len(THINK_START), len(THINK_END)) - 1

# Streaming states.
_UNDECIDED = "undecided"  # qwen3 without force: waiting to see whether output starts with <think>
_REASONING = "reasoning"
_AFTER_END = "after_end"  # just saw </think>: dropping whitespace before the content
_CONTENT = "content"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the rendered prompt ends inside an open think block, i.e. its last <think>
    is not followed by a </think>, so generation starts in reasoning (Qwen3-2507 thinking
    and DeepSeek-R1 templates end with "<think>\\n"; Qwen3 with enable_thinking=false ends
    with a closed "<think>\\n\\n</think>\\n\\n").

    A literal "<think>" in a user message also answers True when the template adds no think
    block; that is harmless for outputs that start with <think> (the tag is dropped), and
    only misfiles an output with no tags at all as reasoning."""
    start = prompt_text.rfind(THINK_START)
    return start >= 0 and prompt_text.find(THINK_END, start + len(THINK_START)) < 0


def _partial_tag_length(text: str, start: int) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of a tag."""
    for n in range(min(_MAX_HOLD, len(text) - start), 0, -1):
        if text[len(text) - n :] in _TAG_PREFIXES:
            return n
    return 0


def _scan_reasoning(text: str, hold_partial: bool) -> tuple[str, str | None, str]:
    """Scans text that starts inside reasoning. Returns (reasoning, text after the first
    </think> or None if there is none, held tail). With hold_partial the tail that might
    still grow into a tag is returned separately instead of as reasoning."""
    pieces: list[str] = []
    pos = 0
    while True:
        end = text.find(THINK_END, pos)
        start = text.find(THINK_START, pos)
        # The two tags differ at their second character, so they never match at the same
        # position: the leftmost one is unambiguous.
        if start >= 0 and (end < 0 or start < end):
            pieces.append(text[pos:start])
            pos = start + len(THINK_START)
            continue
        if end >= 0:
            pieces.append(text[pos:end])
            return "".join(pieces), text[end + len(THINK_END) :], ""
        break
    hold = _partial_tag_length(text, pos) if hold_partial else 0
    cut = len(text) - hold
    pieces.append(text[pos:cut])
    return "".join(pieces), None, text[cut:]


class ReasoningParser:
    """Splits one request's output into reasoning and content, in one shot
    (parse_non_stream) or delta by delta (parse_stream_chunk, then flush). One instance
    per request: the streaming methods keep state."""

    def __init__(self, model_type: str, force_reasoning: bool = False, stream_reasoning: bool = True) -> None:
        model_type = model_type.lower()
        if model_type not in SUPPORTED_PARSERS:
            raise ValueError(
                f"unsupported reasoning parser {model_type!r}; supported: {', '.join(SUPPORTED_PARSERS)}"
            )
        self.model_type = model_type
        # R1's template always opens the think block in the prompt.
        self.force_reasoning = force_reasoning or model_type == "deepseek-r1"
        self.stream_reasoning = stream_reasoning

        self._state = _REASONING if self.force_reasoning else _UNDECIDED
        self._pending = ""  # received but not yet released (only a tag fragment or an undecided start)
        self._reasoning_acc: list[str] = []  # reasoning kept for one release when not streaming it

    def parse_non_stream(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content or None when there is none, content) for a full output."""
        if not (self.force_reasoning or text.startswith(THINK_START)):
            return None, text
        reasoning, after_end, _ = _scan_reasoning(text, hold_partial=False)
        content = "" if after_end is None else after_end.lstrip()
        return reasoning or None, content

    def parse_stream_chunk(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of output; either may be ""."""
        self._pending += delta
        if self._state == _UNDECIDED:
            if len(self._pending) < len(THINK_START) and THINK_START.startswith(self._pending):
                return "", ""  # could still become <think>
            # The reasoning scan drops the leading tag itself.
            self._state = _REASONING if self._pending.startswith(THINK_START) else _CONTENT

        reasoning = ""
        if self._state == _REASONING:
            reasoning, after_end, self._pending = _scan_reasoning(self._pending, hold_partial=True)
            if after_end is None:
                if self.stream_reasoning:
                    return reasoning, ""
                self._reasoning_acc.append(reasoning)
                return "", ""
            if not self.stream_reasoning:
                # Reasoning goes out whole, in the same call that ends it, before any content.
                self._reasoning_acc.append(reasoning)
                reasoning = "".join(self._reasoning_acc)
                self._reasoning_acc = []
            self._state = _AFTER_END
            self._pending = after_end

        content = ""
        if self._state == _AFTER_END:
            stripped = self._pending.lstrip()
            self._pending = ""
            if stripped:
                self._state = _CONTENT
                content = stripped
        elif self._state == _CONTENT:
            content, self._pending = self._pending, ""
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """End of the stream: (reasoning, content) still held back. A held tag fragment turned
        out to be plain text; reasoning never closed is released as reasoning."""
        held, self._pending = self._pending, ""
        if self._state == _UNDECIDED:
            # Output ended as a proper prefix of <think> (or empty): it is content.
            self._state = _CONTENT
            return "", held
        if self._state == _REASONING:
            logger.debug("output ended inside reasoning without %s", THINK_END)
            self._reasoning_acc.append(held)
            reasoning = "".join(self._reasoning_acc)
            self._reasoning_acc = []
            return reasoning, ""
        return "", ""
