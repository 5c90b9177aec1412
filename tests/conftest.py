from __future__ import annotations

import os
import sys

import pytest
import torch

# Shared helpers (servers, tiny models, clients) are imported by name from tests/helpers.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))

from engine_utils import wait_idle  # noqa: E402
from srt_lite.model_config import ModelConfig  # noqa: E402
from srt_lite.model_loader.default_model import resolve_model_path  # noqa: E402

torch.manual_seed(0)


def pytest_collection_modifyitems(config, items) -> None:
    """Modules with tests marked slow first, each module's tests in their own order: on
    pytest-xdist's workers (`make test`), which take whole modules in this order, the long
    ones then start early rather than leave one worker running them after the other is done."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)


@pytest.fixture
def two_threads():
    """At least two threads in this process, so that a test of the C++ ops checks their split
    of work between threads, even where `make test` gives each worker one (OMP_NUM_THREADS)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def cpu_caps_tests_take_two_threads(request):
    """The tests marked cpu_caps (the C++ ops' own among them) run with two_threads."""
    if request.node.get_closest_marker("cpu_caps") is not None:
        request.getfixturevalue("two_threads")
    yield


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


@pytest.fixture(scope="session")
def engine():
    """One fp32 Engine shared by the engine tests (fp32 so that batching never changes a
    greedy token; bf16 kernels are not batch-invariant)."""
    from srt_lite import Engine

    eng = Engine(dtype="float32", max_total_tokens=20000, log_level="warning")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def shared_server():
    """One fp32 default-model server (openai_helpers.default_server) for the modules that only
    send it requests and check what comes back; each of them used to start its own. Its
    Responses store keeps 8 entries, so that test_openai_responses can see the bound."""
    from openai_helpers import default_server

    with default_server("--response-store-max-entries", "8") as s:
        yield s


@pytest.fixture(autouse=True)
def kv_invariant_after_test(request):
    """After every test that used the shared engine: no request holds KV and
    free + cached + in use == capacity."""
    yield
    if "engine" in request.fixturenames:
        load = wait_idle(request.getfixturevalue("engine"))
        assert load.kv_used_tokens == 0 and load.num_running_reqs == 0 and load.num_waiting_reqs == 0
        assert load.invariant_ok
