"""Two srt_lite workers behind the real SGLang router (`sglang-router`): it registers them under
the served model name with no fallback warnings, the official openai client works through it,
cache_aware keeps each shared prefix on the worker that holds it, and a killed worker is routed
around once the router notices."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from router_utils import FAST_HEALTH_CHECKS, RouterProcess, kill_worker, start_workers, worker_counters
from srt_lite.model_loader.default_model import DEFAULT_MODEL_NAME

WORKER_ARGS = ("--dtype", "float32", "--max-total-tokens", "16384", "--enable-cache-report", "--enable-metrics")
# Two long, different system prompts: far more than the router's 30% match threshold of each
# request's text, and different from their first character on.
PREFIX = {
    "a": "You are a patient museum guide. " + "Answer in one sentence about art and artists. " * 12,
    "b": "Tu es un chef cuisinier. " + "Reponds en une phrase sur la cuisine et les recettes. " * 12,
}
QUESTIONS = ["What should I see first?", "Tell me something surprising.", "Give me one tip."]


@pytest.fixture(scope="module")
def fleet():
    workers = start_workers(2, *WORKER_ARGS)
    router = RouterProcess([w.base_url for w in workers], "cache_aware", *FAST_HEALTH_CHECKS)
    try:
        router.wait_ready()
        yield router, workers
    finally:
        router.stop()
        for w in workers:
            w.__exit__(None, None, None)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(base_url: str, prefix: str, question: str, max_tokens: int = 8, **kw):
    return client(base_url).chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "system", "content": PREFIX[prefix]}, {"role": "user", "content": question}],
        max_tokens=max_tokens, temperature=0, **kw,
    )


def test_router_registers_workers_under_the_served_name(fleet):
    router, workers = fleet
    assert [m.id for m in client(router.base_url).models.list().data] == [DEFAULT_MODEL_NAME]
    registered = router.workers()
    assert {w["model_id"] for w in registered} == {DEFAULT_MODEL_NAME}
    assert all(w["metadata"]["model_path"] for w in registered)
    log = router.read_log()
    # The deprecated-endpoint fallback and the missing tokenizer path were the two warnings.
    assert "falling back" not in log and "No tokenizer_path" not in log, log
    loads = httpx.get(router.base_url + "/get_loads", timeout=10).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(w.base_url for w in workers)
    # Idle workers: a load of 0 (the router reports -1 for a worker whose /get_load it cannot read).
    assert [w["load"] for w in loads] == [0] * len(workers), loads


def test_openai_client_through_the_router(fleet):
    router, workers = fleet
    direct = chat(workers[0].base_url, "a", QUESTIONS[0]).choices[0].message.content
    assert chat(router.base_url, "a", QUESTIONS[0]).choices[0].message.content == direct
    streamed = chat(router.base_url, "a", QUESTIONS[0], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == direct
    text = client(router.base_url).completions.create(
        model=DEFAULT_MODEL_NAME, prompt="The capital of France is", max_tokens=6, temperature=0
    ).choices[0].text
    assert text and text == client(workers[1].base_url).completions.create(
        model=DEFAULT_MODEL_NAME, prompt="The capital of France is", max_tokens=6, temperature=0
    ).choices[0].text
    native = httpx.post(router.base_url + "/generate", json={
        "text": "The capital of France is", "sampling_params": {"max_new_tokens": 6, "temperature": 0},
    }, timeout=60).json()
    assert native["text"] == text


def test_cache_aware_keeps_each_prefix_on_the_worker_that_has_it(fleet):
    router, workers = fleet
    assert httpx.post(router.base_url + "/flush_cache", timeout=30).status_code == 200
    urls = [w.base_url for w in workers]
    before = {u: worker_counters(u)["num_requests_total"] for u in urls}
    # Prefix a arrives while the fleet is idle; prefix b arrives while a's long stream keeps
    # one worker busy, so it starts on the other one (the less loaded; no cache matches it).
    stream = chat(router.base_url, "a", QUESTIONS[0], max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    holder_a = next(u for u in urls if worker_counters(u)["num_running_reqs"] == 1)
    assert chat(router.base_url, "b", QUESTIONS[0]).usage.prompt_tokens_details.cached_tokens == 0
    for _ in stream:
        pass
    holder_b = next(u for u in urls if u != holder_a)
    assert {u: worker_counters(u)["num_requests_total"] - before[u] for u in urls} == {holder_a: 1, holder_b: 1}

    # Every later request of either prefix lands on its holder and reuses its prefix.
    for question in QUESTIONS:
        for prefix in "ab":
            usage = chat(router.base_url, prefix, question).usage
            assert usage.prompt_tokens_details.cached_tokens > usage.prompt_tokens // 2, (prefix, usage)
    served = {u: worker_counters(u)["num_requests_total"] - before[u] for u in urls}
    assert served == {holder_a: 1 + len(QUESTIONS), holder_b: 1 + len(QUESTIONS)}


def test_killed_worker_is_routed_around(fleet):
    """Runs last: it kills a worker. Requests sent after the router marks it unhealthy all
    succeed, the dead worker's prefix included (it moves to the survivor)."""
    router, workers = fleet
    victim, survivor = workers
    kill_worker(victim)
    noticed = router.wait_unhealthy(victim.base_url)
    assert noticed < 10
    errors: list[BaseException] = []

    def one(prefix: str, question: str) -> None:
        try:
            assert chat(router.base_url, prefix, question).choices[0].message.content
            streamed = chat(router.base_url, prefix, question, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        except BaseException as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    before = worker_counters(survivor.base_url)["num_requests_total"]
    threads = [threading.Thread(target=one, args=(p, q)) for p in "ab" for q in QUESTIONS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert worker_counters(survivor.base_url)["num_requests_total"] - before == 2 * len(threads)
