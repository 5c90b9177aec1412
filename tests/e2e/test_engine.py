"""The three-process engine through the Python Engine API."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine_utils import PROMPTS, wait_idle
from srt_lite.managers.tokenizer.tokenizer_manager import RequestError

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def assert_idle(engine):
    load = wait_idle(engine)
    assert load.kv_used_tokens == 0 and load.num_running_reqs == 0 and load.num_waiting_reqs == 0
    assert load.invariant_ok
    assert load.kv_free_tokens + load.kv_cached_tokens == load.kv_capacity


def test_output_shape(engine):
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert set(meta) >= {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "e2e_latency"}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 8
    assert meta["finish_reason"]["type"] == "length"
    assert "Paris" in out["text"]
    assert out["text"] == engine.tokenizer_manager.tokenizer.decode(out["output_ids"])


def test_concurrent_equals_alone(engine):
    alone = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    engine.flush_cache()
    together = engine.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in together] == alone
    # And sent concurrently from threads, arriving while others are decoding.
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        time.sleep(0.02 * i)
        results[i] = engine.generate(PROMPTS[i], GREEDY)["output_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(PROMPTS))] == alone
    assert_idle(engine)


def test_prefix_cache_hit_and_flush(engine):
    prompt = "Prefix caching test: " + "the quick brown fox jumps over the lazy dog " * 8
    assert_idle(engine)
    assert engine.flush_cache()
    first = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0})
    assert first["meta_info"]["cached_tokens"] == 0
    second = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0})
    n = second["meta_info"]["prompt_tokens"]
    assert second["meta_info"]["cached_tokens"] == n - 1
    assert second["output_ids"] == first["output_ids"]
    assert engine.flush_cache()
    third = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0})
    assert third["meta_info"]["cached_tokens"] == 0


def test_stream_chunks_concatenate_to_full_text(engine):
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = engine.generate("Here is a short poem about the moon:", params)
    chunks = list(engine.generate("Here is a short poem about the moon:", params, stream=True))
    assert len(chunks) > 3
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_stream_closed_early_aborts_and_frees_kv(engine):
    aborted = engine.get_load().num_aborted_reqs
    it = engine.generate("Count from one to one thousand:", {"max_new_tokens": 2000, "ignore_eos": True}, stream=True)
    for i, _ in enumerate(it):
        if i == 3:
            break
    it.close()
    assert_idle(engine)
    assert engine.get_load().num_aborted_reqs == aborted + 1  # ended by the abort, not by its length


def test_abort_running_and_waiting(engine):
    rids = []
    results = {}

    async def one(i):
        tm = engine.tokenizer_manager
        params = tm.make_sampling_params({"max_new_tokens": 3000, "ignore_eos": True})
        rid = f"abort-{i}"
        rids.append(rid)
        async for out in tm.generate(tm.tokenize(f"Story number {i}:"), params, rid=rid):
            results[i] = out

    async def main():
        tasks = [asyncio.ensure_future(one(i)) for i in range(3)]
        await asyncio.sleep(1.0)
        for rid in list(rids):
            await engine.tokenizer_manager.abort(rid)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)

    asyncio.run_coroutine_threadsafe(main(), engine.loop).result(60)
    for i in range(3):
        assert results[i]["meta_info"]["finish_reason"]["type"] == "abort"
        assert results[i]["meta_info"]["completion_tokens"] < 3000
    assert_idle(engine)


def test_finish_reasons(engine):
    tm = engine.tokenizer_manager
    # max_new_tokens
    out = engine.generate("Hi", {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "matched": None, "length": 5}
    # EOS: a chat prompt the model answers briefly
    prompt = tm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    out = engine.generate(prompt, {"max_new_tokens": 64, "temperature": 0})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert "Paris" in out["text"]
    # stop string: never reaches the client, reported as matched
    base = engine.generate("Count: 1, 2, 3,", {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True})
    assert " 5," in base["text"]
    out = engine.generate("Count: 1, 2, 3,", {"max_new_tokens": 20, "temperature": 0, "stop": [" 5,"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 5,"}
    assert out["text"] == base["text"][: base["text"].index(" 5,")]
    out = engine.generate(
        "Count: 1, 2, 3,", {"max_new_tokens": 20, "temperature": 0, "stop": " 5,", "no_stop_trim": True}
    )
    assert out["text"].endswith(" 5,")
    # stop_token_ids: the first generated token of base stops it at once
    first = base["output_ids"][0]
    out = engine.generate("Count: 1, 2, 3,", {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": [first]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert out["output_ids"] == [first]
    assert_idle(engine)


def test_invalid_requests_raise_clear_errors(engine):
    with pytest.raises(RequestError, match="temperature"):
        engine.generate("Hi", {"temperature": -1})
    with pytest.raises(RequestError, match="unknown sampling parameter"):
        engine.generate("Hi", {"bogus": 1})
    with pytest.raises(RequestError, match="context length"):
        engine.generate(input_ids=[5] * 9000)
    with pytest.raises(RequestError, match="prompt is empty"):
        engine.generate(input_ids=[])
    with pytest.raises(RequestError, match="input_ids"):
        engine.generate(input_ids=[1, 2, 10**9])
    assert_idle(engine)


def test_async_generate_and_input_ids(engine):
    ids = engine.tokenizer_manager.tokenize("The capital of France is")

    async def main():
        out = await engine.async_generate(input_ids=ids, sampling_params={"max_new_tokens": 6, "temperature": 0})
        chunks = [c async for c in await engine.async_generate(
            input_ids=ids, sampling_params={"max_new_tokens": 6, "temperature": 0}, stream=True)]
        return out, chunks

    out, chunks = asyncio.run(main())
    assert "Paris" in out["text"]
    assert "".join(c["text"] for c in chunks) == out["text"]


def test_burst_with_shared_prompt_prefills_it_once(engine):
    """Requests arriving together with one long common prefix: the first computes it, the
    others wait a step and hit the cache (in-batch prefix check), outputs unchanged."""
    system = "You are a careful assistant. " + "Answer briefly and precisely, with facts. " * 20
    prompts = [system + f"Question {i}: name a colour." for i in range(4)]
    alone = []
    for p in prompts:
        assert engine.flush_cache()
        alone.append(engine.generate(p, GREEDY)["output_ids"])
    assert engine.flush_cache()
    together = engine.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in together] == alone
    prefix = len(engine.tokenizer_manager.tokenize(system)) - 2  # the last tokens may merge
    cached = sorted(o["meta_info"]["cached_tokens"] for o in together)
    assert cached[0] == 0 and all(c >= prefix for c in cached[1:]), cached
