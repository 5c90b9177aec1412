"""N-gram speculative decoding (--speculative-algorithm ngram) end to end: an fp32 Engine with
it on, whose greedy output must equal the plain engine's, token for token, whatever ends a
request and whatever else shares its batch, without leaking KV (the drafter alone:
tests/unit/test_ngram_drafter.py)."""

from __future__ import annotations

import re
import threading
import time

import httpx
import orjson
import pytest

from engine_utils import LONG, PRESSURE, PROMPTS, plain_outputs, wait_idle
from server_utils import ServerProcess

# Prompts whose greedy continuations repeat (so drafts get accepted) or do not.
REPETITIVE = [
    "Count: 1, 2, 3, 4, 5, 6,",
    "red green blue red green blue red green blue red",
    "time person year way day thing man world life hand part child eye woman place work week",
    "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):",
]
GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}


def wait_for(cond, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def spec_engine():
    from srt_lite import Engine

    eng = Engine(dtype="float32", max_total_tokens=20000, log_level="warning", speculative_algorithm="ngram")
    yield eng
    eng.shutdown()


def assert_idle(eng) -> None:
    load = wait_idle(eng)
    assert load.kv_used_tokens == 0 and load.num_running_reqs == 0 and load.num_waiting_reqs == 0
    assert load.invariant_ok
    assert load.kv_free_tokens + load.kv_cached_tokens == load.kv_capacity


def accept_len(eng) -> float:
    load = eng.get_load()
    return load.spec_new_tokens / max(load.spec_verified_rows, 1)


@pytest.mark.slow
def test_greedy_output_equals_plain_decoding_alone_and_batched(engine, spec_engine):
    prompts = REPETITIVE + PROMPTS[:4]
    plain = [o["output_ids"] for o in plain_outputs(engine, prompts, GREEDY)]
    before = spec_engine.get_load()
    alone = [spec_engine.generate(p, GREEDY)["output_ids"] for p in prompts]
    assert alone == plain
    after = spec_engine.get_load()
    # Drafts were verified and accepted: more than one token per verifying step on average.
    rows = after.spec_verified_rows - before.spec_verified_rows
    assert rows > 0 and (after.spec_new_tokens - before.spec_new_tokens) / rows > 1.5
    spec_engine.flush_cache()
    together = spec_engine.generate(prompts, GREEDY)
    assert [o["output_ids"] for o in together] == plain
    assert_idle(spec_engine)


def test_a_request_drafts_from_an_earlier_requests_output(spec_engine):
    """The same question asked again: its whole answer is drafted from the first answer (the
    shared n-grams start in the prompt's last tokens), and the output is unchanged."""
    prompt = PROMPTS[2]
    params = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    spec_engine.flush_cache()  # also forgets the text of the requests before
    before = spec_engine.get_load()
    first = spec_engine.generate(prompt, params)
    mid = spec_engine.get_load()
    second = spec_engine.generate(prompt, params)
    after = spec_engine.get_load()
    assert second["output_ids"] == first["output_ids"]
    first_rows = mid.spec_verified_rows - before.spec_verified_rows
    second_rows = after.spec_verified_rows - mid.spec_verified_rows
    # 47 tokens after the prefill's first: at most 15 drafts + 1 per step.
    assert second_rows <= 4 and second_rows < first_rows, (first_rows, second_rows)
    assert_idle(spec_engine)


def test_requests_end_inside_an_accepted_run_as_without_drafts(engine, spec_engine):
    """max_new_tokens, stop strings, stop token ids and EOS cut a run of accepted tokens at
    the same token as plain decoding; the rest of the run's KV is freed."""
    cases = [
        ("Count: 1, 2, 3, 4, 5, 6,", {"max_new_tokens": 13, "temperature": 0, "ignore_eos": True}),
        ("Count: 1, 2, 3, 4, 5, 6,", {"max_new_tokens": 30, "temperature": 0, "stop": [" 11,"]}),
        ("Count: 1, 2, 3, 4, 5, 6,", {"max_new_tokens": 30, "temperature": 0, "stop": " 12,", "no_stop_trim": True}),
        (REPETITIVE[1], {"max_new_tokens": 1, "temperature": 0}),
        (REPETITIVE[1], {"max_new_tokens": 2, "temperature": 0}),
    ]
    base = engine.generate(cases[0][0], {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True})
    cases.append((cases[0][0], {"max_new_tokens": 30, "temperature": 0, "stop_token_ids": [base["output_ids"][9]]}))
    tm = engine.tokenizer_manager
    chat = tm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat after me: la la la la la la la la"}], tokenize=False, add_generation_prompt=True
    )
    cases.append((chat, {"max_new_tokens": 64, "temperature": 0}))
    for prompt, params in cases:
        want, got = engine.generate(prompt, params), spec_engine.generate(prompt, params)
        assert got["output_ids"] == want["output_ids"], params
        assert got["text"] == want["text"], params
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], params
    assert_idle(spec_engine)


def test_constrained_rows_decode_without_drafts_beside_drafting_rows(engine, spec_engine):
    """A request with a grammar never drafts (NgramProposer.eligible), so its text is the
    plain engine's; the drafting rows beside it keep drafting and keep their text."""
    regex = {"max_new_tokens": 40, "temperature": 0, "regex": "(red|green|blue)( (red|green|blue)){5}"}
    want = [engine.generate(REPETITIVE[1], regex)["output_ids"]] + [o["output_ids"] for o in plain_outputs(engine, REPETITIVE, GREEDY)]
    before = spec_engine.get_load()
    got = spec_engine.generate([REPETITIVE[1], *REPETITIVE], [regex] + [GREEDY] * len(REPETITIVE))
    assert [o["output_ids"] for o in got] == want
    assert got[0]["meta_info"]["finish_reason"]["type"] == "stop"
    assert spec_engine.get_load().spec_verified_rows > before.spec_verified_rows
    assert_idle(spec_engine)


def test_drafting_rows_share_batches_with_sampled_penalized_and_logprob_requests(engine, spec_engine):
    """Rows that cannot draft decode one token as usual next to rows that verify drafts, and
    a prompt-logprobs request can join the batch mid-way (logits for every position)."""
    greedy_want = [o["output_ids"] for o in plain_outputs(engine, REPETITIVE, {**GREEDY, "max_new_tokens": 60})]
    lp_params = {"max_new_tokens": 6, "temperature": 0}
    lp_want = engine.generate(PROMPTS[1], lp_params, return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    results: dict[str, dict] = {}

    def run(name: str, prompt: str, params: dict, **kw) -> None:
        results[name] = spec_engine.generate(prompt, params, **kw)

    threads = [threading.Thread(target=run, args=(f"g{i}", p, {**GREEDY, "max_new_tokens": 60})) for i, p in enumerate(REPETITIVE)]
    threads += [
        threading.Thread(target=run, args=("sampled", PROMPTS[0], {"max_new_tokens": 30, "temperature": 0.8, "seed": 1})),
        threading.Thread(target=run, args=("penalty", PROMPTS[2], {"max_new_tokens": 30, "temperature": 0, "frequency_penalty": 1.0})),
        threading.Thread(target=run, args=("lp", PROMPTS[1], lp_params),
                         kwargs={"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}),
    ]
    for i, t in enumerate(threads):
        t.start()
        if i == len(REPETITIVE):
            threading.Event().wait(0.3)  # the others join while the greedy ones are decoding
    for t in threads:
        t.join()
    assert [results[f"g{i}"]["output_ids"] for i in range(len(REPETITIVE))] == greedy_want
    assert len(results["sampled"]["output_ids"]) == 30
    assert results["penalty"]["output_ids"] == engine.generate(
        PROMPTS[2], {"max_new_tokens": 30, "temperature": 0, "frequency_penalty": 1.0}
    )["output_ids"]
    got, want = results["lp"]["meta_info"], lp_want["meta_info"]
    assert results["lp"]["output_ids"] == lp_want["output_ids"]
    assert [t for _, t, *_ in got["input_token_logprobs"]] == [t for _, t, *_ in want["input_token_logprobs"]]
    for (a, *_), (b, *_) in zip(got["input_token_logprobs"][1:], want["input_token_logprobs"][1:]):
        assert a == pytest.approx(b, abs=1e-3)
    assert len(got["output_token_logprobs"]) == 6
    assert_idle(spec_engine)


@pytest.mark.slow
@PRESSURE
def test_pressure_and_no_radix_cache_keep_output_and_free_rejected_drafts(engine, kwargs):
    """With a KV cache too small for the batch, drafts shrink to what fits, requests are
    retracted and resumed; without the radix cache, rejected and finished slots go straight
    back to the free list. The output is still the plain greedy output."""
    from srt_lite import Engine

    prompts = REPETITIVE + PROMPTS + [LONG]
    want = [o["output_ids"] for o in plain_outputs(engine, prompts, GREEDY)]
    with Engine(dtype="float32", log_level="warning", speculative_algorithm="ngram", **kwargs) as eng:
        got = eng.generate(prompts, GREEDY)
        assert [o["output_ids"] for o in got] == want
        load = wait_idle(eng)
        if kwargs["max_total_tokens"] == 160:
            assert load.num_retractions > 0
        assert load.spec_verified_rows > 0
        assert load.kv_used_tokens == 0 and load.invariant_ok
        assert load.kv_free_tokens + load.kv_cached_tokens == load.kv_capacity


def test_server_streams_drafted_tokens_like_the_benchmark_client(engine):
    """The workloads' request through HTTP: streamed /v1/completions with EOS banned by
    logit_bias, greedy. Chunks may carry several tokens; the text, the token count and the
    finish reason equal plain decoding, and the decode log and /metrics report the accept
    length."""
    prompt = REPETITIVE[2]
    want = engine.generate(prompt, {"max_new_tokens": 64, "temperature": 0, "logit_bias": {"0": -100, "2": -100}})
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": {"0": -100, "2": -100}}
    with ServerProcess("--dtype", "float32", "--speculative-algorithm", "ngram", "--decode-log-interval", "5",
                       "--max-total-tokens", "4096", "--enable-metrics") as s:
        body["model"] = httpx.get(s.base_url + "/v1/models").json()["data"][0]["id"]
        chunks, usage, finish = [], None, None
        with httpx.stream("POST", s.base_url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = orjson.loads(line[6:])
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    chunks.append(choice["text"])
                    finish = choice.get("finish_reason") or finish
        assert "".join(chunks) == want["text"]
        assert usage["completion_tokens"] == 64 and finish == "length"
        assert len([c for c in chunks if c]) < 64  # several tokens per step
        assert "accept len: " in s.read_log()
        metrics = httpx.get(s.base_url + "/metrics").text
        line = next(ln for ln in metrics.splitlines() if ln.startswith("srt_lite:spec_accept_length{"))
        assert float(line.rsplit(" ", 1)[1]) > 1.5


@pytest.mark.slow
def test_short_prompts_joining_mid_way_leave_the_drafting_rows_drafting(engine):
    """A short prompt that joins a running batch makes a mixed step; the running greedy
    request keeps verifying drafts in it (the prefill log counts them), and both outputs
    equal plain decoding."""
    long_prompt, short_prompts = REPETITIVE[2], REPETITIVE[:2] + REPETITIVE[3:]
    long_params = {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}
    short_params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    want_long = engine.generate(long_prompt, long_params)["text"]
    want_short = [o["text"] for o in plain_outputs(engine, short_prompts, short_params)]
    with ServerProcess("--dtype", "float32", "--speculative-algorithm", "ngram", "--max-total-tokens", "4096") as s:
        model = httpx.get(s.base_url + "/v1/models").json()["data"][0]["id"]
        got_long = {}

        def run_long() -> None:
            body = {"model": model, "prompt": long_prompt, "max_tokens": 160, "temperature": 0, "ignore_eos": True}
            got_long["text"] = httpx.post(s.base_url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

        thread = threading.Thread(target=run_long)
        thread.start()
        wait_for(lambda: "Prefill batch" in s.read_log())  # the long request is running
        got_short = []
        for p in short_prompts:
            body = {"model": model, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            got_short.append(httpx.post(s.base_url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"])
        thread.join()
        log = s.read_log()
    assert got_long["text"] == want_long and got_short == want_short
    drafted = [int(m) for m in re.findall(r"Prefill batch\..*#draft-token: (\d+)", log)]
    assert drafted and max(drafted) > 0, log[-2000:]


@pytest.mark.slow
def test_tensor_parallel_ranks_draft_and_accept_alike(engine):
    """Every rank drafts from the same tokens and accepts from the same (all-gathered)
    logits, so a TP server with drafting still gives the plain greedy text."""
    prompts = REPETITIVE[:3]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    want = [o["text"] for o in engine.generate(prompts, params)]
    with ServerProcess("--tp-size", "3", "--dtype", "float32", "--max-total-tokens", "4096",
                       "--speculative-algorithm", "ngram", "--decode-log-interval", "4") as s:
        r = httpx.post(s.base_url + "/generate", json={"text": prompts, "sampling_params": params}, timeout=300)
        assert [o["text"] for o in r.json()] == want
        assert "accept len: " in s.read_log()
