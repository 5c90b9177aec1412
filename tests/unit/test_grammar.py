"""Grammar backends, the bitmask, the reasoning-aware matcher, the grammar queue and the
sampler's masking, without a model."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Callable

import pytest
import torch

from srt_lite.constrained import backend_class
from srt_lite.constrained.base import GrammarError
from srt_lite.constrained.bitmask import allocate_bitmask, allow_token, apply_bitmask
from srt_lite.constrained.reasoning import ReasoningMatcher, ThinkTags
from srt_lite.managers.scheduler.grammar_manager import GrammarManager
from srt_lite.req import Req
from srt_lite.sampling.sampler import Sampler
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo
from srt_lite.sampling.sampling_params import Grammar, SamplingParams

VOCAB = 49152
EOS = 2
BACKENDS = ["xgrammar", "llguidance"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, tokenizer):
    return backend_class(request.param)(tokenizer, VOCAB, [EOS])


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.view(-1).nonzero().squeeze(1).tolist())


def run_text(tokenizer, backend, kind: str, grammar: str, text: str):
    """Feeds `text` (then EOS) through a fresh matcher, checking each token was allowed."""
    m = backend.matcher(backend.compile(kind, grammar))
    bitmask = allocate_bitmask(1, VOCAB)
    for tok in tokenizer.encode(text, add_special_tokens=False) + [EOS]:
        if m.is_terminated():
            break
        m.fill_bitmask(bitmask, 0)
        if tok not in allowed(bitmask, 0):
            return m, False
        assert m.accept(tok)
    return m, True


@pytest.mark.parametrize(
    "kind, text, message",
    [
        ("regex", "a(b", "parenthesis|regex"),
        ("json_schema", '{"type": "integer", "minimum": "x"}', "number|f64"),
        ("ebnf", "root ::= foo", "foo"),
    ],
)
@pytest.mark.parametrize("name", BACKENDS)
def test_check_rejects_bad_grammars_with_the_libraries_reason(name, kind, text, message):
    cls = backend_class(name)
    with pytest.raises(GrammarError) as e:
        cls.check(kind, text)
    assert re.search(message, str(e.value)), str(e.value)
    assert not str(e.value).startswith("[")  # no C++ timestamp or source location
    cls.check(kind, {"regex": "[a-z]+", "json_schema": json.dumps(SCHEMA), "ebnf": 'root ::= "yes" | "no"'}[kind])


def test_unknown_or_missing_backends_are_named():
    assert backend_class("none") is None
    with pytest.raises(GrammarError, match="unknown grammar backend"):
        backend_class("outlines")


@pytest.mark.parametrize(
    "kind, grammar, good, bad",
    [
        ("json_schema", json.dumps(SCHEMA), '{"name": "Ann", "age": 31}', '{"name": "Ann", "age": "x"}'),
        ("regex", r"\d{3}-\d{4}", "555-1234", "555-12a4"),
        ("ebnf", 'root ::= "yes" | "no"', "no", "maybe"),
    ],
)
def test_matchers_allow_exactly_the_grammars_texts(tokenizer, backend, kind, grammar, good, bad):
    m, ok = run_text(tokenizer, backend, kind, grammar, good)
    assert ok and m.is_terminated()
    _, ok = run_text(tokenizer, backend, kind, grammar, bad)
    assert not ok


NUMBERS = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "r": {"type": "number", "minimum": 0},
        "code": {"type": "string", "pattern": "^[0-9]+$"}, "tag": {"type": "string", "maxLength": 3},
    },
    "required": ["n", "x", "r", "code", "tag"],
}


@pytest.mark.parametrize(
    "text, ok",
    [
        ('{"n": -1234567890123456, "x": 1.1234567890123456e-123, "r": 1234567890123456.5, "code": "123456789012345678901", "tag": "abc"}', True),
        ('{"n": 12345678901234567, "x": 1, "r": 1, "code": "1", "tag": "a"}', False),  # 17 integer digits
        ('{"n": 1, "x": 1.12345678901234567, "r": 1, "code": "1", "tag": "a"}', False),  # 17 fraction digits
        ('{"n": 1, "x": 1e1234, "r": 1, "code": "1", "tag": "a"}', False),  # 4 exponent digits
        ('{"n": 1, "x": 1, "r": 12345678901234567, "code": "1", "tag": "a"}', False),  # a ranged number too
        ('{"n": 1, "x": 1, "r": 1, "code": "1", "tag": "abcd"}', False),  # maxLength still holds
    ],
)
def test_json_numbers_are_bounded_where_a_double_ends(tokenizer, text, ok):
    """xgrammar's JSON grammar caps integer and fraction digits at 16 and exponent digits at 3,
    so a model that repeats a digit cannot write until max_tokens; a string's own pattern
    (digits included) is not capped."""
    backend = backend_class("xgrammar")(tokenizer, VOCAB, [EOS])
    m, accepted = run_text(tokenizer, backend, "json_schema", json.dumps(NUMBERS), text)
    assert accepted == ok and (not ok or m.is_terminated())


def test_padded_vocabulary_rows_are_never_allowed(tokenizer):
    """The model's logits may be wider than the tokenizer's vocabulary: the padding is masked."""
    padded = VOCAB + 64
    b = backend_class("xgrammar")(tokenizer, padded, [EOS])
    m = b.matcher(b.compile("json_schema", '{"type": "object"}'))
    bitmask = allocate_bitmask(1, padded)
    m.fill_bitmask(bitmask, 0)
    assert max(allowed(bitmask, 0)) < VOCAB


def test_apply_bitmask_equals_xgrammars_kernel_and_only_touches_listed_rows():
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    for vocab in (VOCAB, 1000):  # 1000: the last word is part padding
        logits = torch.randn(4, vocab, generator=gen)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
        ours, theirs = logits.clone(), logits.clone()
        apply_bitmask(ours, bitmask, [1, 3])
        xgr.apply_token_bitmask_inplace(theirs, bitmask, indices=[1, 3])
        assert torch.equal(ours, theirs)
        assert torch.equal(ours[[0, 2]], logits[[0, 2]])


def test_allow_token_sets_one_bit_including_the_sign_bit():
    bitmask = torch.zeros(2, 4, dtype=torch.int32)
    for tok in (0, 31, 33, 127):
        allow_token(bitmask, 1, tok)
    assert allowed(bitmask, 1) == {0, 31, 33, 127} and allowed(bitmask, 0) == set()


# ---- reasoning ----------------------------------------------------------------------------


def feed(tokenizer, m, text: str) -> list[bool]:
    """Per token of `text`: was it allowed by the mask before being accepted."""
    bitmask = allocate_bitmask(1, VOCAB)
    seen = []
    for tok in tokenizer.encode(text, add_special_tokens=False):
        if m.constrains_next():
            m.fill_bitmask(bitmask, 0)
            seen.append(tok in allowed(bitmask, 0))
        else:
            seen.append(True)
        m.accept(tok)
    return seen


def allows(m, tok: int) -> bool:
    bitmask = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(bitmask, 0)
    return tok in allowed(bitmask, 0)


@pytest.mark.parametrize("forced", [True, False])
def test_reasoning_is_free_and_the_grammar_starts_after_the_think_block(tokenizer, backend, forced):
    tags = ThinkTags.from_tokenizer(tokenizer)
    m = ReasoningMatcher(backend.matcher(backend.compile("regex", "[0-9]+")), tags, in_reasoning=forced)
    text = ("" if forced else "<think>") + "Free words, {not} digits!</think>"
    assert all(feed(tokenizer, m, text))
    assert m.constrains_next()
    assert not allows(m, tokenizer.encode("a", add_special_tokens=False)[0])  # the answer is the grammar's
    assert all(feed(tokenizer, m, "42"))


def test_without_a_think_block_the_grammar_applies_from_the_first_token(tokenizer, backend):
    tags = ThinkTags.from_tokenizer(tokenizer)
    m = ReasoningMatcher(backend.matcher(backend.compile("regex", "[0-9]+")), tags, in_reasoning=False)
    bitmask = allocate_bitmask(1, VOCAB)
    m.fill_bitmask(bitmask, 0)
    first = allowed(bitmask, 0)
    assert tags.start_ids[0] in first  # the model may open a think block...
    assert tokenizer.encode("hello", add_special_tokens=False)[0] not in first  # ...or answer under the grammar
    assert all(feed(tokenizer, m, "7"))
    assert not allows(m, tags.start_ids[0])  # once answering, no more thinking


# ---- the grammar queue --------------------------------------------------------------------


def grammar_req(rid: str, **grammar) -> Req:
    return Req(rid, [1, 2, 3], SamplingParams.from_dict(grammar))


def drain(mgr: GrammarManager, timeout: float = 30.0) -> list[Req]:
    out, deadline = [], time.monotonic() + timeout
    while len(mgr) and time.monotonic() < deadline:
        mgr.wait(0.05)
        out += mgr.ready()
    return out


def test_queue_compiles_once_per_grammar_and_keeps_arrival_order(tokenizer):
    backend = backend_class("xgrammar")(tokenizer, VOCAB, [EOS])
    calls = []
    compile_ = backend.compile
    backend.compile = lambda kind, text: calls.append(kind) or compile_(kind, text)
    mgr = GrammarManager(lambda: backend, None)
    schema = json.dumps(SCHEMA)
    reqs = [grammar_req("a", json_schema=schema), grammar_req("b", regex="x+"), grammar_req("c", json_schema=schema)]
    for r in reqs:
        mgr.add(r)
    out = drain(mgr)
    assert [r.rid for r in out] == ["a", "b", "c"]
    assert sorted(calls) == ["json_schema", "regex"]
    assert out[0].grammar is not out[2].grammar  # a matcher each, from one compiled grammar
    assert not any(r.finished for r in out)


def counted_builds(tokenizer) -> tuple[Callable[[], Any], list]:
    """A backend factory for GrammarManager and the list of the backends it has built."""
    built = []
    def make():
        built.append(backend_class("xgrammar")(tokenizer, VOCAB, [EOS]))
        return built[-1]
    return make, built


def test_queue_builds_its_backend_once_at_the_first_grammar(tokenizer):
    make, built = counted_builds(tokenizer)
    mgr = GrammarManager(make, None)
    assert built == [] and mgr.backend is None  # nothing until a request has a grammar
    mgr.add(grammar_req("a", regex="a+"))
    mgr.add(grammar_req("b", regex="b+"))
    assert [r.rid for r in drain(mgr)] == ["a", "b"]
    assert len(built) == 1 and mgr.backend is built[0]


def test_prepare_builds_the_backend_before_any_grammar_and_only_once(tokenizer):
    make, built = counted_builds(tokenizer)
    mgr = GrammarManager(make, None)
    mgr.prepare()
    mgr.prepare()  # the announcement of every TP rank's first grammar is one build
    mgr.pool.submit(lambda: None).result()  # the pool's one thread has run what was queued
    assert len(built) == 1 and mgr.backend is built[0]
    mgr.add(grammar_req("a", regex="a+"))
    assert [r.rid for r in drain(mgr)] == ["a"] and len(built) == 1


def test_a_prepared_build_that_failed_fails_the_requests_with_its_error():
    tries = []

    def make():
        tries.append(1)
        raise RuntimeError("no tokenizer here")

    mgr = GrammarManager(make, None)
    mgr.prepare()
    mgr.add(grammar_req("a", regex="a+"))
    (a,) = drain(mgr)
    assert a.finished_reason["type"] == "abort" and "no tokenizer here" in a.finished_reason["message"]
    assert len(tries) == 2  # the compile tried again and reported what went wrong


def test_prepare_without_a_backend_does_nothing():
    mgr = GrammarManager(None, None)
    mgr.prepare()
    assert mgr.backend is None and mgr.pool is None


def test_queue_fails_requests_when_its_backend_cannot_be_built():
    def make():
        raise RuntimeError("no tokenizer here")

    mgr = GrammarManager(make, None)
    mgr.add(grammar_req("a", regex="a+"))
    (a,) = drain(mgr)
    assert a.finished_reason["type"] == "abort" and "no tokenizer here" in a.finished_reason["message"]


def test_queue_fails_bad_grammars_and_aborts_waiting_requests(tokenizer):
    backend = backend_class("xgrammar")(tokenizer, VOCAB, [EOS])
    mgr = GrammarManager(lambda: backend, None)
    mgr.add(grammar_req("bad", regex="a(b"))
    mgr.add(grammar_req("gone", regex="a+"))
    assert [r.rid for r in mgr.abort("gone")] == ["gone"]
    (bad,) = drain(mgr)
    assert bad.finished_reason["type"] == "abort" and "Invalid regex" in bad.finished_reason["message"]
    off = GrammarManager(None, None)
    off.add(grammar_req("x", regex="a+"))
    (x,) = drain(off)
    assert "--grammar-backend none" in x.finished_reason["message"]


# ---- sampling -----------------------------------------------------------------------------


class OnlyTokens:
    """A stand-in matcher that allows a fixed set of tokens."""

    def __init__(self, tokens: set[int]):
        self.tokens = tokens

    def constrains_next(self) -> bool:
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.tokens:
            allow_token(bitmask, row, t)


def sampling_reqs(grammars: list, **params) -> list[Req]:
    reqs = []
    for i, g in enumerate(grammars):
        r = Req(str(i), [5, 6], SamplingParams(**params))
        r.grammar = g
        if params.get("seed") is not None:
            r.generator = torch.Generator().manual_seed(params["seed"])
        reqs.append(r)
    return reqs


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, seed=7)])
def test_sampler_masks_constrained_rows_and_leaves_free_rows_alone(params):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=gen)
    logits[:, 100] = 50.0  # the free favourite, which the grammar forbids
    sampler = Sampler(0, "cpu")
    mixed = sampling_reqs([None, OnlyTokens({7, 9}), None], **params)
    out = sampler(logits, SamplingBatchInfo.from_reqs(mixed, VOCAB, "cpu", {EOS})).next_ids.tolist()
    free = sampling_reqs([None, None, None], **params)
    alone = sampler(logits, SamplingBatchInfo.from_reqs(free, VOCAB, "cpu", {EOS})).next_ids.tolist()
    assert out[1] in {7, 9}
    assert out[0] == alone[0] == 100 and out[2] == alone[2] == 100


def test_the_mask_comes_after_logit_bias_and_overrides_it():
    logits = torch.zeros(1, VOCAB)
    reqs = sampling_reqs([OnlyTokens({7})], temperature=0.0, logit_bias={"100": 100.0})
    out = Sampler(0, "cpu")(logits, SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu", {EOS}))
    assert out.next_ids.tolist() == [7]


def test_batch_info_keeps_grammars_aligned_through_filter_merge_and_repeat():
    g1, g2 = OnlyTokens({1}), OnlyTokens({2})
    info = SamplingBatchInfo.from_reqs(sampling_reqs([None, g1, None]), VOCAB, "cpu", {EOS})
    info.merge(SamplingBatchInfo.from_reqs(sampling_reqs([g2]), VOCAB, "cpu", {EOS}))
    assert info.grammars == [None, g1, None, g2] and info.needs_adjustment
    assert info.repeat_rows([2, 1, 1, 1]).grammars == [None, None, g1, None, g2]
    info.filter([3, 0])
    assert info.grammars == [g2, None]
    info.filter([1])
    assert info.grammars is None and not info.needs_adjustment
    plain = SamplingBatchInfo.from_reqs(sampling_reqs([None]), VOCAB, "cpu", {EOS})
    plain.merge(SamplingBatchInfo.from_reqs(sampling_reqs([g1]), VOCAB, "cpu", {EOS}))
    assert plain.grammars == [None, g1]


def test_min_new_tokens_does_not_ban_the_stop_of_a_constrained_row():
    reqs = sampling_reqs([OnlyTokens({EOS}), None], temperature=0.0, min_new_tokens=5)
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu", {EOS})
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    assert Sampler(0, "cpu")(logits, info).next_ids.tolist()[0] == EOS
    assert info.min_tokens_ban[1, EOS] and not info.min_tokens_ban[0].any()


# ---- request fields -----------------------------------------------------------------------


def test_sampling_params_take_one_grammar_and_check_json():
    p = SamplingParams.from_dict({"json_schema": SCHEMA})
    assert p.grammar.kind == "json_schema" and json.loads(p.grammar.text) == SCHEMA
    assert SamplingParams.from_dict({"regex": "a+"}).grammar == Grammar("regex", "a+", "regex")
    assert SamplingParams.from_dict({}).grammar is None
    # The scheduler gets the grammar back under its kind's name, as a client sends it.
    assert SamplingParams.from_dict(p.to_dict()).grammar == p.grammar
    assert "grammar" not in p.to_dict() and SamplingParams.from_dict(SamplingParams().to_dict()).grammar is None
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"grammar": "a+"})
    with pytest.raises(ValueError, match="at most one of"):
        SamplingParams.from_dict({"regex": "a", "ebnf": 'root ::= "a"'})
    with pytest.raises(ValueError, match="json_schema is not valid JSON"):
        SamplingParams.from_dict({"json_schema": "{nope"})
    with pytest.raises(ValueError, match="regex must be a string"):
        SamplingParams.from_dict({"regex": 5})
