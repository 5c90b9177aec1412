"""N-gram speculative decoding (--speculative-algorithm ngram): the drafter's pieces, and an
fp32 Engine with it on whose greedy output must equal the plain engine's, token for token,
whatever ends a request and whatever else shares its batch, without leaking KV."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import pytest

from engine_utils import LONG, PRESSURE, PROMPTS, plain_outputs, wait_idle
from server_utils import ServerProcess
from srt_lite.req import Req
from srt_lite.sampling.sampling_params import SamplingParams
from srt_lite.speculative.ngram import PROBE_INTERVAL, AcceptStats, NgramIndex, NgramProposer, SharedNgramTable, accept_greedy

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


# ---- drafter pieces ----------------------------------------------------------------------


def test_index_finds_the_longest_latest_match_and_never_the_tail_itself():
    ix = NgramIndex(1, 3)
    # Tail (5, 6) occurred at 0..1 and was followed by 7, 8, 5, 6.
    assert ix.propose([5, 6, 7, 8, 5, 6], 4) == [7, 8, 5, 6]
    ix = NgramIndex(1, 3)
    assert ix.propose([1, 2, 3], 3) == []  # nothing repeats
    # The longer match (2, 9) wins over the more recent 1-gram (9).
    ix = NgramIndex(1, 2)
    assert ix.propose([2, 9, 4, 9, 5, 2, 9], 1) == [4]
    # Incremental: later calls index the new tokens only, and still see the old ones.
    ix = NgramIndex(1, 2)
    toks = [3, 4, 5]
    assert ix.propose(toks, 2) == []
    toks += [3]
    assert ix.propose(toks, 2) == [4, 5]


def test_index_holds_the_latest_end_of_every_ngram_before_the_last_position():
    """Grown in random pieces, the index equals a brute-force table: every n-gram
    (min_n <= n <= max_n) ending at a position before the last, mapped to its latest end."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        tokens = [rng.randint(0, 5) for _ in range(rng.randint(0, 50))]
        ix = NgramIndex(min_n, max_n)
        for cut in sorted(rng.sample(range(len(tokens) + 1), min(3, len(tokens) + 1))) + [len(tokens)]:
            ix.extend(tokens[:cut])
            want = {}
            for end in range(1, cut):
                for n in range(min_n, min(max_n, end) + 1):
                    want[tuple(tokens[end - n : end])] = end
            assert ix.ends == want


def test_a_loop_shorter_than_the_draft_is_copied_over_itself():
    assert NgramIndex(1, 3).propose([7, 1, 1, 1], 5) == [1, 1, 1, 1, 1]
    assert NgramIndex(1, 3).propose([7, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_accept_greedy_takes_the_matching_prefix_and_the_model_token_after_it():
    assert accept_greedy([7, 8, 9], [7, 8, 9, 10]) == [7, 8, 9, 10]
    assert accept_greedy([7, 8, 9], [7, 8, 4, 1]) == [7, 8, 4]
    assert accept_greedy([7, 8, 9], [5, 8, 9, 10]) == [5]
    assert accept_greedy([], [3]) == [3]


def test_cost_model_drafts_more_when_cheap_or_likely():
    p = NgramProposer(8, 1, 4)
    # A lone request: draft tokens are nearly free, so even a coin flip drafts several.
    assert p.num_worth_drafting(0.5, 0.5, 100, 1) >= 4
    assert p.num_worth_drafting(0.95, 0.95, 300, 1) == 8
    # Monotone: more with a higher acceptance rate, fewer with bigger batches and contexts.
    for b in (1, 8, 16, 64):
        ks = [p.num_worth_drafting(q, q, 300, b) for q in (0.1, 0.3, 0.5, 0.7, 0.9)]
        assert ks == sorted(ks)
        assert p.num_worth_drafting(0.5, 0.9, 300, b) >= p.num_worth_drafting(0.5, 0.5, 300, b)
    assert p.num_worth_drafting(0.5, 0.5, 300, 16) < p.num_worth_drafting(0.5, 0.5, 300, 1)
    assert p.num_worth_drafting(0.5, 0.5, 4000, 16) <= p.num_worth_drafting(0.5, 0.5, 300, 16)
    assert p.num_worth_drafting(0.1, 0.9, 1000, 16) == 0


def test_acceptance_is_learned_per_source_and_tail_length():
    """A kind of match whose drafts fail stops drafting in a busy batch (probing now and
    then) while another kind keeps drafting; the estimates follow the observed rates."""
    stats = AcceptStats()
    for _ in range(40):
        stats.observe(4, 1)  # first token always accepted, the second never
    first, later = stats.rates()
    assert first > 0.9 and later < 0.15
    p = NgramProposer(4, 1, 2)

    def req(prompt: list[int], output: list[int]) -> Req:
        r = Req("r", prompt, SamplingParams(max_new_tokens=50, temperature=0))
        r.output_ids = output
        return r

    for _ in range(10):  # prompt matches of length 2 fail (drafted alone, where it is cheap)...
        r = req([1, 2, 9, 1], [2])
        r.draft_ids = p.propose(r, room=10, batch_size=1)
        assert r.draft_ids
        p.observe(r, 0)
    assert p.stats[("prompt", 2)].rates()[0] < 0.2
    drafts = [len(p.propose(req([1, 2, 9, 1], [2]), room=10, batch_size=32)) for _ in range(PROBE_INTERVAL)]
    assert drafts == [0] * (PROBE_INTERVAL - 1) + [1]
    # ...while a request repeating its own output still drafts in the same batch.
    assert p.propose(req([5], [6, 7, 6, 7, 6]), room=10, batch_size=32)


def test_only_plain_greedy_requests_draft():
    p = NgramProposer(4, 1, 3)

    def req(**params) -> Req:
        r = Req("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_new_tokens=50, **params))
        r.output_ids = [3]
        return r

    assert p.propose(req(temperature=0), room=10, batch_size=1) == [1, 2, 3, 1]
    assert p.propose(req(temperature=0), room=2, batch_size=1) == [1, 2]
    for params in ({"temperature": 0.7}, {"temperature": 0, "frequency_penalty": 0.5},
                   {"temperature": 0, "repetition_penalty": 1.2}, {"temperature": 0, "min_new_tokens": 5}):
        assert p.propose(req(**params), room=10, batch_size=1) == []
    r = req(temperature=0)
    r.return_logprob = True
    assert p.propose(r, room=10, batch_size=1) == []


def test_drafts_come_from_own_output_then_other_requests_output_then_own_prompt():
    p = NgramProposer(4, 1, 2)

    def req(prompt: list[int], output: list[int]) -> Req:
        r = Req("r", prompt, SamplingParams(max_new_tokens=50, temperature=0))
        r.output_ids = output
        return r

    # Request a generated 7 8 9 after the prompt tail 5 6; its n-grams go to the shared table
    # as it decodes (propose indexes them), pointing into its live output list.
    a = req([1, 5, 6], [7, 8, 9])
    p.propose(a, room=10, batch_size=1)
    # b's tail 5 6 occurs in its own prompt (followed by 2) and in a's text (followed by 7 8 9):
    # another request's generated text beats a prompt match.
    b = req([5, 6, 2, 3, 5], [6])
    assert p.propose(b, room=10, batch_size=1) == [7, 8, 9]
    # a's continuation grows while a decodes.
    a.output_ids.append(10)
    assert p.propose(req([4, 5, 6, 0, 5], [6]), room=10, batch_size=1) == [7, 8, 9, 10]
    # The request's own generated text beats both.
    c = req([5, 6, 2], [5, 6, 4, 5, 6])
    assert p.propose(c, room=10, batch_size=1) == [4, 5, 6, 4]
    # With no shared match, a prompt match still drafts.
    assert p.propose(req([3, 1, 2, 3, 3], [1]), room=10, batch_size=1) == [2, 3, 3, 1]


def test_shared_table_is_bounded_and_never_drafts_a_request_from_itself():
    table = SharedNgramTable(1, 2, capacity=6)
    index = NgramIndex(1, 2)
    r = Req("r", [1, 2], SamplingParams(max_new_tokens=50, temperature=0))
    r.output_ids = [3, 4, 5, 6, 7]
    table.add(r, index, r.fill_ids)
    assert len(table.ends) <= 6
    assert table.match((6,), exclude=[]) == (r.output_ids, 4)  # the newest n-grams stay
    assert table.match((1, 2), exclude=[]) is None  # the oldest went first
    assert table.match((6,), exclude=r.output_ids) is None
    table.add(r, index, r.fill_ids)  # nothing new: indexing is incremental
    assert index.shared_indexed == 5


def test_replay_tool_measures_drafting_without_the_model():
    """benchmarks/replay_drafts.py: looping outputs yield several tokens per row and step, a
    request asked again after another yields its whole output in a few steps, and text that
    never repeats yields one token per step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from replay_drafts import replay

    loop = ([1, 2, 3], [4, 5, 6] * 10)
    r = replay([loop], concurrency=1, proposer=NgramProposer(8, 1, 4))
    assert r["tokens_per_row_step"] > 3 and r["accepted"] <= r["drafted"]
    fresh = ([7, 8], list(range(100, 130)))
    alone = replay([fresh], concurrency=1, proposer=NgramProposer(8, 1, 4))
    assert alone["tokens_per_row_step"] == 1.0 and alone["accepted"] == 0
    again = replay([fresh, fresh], concurrency=1, proposer=NgramProposer(8, 1, 4))
    assert again["row_steps"] <= alone["row_steps"] + 5


# ---- engine -----------------------------------------------------------------------------


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
