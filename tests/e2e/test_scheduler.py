"""Scheduling under pressure: eviction, retraction, chunked prefill, small batches, fcfs and a
disabled radix cache must all give the same greedy text as the unconstrained engine."""

from __future__ import annotations

import pytest

from engine_utils import LONG, PRESSURE, PROMPTS, wait_idle
from srt_lite import Engine

PARAMS = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(engine):
    return [o["output_ids"] for o in engine.generate(PROMPTS + [LONG], PARAMS)]


@pytest.mark.slow
@PRESSURE
def test_outputs_unchanged_under_pressure(kwargs, reference):
    with Engine(dtype="float32", log_level="warning", **kwargs) as eng:
        outs = eng.generate(PROMPTS + [LONG], PARAMS)
        assert [o["output_ids"] for o in outs] == reference
        assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        # A second round reuses what the cache kept, and still agrees.
        again = eng.generate(PROMPTS + [LONG], PARAMS)
        assert [o["output_ids"] for o in again] == reference
        load = wait_idle(eng)
        assert load.invariant_ok and load.kv_used_tokens == 0
        if kwargs["max_total_tokens"] == 160:
            assert load.num_retractions > 0
            assert load.evicted_tokens > 0
        else:
            assert load.kv_cached_tokens == 0  # nothing is kept without the radix cache
            assert all(o["meta_info"]["cached_tokens"] == 0 for o in again)


@pytest.fixture(scope="module")
def small_kv():
    """An engine whose whole KV cache is 64 tokens, shared by the tests that leave it idle."""
    with Engine(dtype="float32", log_level="warning", max_total_tokens=64) as eng:
        yield eng


def test_prompt_larger_than_kv_is_rejected_not_queued(small_kv):
    out = small_kv.generate(input_ids=list(range(10, 110)), sampling_params={"max_new_tokens": 4})
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert "KV cache" in out["meta_info"]["finish_reason"]["message"]
    ok = small_kv.generate("Hi", {"max_new_tokens": 4, "temperature": 0})
    assert ok["meta_info"]["finish_reason"]["type"] == "length"
    assert wait_idle(small_kv).invariant_ok


def test_single_request_longer_than_kv_ends_with_length(small_kv):
    assert small_kv.flush_cache()  # the whole cache free, whatever the test before kept
    out = small_kv.generate("Hello", {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0})
    fr = out["meta_info"]["finish_reason"]
    assert fr["type"] == "length"
    # The prompt plus what it generated fills the cache (the last token needs no KV).
    assert out["meta_info"]["prompt_tokens"] + out["meta_info"]["completion_tokens"] == 64 + 1
    assert wait_idle(small_kv).invariant_ok
