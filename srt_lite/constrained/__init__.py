"""Grammar-constrained decoding: a request's output is made to match a JSON schema, a regular
expression, an EBNF grammar or a structural tag, by masking the tokens its grammar forbids
before sampling. Backends: xgrammar (the default, as in SGLang) and llguidance."""

from __future__ import annotations

import importlib.util

from srt_lite.constrained.base import GrammarBackend, GrammarError

GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")


def backend_class(name: str) -> type[GrammarBackend] | None:
    """The backend named `name`, None for "none"; GrammarError if its package is missing. The
    package itself is imported at first use: it imports transformers, seconds of start-up."""
    if name == "none":
        return None
    if name not in GRAMMAR_BACKENDS:
        raise GrammarError(f"unknown grammar backend {name!r}; choose one of {', '.join(GRAMMAR_BACKENDS)}")
    if importlib.util.find_spec(name) is None:
        raise GrammarError(f"grammar backend {name!r} is not installed (pip install {name})")
    if name == "xgrammar":
        from srt_lite.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    from srt_lite.constrained.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend
