"""What the scheduler and sampler need of a grammar backend, whichever library it wraps.

Both libraries describe a step's allowed tokens as the same bitmask: one int32 word per 32
tokens, bit i of word w set when token 32 * w + i may come next. The mask is built on the
CPU (the matchers live there) and applied to the logits wherever they are.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any

import torch


class GrammarError(ValueError):
    """A grammar the backend cannot compile; the message is shown to the client."""


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advances past `token`; False if the grammar does not allow it (state unchanged)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into bitmask[row]."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its stop token: nothing more may follow."""

    def constrains_next(self) -> bool:
        """Whether the next token is constrained at all (a reasoning prefix is free)."""
        return True


class GrammarBackend(ABC):
    name: str

    @staticmethod
    @abstractmethod
    def check(kind: str, text: str) -> None:
        """Raises GrammarError if `text` is not a valid grammar of `kind`. Needs no tokenizer,
        so the TokenizerManager can answer a bad grammar with a 400 before queueing it."""

    @abstractmethod
    def compile(self, kind: str, text: str) -> Any:
        """The grammar compiled against the vocabulary (slow: runs on a worker thread)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab_size / 32)] int32, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allow_token(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Sets one token's bit in bitmask[row]."""
    word = (int(bitmask[row, token // 32]) & 0xFFFFFFFF) | (1 << (token % 32))
    bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word  # back to int32


# Row b of this table is the additive mask of one bitmask byte of value b: 0.0 where its bit
# is set (allowed), -inf where not. Looking bytes up and adding is several times faster on
# the CPU than expanding the bits and calling masked_fill_ with a [B, V] bool mask.
_BYTE_BIAS = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0, float("-inf"), 0.0)  # [256, 8]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets to -inf, in place, the logits of tokens the bitmask forbids, in rows `rows`.
    logits [B, V] float32; bitmask [B, ceil(V / 32)] int32 on the CPU."""
    vocab = logits.shape[-1]
    words = bitmask if len(rows) == bitmask.shape[0] else bitmask[rows]  # [R, W]
    # Little-endian bytes of each word, in token order.
    byte_values = words.to(logits.device, non_blocking=True).contiguous().view(torch.uint8).flatten().int()  # [R * W * 4]
    table = _BYTE_BIAS.to(logits.device, logits.dtype)
    bias = table.index_select(0, byte_values).view(len(rows), -1)[:, :vocab]  # [R, V]
    if len(rows) == logits.shape[0]:
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(rows, dtype=torch.int64, device=logits.device), bias)


_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_CHECK = re.compile(r"^Check failed: .*? is false: ")


def clean_error(e: Exception) -> str:
    """A library's error without its C++ timestamp and source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _CHECK.sub("", _LOCATION.sub("", text))
