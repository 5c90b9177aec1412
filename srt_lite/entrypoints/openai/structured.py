"""Structured outputs: a request's grammar fields -> the one grammar its output must follow.

A request may constrain its output in one way only: `response_format` (json_object,
json_schema or SGLang's structural_tag), or one of SGLang's extras `json_schema` (schema
text), `regex`, `ebnf`, or a forced tool call (tool_choice "required" or a named function,
see tools.py). The grammar goes to the scheduler as `SamplingParams.grammar` (a `Grammar`); the grammar
backend enforces it there. Every conflict and every invalid grammar is a 400
whose message names the request field, so a client can tell which part to fix.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from srt_lite.entrypoints.openai.protocol import ResponseFormat, _SamplingFields
from srt_lite.managers.validation import RequestError
from srt_lite.sampling.sampling_params import Grammar

if TYPE_CHECKING:
    from srt_lite.managers.tokenizer.tokenizer_manager import TokenizerManager

# The SGLang extras, in the order their conflicts are reported.
GRAMMAR_EXTRAS = ("json_schema", "regex", "ebnf")

# What json_object means: any JSON object (OpenAI's "JSON mode").
JSON_OBJECT_SCHEMA = {"type": "object"}


def response_format_grammar(fmt: ResponseFormat | None) -> Grammar | None:
    """`response_format` -> a json_schema grammar; None for "text" or no format."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar("json_schema", json.dumps(JSON_OBJECT_SCHEMA), "response_format")
    if fmt.type == "structural_tag":
        if fmt.format is None and fmt.structures is None:
            raise RequestError('response_format of type "structural_tag" needs "format" or "structures" and "triggers"')
        return Grammar("structural_tag", json.dumps(fmt.model_dump(exclude_none=True, exclude={"json_schema"})), "response_format")
    spec = fmt.json_schema
    if spec is None:
        raise RequestError('response_format.json_schema is required when response_format.type is "json_schema"')
    if spec.schema_ is None:
        raise RequestError("response_format.json_schema.schema is required")
    return Grammar("json_schema", json.dumps(spec.schema_), "response_format.json_schema.schema")


def extra_grammar(req: _SamplingFields) -> Grammar | None:
    """SGLang's `json_schema` / `regex` / `ebnf` request fields; at most one may be set."""
    try:
        return Grammar.from_fields({name: getattr(req, name) for name in GRAMMAR_EXTRAS}, GRAMMAR_EXTRAS)
    except ValueError as e:
        raise RequestError(str(e)) from None


def request_grammar(req: _SamplingFields, forced_tools: Grammar | None = None) -> Grammar | None:
    """The request's one grammar, or None. `forced_tools` is the grammar of a forced tool
    call (tools.py), which excludes every other constraint."""
    fmt = response_format_grammar(req.response_format)
    extra = extra_grammar(req)
    if fmt is not None and extra is not None:
        raise RequestError(f"response_format and {extra.field} cannot be used together: set one of them")
    own = fmt or extra
    if forced_tools is not None and own is not None:
        top = own.field.split(".")[0]
        raise RequestError(f'tool_choice forces a tool call, so {top} cannot be used with it (or use tool_choice "auto")')
    return forced_tools or own


def check_grammar(tm: "TokenizerManager", grammar: Grammar | None) -> None:
    """Compiles the grammar once in the TokenizerManager, so an invalid one is a 400 naming
    its field before the request is queued."""
    if grammar is not None:
        tm.check_grammar(grammar.kind, grammar.text, field=grammar.field)
