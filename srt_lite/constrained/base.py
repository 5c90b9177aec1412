"""What the scheduler and sampler need of a grammar backend, whichever library it wraps.

Both libraries describe a step's allowed tokens as the same bitmask (constrained/bitmask.py),
built on the CPU, where the matchers live.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the HTTP process checks grammars and never imports torch
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


_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_CHECK = re.compile(r"^Check failed: .*? is false: ")


def clean_error(e: Exception) -> str:
    """A library's error without its C++ timestamp and source location."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return _CHECK.sub("", _LOCATION.sub("", text))
