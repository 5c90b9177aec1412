"""The request side of structured outputs and tools, without a server: response_format and
the grammar extras -> one grammar, the checks on tools / tool_choice, and the grammars that
force tool calls (each compiled by xgrammar and matched against sample outputs)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from srt_lite.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from srt_lite.entrypoints.openai.structured import request_grammar
from srt_lite.sampling.sampling_params import Grammar
from srt_lite.entrypoints.openai.tools import ToolPlan, new_tool_call_id, plan_tools
from srt_lite.managers.validation import RequestError
from openai_helpers import WEATHER

USER = [{"role": "user", "content": "hi"}]
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def error(fn, *args) -> str:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return str(e.value)


# ---- response_format and the extras ---------------------------------------------------------


def test_response_format_mapping():
    assert request_grammar(chat()) is None
    assert request_grammar(chat(response_format={"type": "text"})) is None
    g = request_grammar(chat(response_format={"type": "json_object"}))
    assert g == Grammar("json_schema", '{"type": "object"}', "response_format")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    g = request_grammar(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}))
    assert g.kind == "json_schema" and json.loads(g.text) == schema
    assert g.field == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    "tag",
    [
        {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]},
        {"format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
            {"begin": "<f>", "content": {"type": "json_schema", "json_schema": {"type": "object"}}, "end": "</f>"}]}},
    ],
)
def test_structural_tag_passes_on_whole(tag):
    """SGLang's structural_tag response format, in its old and its current form, reaches the
    backend as the whole object, which the backend accepts."""
    from srt_lite.constrained.xgrammar_backend import XGrammarBackend

    g = request_grammar(chat(response_format={"type": "structural_tag", **tag}))
    assert g.kind == "structural_tag" and json.loads(g.text) == {"type": "structural_tag", **tag}
    XGrammarBackend.check(g.kind, g.text)
    assert "structures" in error(request_grammar, chat(response_format={"type": "structural_tag"}))


def test_response_format_errors_name_the_field():
    msg = error(request_grammar, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}))
    assert "response_format.json_schema.schema" in msg
    assert "response_format.json_schema" in error(request_grammar, chat(response_format={"type": "json_schema"}))


@pytest.mark.parametrize("kind", ["regex", "ebnf", "json_schema"])
def test_extras_on_chat_and_completions(kind):
    for req in (chat(**{kind: "x"}), CompletionRequest.model_validate({"prompt": "p", kind: "x"})):
        assert request_grammar(req) == Grammar(kind, "x", kind)


def test_extras_conflicts_name_both_fields():
    msg = error(request_grammar, chat(regex="a+", ebnf='root ::= "a"'))
    assert "regex" in msg and "ebnf" in msg
    msg = error(request_grammar, chat(regex="a+", response_format={"type": "json_object"}))
    assert "regex" in msg and "response_format" in msg
    completion = CompletionRequest.model_validate({"prompt": "p", "json_schema": "{}", "response_format": {"type": "json_object"}})
    msg = error(request_grammar, completion)
    assert "json_schema" in msg and "response_format" in msg
    # "text" is no constraint, so it combines with anything
    assert request_grammar(chat(regex="a+", response_format={"type": "text"})).kind == "regex"


def test_forced_tool_call_excludes_other_grammars():
    req = chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    msg = error(request_grammar, req, plan_tools(req).grammar())
    assert "tool_choice" in msg and "response_format" in msg
    req = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, regex="a")
    msg = error(request_grammar, req, plan_tools(req).grammar())
    assert "tool_choice" in msg and "regex" in msg
    # "auto" forces nothing: a response_format may come along
    req = chat(tools=[WEATHER], tool_choice="auto", response_format={"type": "json_object"})
    assert request_grammar(req, plan_tools(req).grammar()).field == "response_format"


# ---- tools and tool_choice ------------------------------------------------------------------


def test_tool_choice_defaults_and_modes():
    assert plan_tools(chat()).mode == "none"
    assert plan_tools(chat(tools=[WEATHER])).mode == "auto"
    plan = plan_tools(chat(tools=[WEATHER, TIME], tool_choice="none"))
    assert plan.mode == "none" and not plan.render_tools and plan.parser_format("hermes") is None
    plan = plan_tools(chat(tools=[WEATHER, TIME]))
    assert plan.render_tools and plan.parser_format("hermes") == "hermes" and plan.grammar() is None
    assert plan.names == {"get_weather", "get_time"}
    assert plan_tools(chat(tools=[WEATHER], tool_choice="required")).parser_format("hermes") == "json_array"
    named = plan_tools(chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.mode == "named" and named.named == "get_weather" and named.parser_format("hermes") is None
    # "auto" and "none" need no tools
    assert plan_tools(chat(tool_choice="auto")).render_tools is False
    assert plan_tools(chat(tool_choice="none")).mode == "none"


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": [WEATHER, {"type": "function"}]}, "tools[1].function"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ],
)
def test_tool_errors_name_the_field(fields, named):
    assert named in error(plan_tools, chat(**fields))


def test_tool_call_parser_flag_offers_every_format():
    """server_args sits below the parser layer, so it lists the formats itself."""
    import dataclasses

    from srt_lite.parser.tool_call_parser import SUPPORTED_FORMATS
    from srt_lite.server_args import ServerArgs

    flag = next(f for f in dataclasses.fields(ServerArgs) if f.name == "tool_call_parser")
    assert tuple(flag.metadata["choices"]) == SUPPORTED_FORMATS


def test_tool_call_ids():
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


# ---- the grammars that force calls ----------------------------------------------------------


def forced(**fields) -> tuple[ToolPlan, dict]:
    plan = plan_tools(chat(tools=[WEATHER, TIME], **fields))
    return plan, json.loads(plan.grammar().text)


def test_required_schema():
    plan, schema = forced(tool_choice="required")
    assert plan.grammar().field == "tools" and plan.grammar().kind == "json_schema"
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    _, one = forced(tool_choice="required", parallel_tool_calls=False)
    assert one["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)


def test_named_schema_is_the_parameters():
    plan, schema = forced(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert schema == WEATHER["function"]["parameters"]
    assert plan.grammar().field == "tools[0].function.parameters"
    _, empty = forced(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert empty == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "choice,accepted,rejected",
    [
        ("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', '[{"name": "get_weather", "arguments": {}}]'),
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo"}', '{"town": "Oslo"}'),
    ],
)
def test_forced_grammars_compile_in_xgrammar(tokenizer, choice, accepted, rejected):
    """What the scheduler will enforce: xgrammar accepts a right call and refuses a wrong one."""
    xgr = pytest.importorskip("xgrammar")
    plan, _ = forced(tool_choice=choice)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(plan.grammar().text)

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts(accepted)
    assert not accepts(rejected)
