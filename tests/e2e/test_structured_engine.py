"""Structured outputs through the whole engine: json_schema, regex and ebnf in sampling_params,
with batching, n > 1, seeds, logprobs, stop strings, retraction, chunked prefill, speculative
decoding, another backend and tensor parallelism."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine_utils import PROMPTS, chat_ids, wait_idle
from srt_lite import Engine
from srt_lite.managers.validation import RequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
}
PROMPT = "Describe a person as JSON with name, age and hobbies."
GREEDY = {"max_new_tokens": 96, "temperature": 0}
LONG_PROMPT = "Here is a long story about a river that runs through a valley. " * 6 + "Describe its owner as JSON:"
FREE_PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


def schema_params(**extra) -> dict:
    return {**GREEDY, "json_schema": json.dumps(SCHEMA), **extra}


def assert_valid(out: dict) -> dict:
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    value = json.loads(out["text"])
    jsonschema.validate(value, SCHEMA)
    return value


def test_json_schema_greedy_and_seeded_sampled_outputs_validate(engine, tokenizer):
    ids = chat_ids(tokenizer, PROMPT)
    greedy = engine.generate(input_ids=ids, sampling_params=schema_params())
    assert_valid(greedy)
    sampled = engine.generate(input_ids=ids, sampling_params=schema_params(temperature=0.9, top_p=0.95, seed=3))
    assert_valid(sampled)
    again = engine.generate(input_ids=ids, sampling_params=schema_params(temperature=0.9, top_p=0.95, seed=3))
    assert again["text"] == sampled["text"]


def test_every_choice_of_n_follows_the_grammar(engine, tokenizer):
    outs = engine.generate(input_ids=chat_ids(tokenizer, PROMPT), sampling_params=schema_params(temperature=1.0, n=4))
    assert len(outs) == 4
    for out in outs:
        assert_valid(out)
    assert len({o["text"] for o in outs}) > 1  # sampled independently, a matcher each


def test_regex_and_ebnf(engine):
    phone = engine.generate("My phone number is", {**GREEDY, "regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone["text"]) and phone["meta_info"]["finish_reason"]["type"] == "stop"
    answer = engine.generate("Is the sky green? Answer:", {**GREEDY, "ebnf": 'root ::= "yes" | "no" | "maybe"'})
    assert answer["text"] in ("yes", "no", "maybe")


def test_structural_tag_in_xgrammars_format(engine):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag", "begin": "<answer>", "end": "</answer>",
            "content": {"type": "json_schema", "json_schema": {"type": "object", "properties": {"x": {"enum": ["yes", "no"]}}, "required": ["x"]}},
        },
    }
    out = engine.generate("Answer with a number:", {**GREEDY, "structural_tag": json.dumps(tag)})
    m = re.fullmatch(r"<answer>(.*)</answer>", out["text"], re.DOTALL)
    assert m and json.loads(m.group(1))["x"] in ("yes", "no"), out["text"]


def test_constrained_and_free_requests_share_batches_without_touching_the_free_ones(engine, tokenizer):
    free = [{"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}] * len(FREE_PROMPTS)
    alone = [o["output_ids"] for o in engine.generate(FREE_PROMPTS, free)]
    ids = chat_ids(tokenizer, PROMPT)
    prompts = [ids, *(tokenizer.encode(p) for p in FREE_PROMPTS), ids]
    mixed = engine.generate(input_ids=prompts, sampling_params=[schema_params(), *free, schema_params(regex=None)])
    assert [o["output_ids"] for o in mixed[1:4]] == alone
    assert_valid(mixed[0])
    assert mixed[4]["text"] == mixed[0]["text"]


def test_logprobs_and_stop_strings_work_under_a_grammar(engine, tokenizer):
    ids = chat_ids(tokenizer, PROMPT)
    full = engine.generate(input_ids=ids, sampling_params=schema_params(), return_logprob=True, top_logprobs_num=2)
    n = full["meta_info"]["completion_tokens"]
    lps = full["meta_info"]["output_token_logprobs"]
    assert len(lps) == n and [t for _, t, _ in lps] == full["output_ids"]
    assert all(lp <= 0 for lp, _, _ in lps)
    # A stop string inside the constrained text ends it there, as without a grammar.
    stop = '"age"'
    cut = engine.generate(input_ids=ids, sampling_params=schema_params(stop=[stop]))
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert full["text"].startswith(cut["text"]) and stop not in cut["text"]


def test_invalid_grammars_are_refused_before_queueing(engine):
    for params, field in [({"regex": "a(b"}, "regex"), ({"ebnf": "root ::= foo"}, "ebnf"), ({"json_schema": "{"}, "json_schema")]:
        with pytest.raises(RequestError, match=field):
            engine.generate("Hi", {**GREEDY, **params})
    assert wait_idle(engine).num_waiting_reqs == 0


@pytest.fixture(scope="module")
def pressured():
    """Under KV pressure (retraction), with small prefill chunks."""
    with Engine(dtype="float32", log_level="warning", max_total_tokens=160, chunked_prefill_size=32, skip_server_warmup=True) as eng:
        yield eng


@pytest.mark.slow
def test_retraction_and_chunked_prefill_leave_constrained_outputs_alone(engine, pressured):
    """8 requests of ~40 tokens each cannot all fit in 160 KV slots: running requests are
    retracted and resumed, their matchers keeping their place. A prompt longer than a chunk
    is computed in several steps before its first constrained token."""
    constrained = [f"Person number {i} described as JSON:" for i in range(4)]
    free = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    want = [o["text"] for o in engine.generate(constrained + PROMPTS[:4], [schema_params()] * 4 + [free] * 4)]
    for text in want[:4]:
        jsonschema.validate(json.loads(text), SCHEMA)
    outs = pressured.generate(constrained + PROMPTS[:4], [schema_params()] * 4 + [free] * 4)
    assert [o["text"] for o in outs] == want
    load = wait_idle(pressured)
    assert load.num_retractions > 0 and load.invariant_ok and load.kv_used_tokens == 0
    long = pressured.generate(LONG_PROMPT, schema_params())
    assert long["meta_info"]["prompt_tokens"] > 2 * 32
    assert long["text"] == engine.generate(LONG_PROMPT, schema_params())["text"]


@pytest.mark.slow
def test_tensor_parallel_ranks_apply_the_same_mask(engine, tokenizer):
    ids = chat_ids(tokenizer, PROMPT)
    want = engine.generate(input_ids=ids, sampling_params=schema_params())["text"]
    with Engine(dtype="float32", log_level="warning", tp_size=3, max_total_tokens=4096, skip_server_warmup=True) as eng:
        outs = eng.generate(input_ids=[ids, ids], sampling_params=[schema_params(), schema_params(regex=None, n=1)])
        assert [o["text"] for o in outs] == [want, want]
        bad = eng.generate("Hi", {**GREEDY, "regex": "[0-9]{2}"})
        assert re.fullmatch("[0-9]{2}", bad["text"])


@pytest.mark.parametrize("backend", ["llguidance", "none"])
def test_other_grammar_backends(backend, tokenizer):
    with Engine(dtype="float32", log_level="warning", grammar_backend=backend, max_total_tokens=2048, skip_server_warmup=True) as eng:
        if backend == "none":
            with pytest.raises(RequestError, match="--grammar-backend none"):
                eng.generate("Hi", {**GREEDY, "regex": "a+"})
        else:
            assert_valid(eng.generate(input_ids=chat_ids(tokenizer, PROMPT), sampling_params=schema_params()))
            answer = eng.generate("Is the sky green? Answer:", {**GREEDY, "ebnf": 'root ::= "yes" | "no" | "maybe"'})
            assert answer["text"] in ("yes", "no", "maybe")
            with pytest.raises(RequestError, match="structural_tag is not supported"):
                eng.generate("Hi", {**GREEDY, "structural_tag": '{"format": {}}'})
        assert eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
        assert wait_idle(eng).invariant_ok
