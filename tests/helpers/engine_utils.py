"""Shared by the tests that drive an Engine: prompts, engine configurations under memory
pressure, the reference outputs of the session's engine, and the idle check."""

from __future__ import annotations

import time

import orjson
import pytest

# Short raw prompts shared by the engine and scheduler tests.
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def add(a, b):",
    "Once upon a time,",
    "List three colors:",
    "The meaning of life is",
    "In 1492, Columbus",
    "Water boils at",
]

LONG = "Here is a long story about a river that runs through a valley. " * 6 + "The river"


# Engine configurations under pressure (also used by test_speculative). 8 x (~6 + 40) tokens
# plus a long prompt cannot all fit in 160 slots: the scheduler must evict cached prefixes and
# retract running requests, then resume them.
PRESSURE = pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_total_tokens=160, chunked_prefill_size=32, schedule_policy="fcfs"),
        dict(max_total_tokens=4096, max_running_requests=2, disable_radix_cache=True, chunked_prefill_size=16),
    ],
    ids=["tiny-kv-retract", "two-running-no-radix"],
)


def chat_ids(tokenizer, content: str) -> list[int]:
    """Token ids of a one-turn chat prompt, as the server builds them."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


_REFERENCES: dict[tuple[str, bytes], dict] = {}


def plain_outputs(engine, prompts: list[str], params: dict) -> list[dict]:
    """The shared engine's outputs for `prompts` under `params`, computed as one batch and
    remembered for the session: tests compare other engines' outputs against these, and
    test_concurrent_equals_alone checks that a batch gives each prompt its output alone."""
    key = orjson.dumps(params, option=orjson.OPT_SORT_KEYS)
    todo = [p for p in dict.fromkeys(prompts) if (p, key) not in _REFERENCES]
    if todo:
        for p, out in zip(todo, engine.generate(todo, params)):
            _REFERENCES[p, key] = out
    return [_REFERENCES[p, key] for p in prompts]


def wait_idle(engine, timeout: float = 10.0):
    """Waits until no request holds KV, then returns the scheduler's load report."""
    deadline = time.monotonic() + timeout
    while True:
        load = engine.get_load()
        if (load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.kv_used_tokens == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)
