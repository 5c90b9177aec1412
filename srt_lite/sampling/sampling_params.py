"""SamplingParams: the per-request generation parameters of SGLang / vLLM, with their checks."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

_GREEDY_EPS = 1e-6
MAX_N = 128  # completions per request (OpenAI's limit)
# The grammar kinds, by the names of SGLang's sampling parameters; a request sets at most one.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class Grammar:
    """One output constraint: `kind` (one of GRAMMAR_KINDS), `text` its source (a JSON
    schema or structural tag as JSON text, a regular expression, an EBNF grammar), and
    `field`, the request field it came from, which every error about it names."""

    kind: str
    text: str
    field: str = ""

    @classmethod
    def from_fields(cls, values: dict[str, Any], kinds: tuple[str, ...] = GRAMMAR_KINDS) -> "Grammar | None":
        """The one grammar among `values`' fields named in `kinds` (a schema or tag may be
        an object, which becomes JSON text); None if none is set; a ValueError if several are."""
        given = [k for k in kinds if values.get(k) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of {', '.join(kinds)} may be set; got {' and '.join(given)}")
        if not given:
            return None
        text = values[given[0]]
        if given[0] in ("json_schema", "structural_tag") and isinstance(text, dict):
            text = json.dumps(text)  # Engine users write schemas as dicts
        return cls(given[0], text, given[0])


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
    # Structured output: what the request's output must match. Given as SGLang's sampling
    # parameters json_schema, regex, ebnf or structural_tag (from_dict), at most one.
    grammar: Grammar | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "SamplingParams":
        """Builds and verifies; an unknown key or a wrong type raises ValueError naming it."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)} - {"grammar"} | set(GRAMMAR_KINDS)
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        d = {k: v for k, v in d.items() if v is not None}  # None means "use the default"
        grammar = Grammar.from_fields({k: d.pop(k) for k in GRAMMAR_KINDS if k in d})
        params = cls(**d, grammar=grammar)
        params.normalize()
        params.verify()
        return params

    def normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

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
        g = self.grammar
        if g is None:
            return
        if g.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {g.kind!r}")
        if not isinstance(g.text, str):
            raise ValueError(f"{g.kind} must be a string")
        if g.kind in ("json_schema", "structural_tag"):
            try:
                value = json.loads(g.text)
            except ValueError as e:
                raise ValueError(f"{g.kind} is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)) or (g.kind == "structural_tag" and not isinstance(value, dict)):
                raise ValueError(f"{g.kind} must be a JSON object")

    def to_dict(self) -> dict[str, Any]:
        """The parameters as from_dict takes them: the grammar under its kind's name."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "grammar"}
        if self.grammar is not None:
            d[self.grammar.kind] = self.grammar.text
        return d


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
