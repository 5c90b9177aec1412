"""The TokenizerManager's public surface against a stand-in scheduler (no model, no child
processes): the n-choice fan-out, abort on early close, draining, and the request
normaliser shared by POST /generate and the Engine."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from fake_scheduler import FakeScheduler
from srt_lite.managers.tokenizer.generate_request import normalize_generate_request
from srt_lite.managers.io_struct import PortArgs, SchedulerReady
from srt_lite.managers.tokenizer.tokenizer_manager import Overloaded, TokenizerManager
from srt_lite.managers.validation import LogprobOptions, RequestError
from srt_lite.server_args import ServerArgs

CONTEXT_LEN = 512
VOCAB = 49152  # the default model's tokenizer


@pytest.fixture(scope="module")
def model_dir(default_model_dir) -> str:
    return default_model_dir


def make_tm(model_dir: str, **args) -> tuple[TokenizerManager, PortArgs]:
    port_args = PortArgs.create()
    info = SchedulerReady(
        tp_rank=0, max_total_num_tokens=4096, max_context_len=CONTEXT_LEN, max_running_requests=8,
        vocab_size=VOCAB, device="cpu", dtype="float32",
    )
    return TokenizerManager(ServerArgs(**args), port_args, model_dir, info), port_args


def run_with_scheduler(model_dir: str, body, **args):
    """Runs `body(tm, scheduler)` in a fresh loop with a stand-in scheduler."""

    async def main():
        tm, port_args = make_tm(model_dir, **args)
        scheduler = FakeScheduler(port_args)
        task = asyncio.ensure_future(scheduler.run())
        try:
            return await asyncio.wait_for(body(tm, scheduler), 20)
        finally:
            task.cancel()
            tm.close()
            scheduler.close()
            shutil.rmtree(port_args.ipc_dir, ignore_errors=True)

    return asyncio.run(main())


def params(tm: TokenizerManager, **d):
    return tm.make_sampling_params(d)


async def until(condition, timeout: float = 5.0) -> None:
    """Aborts go out without a reply; give the stand-in scheduler time to read them."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.005)


# ---- the n-choice fan-out -------------------------------------------------------------------


def test_generate_all_prefills_once_then_samples_n_choices_with_seed_offsets(model_dir):
    async def body(tm, scheduler):
        p = params(tm, n=3, seed=5, max_new_tokens=2)
        outs = await tm.generate_all([[1, 2, 3]], [p])
        return outs, scheduler.requests

    outs, requests = run_with_scheduler(model_dir, body)
    prefill, *samples = requests
    assert prefill.sampling_params["max_new_tokens"] == 0 and prefill.input_ids == [1, 2, 3]
    assert sorted(r.sampling_params["seed"] for r in samples) == [5, 6, 7]
    assert all(r.sampling_params["n"] == 1 and not r.stream for r in samples)
    # Whole results, in choice order: choice i sampled with seed 5 + i.
    assert [o["output_ids"] for o in outs] == [[5, 5], [6, 6], [7, 7]]
    assert all(o["text"] == "xx" and o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)


def test_generate_choices_streams_every_choice_of_every_prompt(model_dir):
    async def body(tm, scheduler):
        p = params(tm, n=2, seed=1, max_new_tokens=3)
        texts: dict[int, str] = {}
        async for i, chunk in tm.generate_choices([[1], [2, 2]], [p, p], rids=["r-0", "r-1", "r-2", "r-3"]):
            texts[i] = texts.get(i, "") + chunk["text"]
        return texts, scheduler.requests, tm.num_in_flight()

    texts, requests, in_flight = run_with_scheduler(model_dir, body)
    assert texts == {0: "xxx", 1: "xxx", 2: "xxx", 3: "xxx"}
    sampled = {r.rid: r for r in requests if r.sampling_params["max_new_tokens"] > 0}
    assert set(sampled) == {"r-0", "r-1", "r-2", "r-3"}
    assert sampled["r-2"].input_ids == [2, 2] and sampled["r-2"].sampling_params["seed"] == 1
    assert all(r.stream for r in sampled.values())
    assert in_flight == 0


def test_closing_the_choices_early_aborts_every_unfinished_choice(model_dir):
    async def body(tm, scheduler):
        p = params(tm, n=3, max_new_tokens=40)
        choices = tm.generate_choices([[1, 2]], [p], rids=["a", "b", "c"])
        await choices.__anext__()
        assert tm.num_in_flight() == 3
        await choices.aclose()
        in_flight = tm.num_in_flight()
        await until(lambda: len(scheduler.aborts) == 3)
        return in_flight, scheduler

    in_flight, scheduler = run_with_scheduler(model_dir, body)
    assert in_flight == 0
    assert sorted(scheduler.aborts) == ["a", "b", "c"]


def test_an_overloaded_choice_fails_the_request_and_aborts_the_others(model_dir):
    async def body(tm, scheduler):
        p = params(tm, n=3, max_new_tokens=40)
        with pytest.raises(Overloaded):
            await tm.generate_all([[1]], [p], rids=["a", "b", "c"])
        in_flight = tm.num_in_flight()
        await until(lambda: len(scheduler.aborts) == 2)
        return in_flight, scheduler.aborts

    # Room for the prefill, then for two choices; the third is refused and the two admitted
    # ones, unfinished, are aborted rather than left running for nobody.
    in_flight, aborts = run_with_scheduler(model_dir, body, max_running_requests=1, max_queued_requests=1)
    assert in_flight == 0
    assert sorted(aborts) == ["a", "b"]


# ---- draining ---------------------------------------------------------------------------


def test_the_first_grammar_check_asks_the_scheduler_to_build_its_backend_once(model_dir):
    """The scheduler hears of grammars before the first check's import starts (so the two
    builds overlap), once per server whatever the grammars; invalid ones are still refused here."""

    async def body(tm, scheduler):
        tm.check_grammar("regex", "a+", field="regex")
        await until(lambda: scheduler.prepares > 0)
        tm.check_grammar("json_schema", '{"type": "object"}', field="json_schema")
        with pytest.raises(RequestError, match="Invalid regex"):
            tm.check_grammar("regex", "a(b", field="regex")
        await asyncio.sleep(0.05)
        return scheduler.prepares

    assert run_with_scheduler(model_dir, body) == 1


def test_no_grammar_backend_sends_no_announcement(model_dir):
    async def body(tm, scheduler):
        with pytest.raises(RequestError, match="structured outputs are off"):
            tm.check_grammar("regex", "a+", field="regex")
        await asyncio.sleep(0.05)
        return scheduler.prepares

    assert run_with_scheduler(model_dir, body, grammar_backend="none") == 0


def test_drain_refuses_new_requests_and_wait_idle_follows_requests_in_flight(model_dir):
    async def body(tm, scheduler):
        assert not tm.draining and await tm.wait_idle(0.01)

        async def consume(gen):
            return [out async for out in gen]

        task = asyncio.ensure_future(consume(tm.generate([1, 2], params(tm, max_new_tokens=25))))
        await asyncio.sleep(0.01)
        assert tm.num_in_flight() == 1
        assert not await tm.wait_idle(0.01)
        tm.drain()
        assert tm.draining
        with pytest.raises(Overloaded, match="shutting down"):
            await tm.generate([1], params(tm, max_new_tokens=1)).__anext__()
        assert await tm.wait_idle(10)
        (out,) = await task
        return out, tm.num_in_flight()

    out, in_flight = run_with_scheduler(model_dir, body)
    assert out["meta_info"]["completion_tokens"] == 25 and in_flight == 0


# ---- the request normaliser -------------------------------------------------------------


@pytest.fixture(scope="module")
def tm(model_dir):
    manager, port_args = make_tm(model_dir)
    yield manager
    shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


def test_normalise_text_single_and_batch(tm):
    req = normalize_generate_request(tm, text="Hello there", sampling_params={"max_new_tokens": 4})
    assert req.input_ids == [tm.tokenize("Hello there")] and not req.is_batch
    assert req.params[0].max_new_tokens == 4 and req.rids == [None]
    assert req.shape([{"a": 1}]) == {"a": 1}
    req = normalize_generate_request(tm, text=["a", "b"], sampling_params=[{"max_new_tokens": 1}, {"max_new_tokens": 2}])
    assert req.is_batch and [p.max_new_tokens for p in req.params] == [1, 2]
    assert req.shape([{"a": 1}]) == [{"a": 1}]


def test_normalise_input_ids_forms(tm):
    assert normalize_generate_request(tm, input_ids=[5, 6]).input_ids == [[5, 6]]
    req = normalize_generate_request(tm, input_ids=[[5], (6, 7)])
    assert req.is_batch and req.input_ids == [[5], [6, 7]]
    assert normalize_generate_request(tm, input_ids=(5, 6)).input_ids == [[5, 6]]


def test_n_choices_shape_and_rids(tm):
    req = normalize_generate_request(tm, text="Hi", sampling_params={"n": 3, "max_new_tokens": 2}, rid="x")
    assert req.shape([1, 2, 3]) == [1, 2, 3]
    assert req.choice_rids() == [None, None, None]  # a client rid names only a single choice
    req = normalize_generate_request(
        tm, input_ids=[[1], [2]], sampling_params=[{"n": 2, "max_new_tokens": 1}, {"max_new_tokens": 1}], rid=["a", "b"]
    )
    assert req.choice_rids() == [None, None, "b"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "give exactly one of text or input_ids"),
        ({"text": "a", "input_ids": [1]}, "give exactly one of text or input_ids"),
        ({"text": 5}, "text must be a string or a non-empty list of strings"),
        ({"text": []}, "text must be a string or a non-empty list of strings"),
        ({"input_ids": "12"}, "input_ids must be a non-empty list"),
        ({"input_ids": []}, "the prompt is empty"),
        ({"input_ids": [[1], 2]}, "must not mix token ids and lists"),
        ({"input_ids": [1, -5]}, "input_ids must be integers"),
        ({"input_ids": [7] * CONTEXT_LEN}, "context length"),
        ({"input_ids": [7] * 10, "sampling_params": {"max_new_tokens": CONTEXT_LEN}}, "maximum context length"),
        ({"text": "a", "sampling_params": "hot"}, "sampling_params must be an object"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": ["a"], "sampling_params": [{}, {}]}, "one entry per prompt"),
        ({"text": ["a", "b"], "sampling_params": [{}, 3]}, "each sampling_params entry must be an object"),
        ({"text": ["a", "b"], "rid": "x"}, "rid must be a list for a batch"),
        ({"text": "a", "rid": 5}, "rid must be a string"),
        ({"text": ["a", "b"], "rid": ["x"]}, "rid must be a string"),
        ({"text": ["a", "b"], "stream": True}, "stream=true takes a single prompt with n == 1"),
        ({"text": "a", "sampling_params": {"n": 2}, "stream": True}, "stream=true takes a single prompt"),
    ],
)
def test_normalise_rejects_with_a_clear_message(tm, kwargs, message):
    with pytest.raises(RequestError, match=message):
        normalize_generate_request(tm, **kwargs)


def test_normalise_names_the_callers_text_field(tm):
    with pytest.raises(RequestError, match="give exactly one of prompt or input_ids"):
        normalize_generate_request(tm, text_field="prompt")
    with pytest.raises(RequestError, match="prompt must be a string"):
        normalize_generate_request(tm, text=[1], text_field="prompt")


def test_normalise_keeps_the_logprob_options_and_stream(tm):
    lp = LogprobOptions(return_logprob=True, top_logprobs_num=2)
    req = normalize_generate_request(tm, text="a", stream=True, logprobs=lp)
    assert req.stream and req.logprobs is lp
