from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from srt_lite.model_config import ModelConfig  # noqa: E402
from srt_lite.model_loader.default_model import resolve_model_path  # noqa: E402

torch.manual_seed(0)

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


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The converted default model (converted into the user cache on first use)."""
    return resolve_model_path(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_model_config(default_model_dir) -> ModelConfig:
    return ModelConfig.load(default_model_dir)


def chat_ids(tokenizer, content: str) -> list[int]:
    """Token ids of a one-turn chat prompt, as the server builds them."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="session")
def engine():
    """One fp32 Engine shared by the engine tests (fp32 so that batching never changes a
    greedy token; bf16 kernels are not batch-invariant)."""
    from srt_lite import Engine

    eng = Engine(dtype="float32", max_total_tokens=20000, log_level="warning")
    yield eng
    eng.shutdown()


_REFERENCES: dict[tuple[str, bytes], dict] = {}


def plain_outputs(engine, prompts: list[str], params: dict) -> list[dict]:
    """The shared engine's outputs for `prompts` under `params`, computed as one batch and
    remembered for the session: tests compare other engines' outputs against these, and
    test_concurrent_equals_alone checks that a batch gives each prompt its output alone."""
    import orjson

    key = orjson.dumps(params, option=orjson.OPT_SORT_KEYS)
    todo = [p for p in dict.fromkeys(prompts) if (p, key) not in _REFERENCES]
    if todo:
        for p, out in zip(todo, engine.generate(todo, params)):
            _REFERENCES[p, key] = out
    return [_REFERENCES[p, key] for p in prompts]


@pytest.fixture(autouse=True)
def kv_invariant_after_test(request):
    """After every test that used the shared engine: no request holds KV and
    free + cached + in use == capacity."""
    yield
    if "engine" in request.fixturenames:
        load = wait_idle(request.getfixturevalue("engine"))
        assert load.kv_used_tokens == 0 and load.num_running_reqs == 0 and load.num_waiting_reqs == 0
        assert load.invariant_ok


def wait_idle(engine, timeout: float = 10.0):
    """Waits until no request holds KV, then returns the scheduler's load report."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        load = engine.get_load()
        if (load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.kv_used_tokens == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)
