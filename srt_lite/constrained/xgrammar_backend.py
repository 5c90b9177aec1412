"""The xgrammar backend (SGLang's default)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import orjson

from srt_lite.constrained.base import GrammarBackend, GrammarError, GrammarMatcher, clean_error

if TYPE_CHECKING:  # the HTTP process checks grammars without torch
    import torch

# JSON is generated compactly but readably (", " and ": " between items, no newlines):
# allowing any whitespace lets small models loop on newlines until max_tokens, which is
# why vLLM grew a flag to turn it off.
_JSON_OPTIONS = {"any_whitespace": False, "strict_mode": True}

# JSON gives no meaning to digits a double cannot hold, yet its grammar lets a number grow
# without end, and a small model that starts repeating a digit writes "1111..." until
# max_tokens. The grammar a schema compiles to is bounded (llama.cpp's caps integer digits
# at 16 too): an integer part of at most 16 digits, a fraction of at most 16, an exponent of
# at most 3. xgrammar writes number rules as `[1-9] [0-9]*` and digit rules repeated
# `{1, -1}`; a user's `pattern` stays inside a Regex("...") call and is not touched.
MAX_INT_DIGITS = 16
MAX_FRACTION_DIGITS = 16
MAX_EXPONENT_DIGITS = 3
_RULE = re.compile(r"^(\S+) ::= (.*)$")
_DIGIT_RULE_BODY = "(([0-9]))"


def bound_number_digits(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with every number's digits bounded (see above)."""
    lines = ebnf.splitlines()
    rules = [_RULE.match(line) for line in lines]
    digit_rules = [m.group(1) for m in rules if m and m.group(2) == _DIGIT_RULE_BODY]
    out = []
    for line, m in zip(lines, rules):
        if m is None or "Regex(" in m.group(2):
            out.append(line)
            continue
        name, body = m.groups()
        body = body.replace("[1-9] [0-9]*", f"[1-9] [0-9]{{0, {MAX_INT_DIGITS - 1}}}")
        # Digits after a leading [1-9] are an integer part (of a number with a range); the
        # others are a fraction, or an exponent in the rule that holds [eE].
        most = MAX_EXPONENT_DIGITS if "[eE]" in body else MAX_FRACTION_DIGITS
        for digits in digit_rules:
            body = re.sub(rf"(\[1-9\] ){re.escape(digits)}\{{[01], -1\}}", rf"\g<1>{digits}{{0, {MAX_INT_DIGITS - 1}}}", body)
            body = body.replace(f"{digits}{{1, -1}}", f"{digits}{{1, {most}}}").replace(f"{digits}{{0, -1}}", f"{digits}{{0, {most}}}")
        out.append(f"{name} ::= {body}")
    return "\n".join(out)


def json_schema_grammar(xgr: Any, text: str) -> str:
    """The EBNF that a JSON schema compiles to here: xgrammar's, with bounded numbers."""
    return bound_number_digits(str(xgr.Grammar.from_json_schema(text, **_JSON_OPTIONS)))


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        # vocab_size is the model's (logits') width, which may pad the tokenizer's: the
        # padding ids are never allowed.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # One thread per compile: compiles already run beside the scheduler on its pool.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)

    @staticmethod
    def check(kind: str, text: str) -> None:
        import xgrammar as xgr

        try:
            if kind == "json_schema":
                xgr.Grammar.from_ebnf(json_schema_grammar(xgr, text))
            elif kind == "regex":
                xgr.Grammar.from_regex(text)
            elif kind == "ebnf":
                xgr.Grammar.from_ebnf(text)
            elif kind == "structural_tag":
                xgr.Grammar.from_structural_tag(*_structural_tag_args(text))
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - the library's errors for bad input vary in type
            raise GrammarError(clean_error(e)) from None

    def compile(self, kind: str, text: str) -> Any:
        try:
            if kind == "json_schema":
                return self.compiler.compile_grammar(json_schema_grammar(self.xgr, text))
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "ebnf":
                return self.compiler.compile_grammar(text)
            if kind == "structural_tag":
                return self.compiler.compile_structural_tag(*_structural_tag_args(text))
        except Exception as e:  # noqa: BLE001 - the library's errors for bad input vary in type
            raise GrammarError(clean_error(e)) from None
        raise GrammarError(f"unknown grammar kind {kind!r}")

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(self.xgr.GrammarMatcher(compiled))


def _structural_tag_args(text: str) -> tuple:
    """xgrammar's arguments for a structural tag: its current format (JSON with a "format")
    as is, or SGLang's older one ({"structures": [{"begin", "schema", "end"}], "triggers"})
    as tag items and triggers."""
    import xgrammar as xgr

    tag = orjson.loads(text)
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=orjson.dumps(s.get("schema", {})).decode(), end=s["end"])
            for s in tag["structures"]
        ]
        return items, list(tag.get("triggers", []))
    return (text,)
