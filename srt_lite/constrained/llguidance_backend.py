"""The llguidance backend. It builds masks lazily (no up-front compile of the vocabulary)
and reads EBNF through its GBNF-to-Lark converter; it has no structural tags."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any


from srt_lite.constrained.base import GrammarBackend, GrammarError, GrammarMatcher, clean_error

if TYPE_CHECKING:  # the HTTP process checks grammars without torch
    import torch

# Compact JSON with ", " and ": ", as the xgrammar backend writes it (see there why).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any):
        self.matcher = matcher
        self.stopped = False

    def accept(self, token: int) -> bool:
        if self.matcher.is_stopped():
            # Complete: only a stop token may follow, and it ends the request.
            self.stopped = True
            return True
        return self.matcher.consume_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def is_terminated(self) -> bool:
        return self.stopped or self.matcher.is_stopped()


def _grammar(kind: str, text: str) -> str:
    import llguidance

    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "ebnf":
        from llguidance.gbnf_to_lark import any_to_lark  # GBNF (xgrammar's EBNF) or Lark

        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
    raise GrammarError(f"{kind} is not supported by the llguidance backend")


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import llguidance.hf

        self.llguidance = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_token_ids)

    @staticmethod
    def check(kind: str, text: str) -> None:
        import llguidance

        try:
            error = llguidance.LLMatcher.validate_grammar(_grammar(kind, text))
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - the library's errors for bad input vary in type
            raise GrammarError(clean_error(e)) from None
        if error:
            raise GrammarError(clean_error(ValueError(error)))

    def compile(self, kind: str, text: str) -> Any:
        self.check(kind, text)
        return _grammar(kind, text)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        m = self.llguidance.LLMatcher(self.tokenizer, compiled)
        if m.is_error():
            raise GrammarError(clean_error(ValueError(m.get_error())))
        return LLGuidanceMatcher(m)
