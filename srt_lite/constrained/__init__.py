"""Grammar-constrained decoding: a request's output is made to match a JSON schema, a regular
expression, an EBNF grammar or a structural tag, by masking the tokens its grammar forbids
before sampling. Backends: xgrammar (the default, as in SGLang) and llguidance."""

from __future__ import annotations

from srt_lite.constrained.base import GrammarBackend, GrammarError

GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")


def backend_class(name: str) -> type[GrammarBackend] | None:
    """The backend named `name`, None for "none"; GrammarError if its package is missing."""
    if name == "none":
        return None
    try:
        if name == "xgrammar":
            from srt_lite.constrained.xgrammar_backend import XGrammarBackend

            import xgrammar  # noqa: F401 - fail here, not at the first request

            return XGrammarBackend
        if name == "llguidance":
            from srt_lite.constrained.llguidance_backend import LLGuidanceBackend

            import llguidance  # noqa: F401

            return LLGuidanceBackend
    except ImportError as e:
        raise GrammarError(f"grammar backend {name!r} is not installed ({e})") from None
    raise GrammarError(f"unknown grammar backend {name!r}; choose one of {', '.join(GRAMMAR_BACKENDS)}")
