"""A grammar that starts after the model's reasoning, as SGLang does for reasoning models:
the text between <think> and </think> is free, and the grammar constrains the answer.

Tags are followed as text, because a tokenizer may spell them in several tokens (reasoning
models have one special token each; the test models use SmolLM2's tokenizer, which has none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from srt_lite.constrained.base import GrammarMatcher
from srt_lite.constrained.bitmask import allow_token

THINK_START = "<think>"
THINK_END = "</think>"

# Where a request stands.
_UNDECIDED = 0  # the first token: the grammar's, or the opening tag's
_OPENING = 1  # inside the opening tag: its next token only
_REASONING = 2  # free until the closing tag
_ANSWER = 3  # the grammar's


@dataclass(frozen=True)
class ThinkTags:
    """How this tokenizer writes the tags: the opening tag's tokens (as the tokenizer splits
    it, which is how models write it), and each token's text, to see the closing tag."""

    start_ids: tuple[int, ...]
    token_text: Callable[[int], str]

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ThinkTags":
        return cls(tuple(tokenizer.encode(THINK_START, add_special_tokens=False)), lambda t: tokenizer.decode([t]))


class ReasoningMatcher(GrammarMatcher):
    """Wraps a request's grammar. `in_reasoning`: the prompt already opened the think block
    (DeepSeek-R1, Qwen3 thinking templates). Otherwise the model may open one with its first
    token (Qwen3's hybrid models), or answer at once under the grammar."""

    def __init__(self, inner: GrammarMatcher, tags: ThinkTags, in_reasoning: bool):
        self.inner = inner
        self.tags = tags
        self.state = _REASONING if in_reasoning else _UNDECIDED
        self.opened = 0  # tokens of the opening tag written so far
        self.tail = ""  # the end of the reasoning text, to find the closing tag

    def constrains_next(self) -> bool:
        return self.state != _REASONING

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.state == _OPENING:
            bitmask[row] = 0
            allow_token(bitmask, row, self.tags.start_ids[self.opened])
            return
        self.inner.fill_bitmask(bitmask, row)
        if self.state == _UNDECIDED:
            allow_token(bitmask, row, self.tags.start_ids[0])

    def accept(self, token: int) -> bool:
        if self.state == _REASONING:
            self.tail = (self.tail + self.tags.token_text(token))[-2 * len(THINK_END) :]
            if THINK_END in self.tail:
                self.state = _ANSWER
            return True
        if self.state in (_UNDECIDED, _OPENING) and token == self.tags.start_ids[self.opened]:
            self.opened += 1
            self.state = _REASONING if self.opened == len(self.tags.start_ids) else _OPENING
            return True
        if self.state == _OPENING:
            return False
        self.state = _ANSWER
        return self.inner.accept(token)

    def is_terminated(self) -> bool:
        return self.state == _ANSWER and self.inner.is_terminated()
