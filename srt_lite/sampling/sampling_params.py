"""SamplingParams: the per-request generation parameters of SGLang / vLLM, with their checks."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

_GREEDY_EPS = 1e-6
MAX_N = 128  # completions per request (OpenAI's limit)
# The grammar fields (SGLang's names); a request may set at most one.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    n: int = 1
    # Structured output: the text the request's output must match, as a JSON schema (JSON
    # text), a regular expression, an EBNF grammar or an xgrammar structural tag (JSON text).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Builds and verifies; an unknown key or a wrong type raises ValueError naming it."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        d = {k: v for k, v in d.items() if v is not None}  # None means "use the default"
        params = cls(**d)
        params.normalize()
        params.verify()
        return params

    def normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # A schema or tag given as an object (Engine users write dicts) travels as JSON text.
        for name in ("json_schema", "structural_tag"):
            if isinstance(getattr(self, name), dict):
                setattr(self, name, json.dumps(getattr(self, name)))

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar, or None."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        _int("max_new_tokens", self.max_new_tokens, lo=0)
        _int("min_new_tokens", self.min_new_tokens, lo=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})"
            )
        _num("temperature", self.temperature, lo=0.0)
        _num("top_p", self.top_p, lo=0.0, hi=1.0)
        if self.top_p <= 0.0:
            raise ValueError("top_p must be in (0, 1]")
        _int("top_k", self.top_k)
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        _num("min_p", self.min_p, lo=0.0, hi=1.0)
        _num("repetition_penalty", self.repetition_penalty, lo=0.0, hi=2.0)
        if self.repetition_penalty <= 0.0:
            raise ValueError("repetition_penalty must be in (0, 2]")
        _num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _int("n", self.n, lo=1, hi=MAX_N)
        if self.seed is not None:
            _int("seed", self.seed)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean")
        self._verify_stops_and_bias(vocab_size)
        self._verify_grammar()

    def _verify_stops_and_bias(self, vocab_size: int | None) -> None:
        if self.stop is not None:
            if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
                raise ValueError("stop must be a string or a list of strings")
            if any(s == "" for s in self.stop):
                raise ValueError("stop strings must not be empty")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, list):
                raise ValueError("stop_token_ids must be a list of integers")
            for t in self.stop_token_ids:
                _int("stop_token_ids", t, lo=0, hi=None if vocab_size is None else vocab_size - 1)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be an object mapping token ids to biases")
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias key {k!r} is not a token id") from None
                if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                    raise ValueError(f"logit_bias token id {tid} is out of the vocabulary")
                _num("logit_bias", v, lo=-100.0, hi=100.0)

    def _verify_grammar(self) -> None:
        grammars = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(grammars) > 1:
            raise ValueError(f"only one of {', '.join(GRAMMAR_KINDS)} may be set, got {', '.join(grammars)}")
        for kind in grammars:
            if not isinstance(getattr(self, kind), str):
                raise ValueError(f"{kind} must be a string")
        for kind in ("json_schema", "structural_tag"):
            text = getattr(self, kind)
            if text is not None:
                try:
                    value = json.loads(text)
                except ValueError as e:
                    raise ValueError(f"{kind} is not valid JSON: {e}") from None
                if not isinstance(value, (dict, bool)) or (kind == "structural_tag" and not isinstance(value, dict)):
                    raise ValueError(f"{kind} must be a JSON object")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _num(name: str, x: Any, lo: float | None = None, hi: float | None = None) -> None:
    if not _is_number(x) or math.isnan(x) or math.isinf(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {x}")


def _int(name: str, x: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{name} must be an integer, got {x!r}")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bounds}, got {x}")
