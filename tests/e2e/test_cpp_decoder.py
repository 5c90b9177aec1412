"""The C++ decoder stack (models/cpp_decoder.py, csrc/cpu_decoder.cpp): the steps it runs give
the Python layers' logits bit for bit, on every linear path and row class this CPU has, and
the steps and models it does not cover keep the Python layers."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import pytest
import torch

from model_harness import Harness
from srt_lite.layers import batch_invariant
from srt_lite import cpu_kernels
from srt_lite.layers.cpu_linear.paths import INT4_ROWS, int4_panel_rows
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.models.cpp_decoder import CppDecoderStack
from srt_lite.server_args import ServerArgs
from tiny_models import make_tiny_model

pytestmark = [pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU ops are not built here"),
              pytest.mark.usefixtures("two_threads")]


@pytest.fixture
def stack_calls(monkeypatch) -> list[int]:
    """The token count of every step the C++ stack runs."""
    calls: list[int] = []
    original = CppDecoderStack.__call__

    def record(self, hidden, positions, fb):
        calls.append(hidden.shape[0])
        return original(self, hidden, positions, fb)

    monkeypatch.setattr(CppDecoderStack, "__call__", record)
    return calls


@contextlib.contextmanager
def python_layers(runner: ModelRunner) -> Iterator[None]:
    model = runner.model.model
    stack, model.cpp_stack = model.cpp_stack, None
    try:
        yield
    finally:
        model.cpp_stack = stack


def run_both(runner: ModelRunner, prompts: list[list[int]], steps: int, shared: int = 0, extend: int = 0):
    """The same requests through two harnesses on one runner, the first with the stack and
    the second without: prefill, an optional extend of `extend` tokens on new rows sharing
    the first `shared` slots (a verify-like cascade step), then greedy decode steps. Returns
    both passes' logits."""
    assert runner.model.model.cpp_stack is not None
    out = []
    for use_stack in (True, False):
        h = Harness(runner)
        logits = []
        with contextlib.nullcontext() if use_stack else python_layers(runner):
            logits.append(h.prefill(prompts).next_token_logits)
            if extend:
                rows = h.rows_sharing_prefix(len(prompts), shared)
                new = [[(7 * i + j) % 300 + 3 for j in range(extend)] for i in range(len(prompts))]
                step = h.extend(rows, [shared] * len(rows), new, all_logits=True)
                logits += [step.all_logits, step.next_token_logits]
                h.rows, h.lens = rows, [shared + extend] * len(rows)
            for _ in range(steps):
                logits.append(h.decode(logits[-1].argmax(-1).tolist()))
        out.append(logits)
    return out


def _runner(path: str, dtype: str, **kw) -> ModelRunner:
    return ModelRunner(ModelConfig.load(path), ServerArgs(dtype=dtype, max_total_tokens=4096, **kw))


@pytest.mark.cpu_caps
@pytest.mark.parametrize("kind", ["llama", "llama_tied_bias", "qwen2", "llama3_rope_scaling"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_steps_equal_the_python_layers(kind, dtype, tmp_path, stack_calls):
    """Decode steps of 1, 5 and 40 rows (one per row class of the linears' choices), on this
    CPU's linear path for `dtype`, with biases (qkv) and scaled RoPE: the same logits bit for
    bit as the Python layers, and every decode step went through the stack (a short prompt
    may too: its attention is the C++ cascade as well)."""
    runner = _runner(make_tiny_model(kind, tmp_path / kind), dtype)
    for rows in (1, 5, 40):
        prompts = [[(11 * r + j) % 300 + 3 for j in range(6 + r % 5)] for r in range(rows)]
        stack_calls.clear()
        got, want = run_both(runner, prompts, steps=3)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), rows
        assert stack_calls[-3:] == [rows] * 3  # the first pass's decode steps


def test_cascade_steps_over_a_shared_prefix_with_several_tokens_a_row(tmp_path, stack_calls):
    """Rows over a shared cached prefix, extended by 3 tokens each (a verify step's shape),
    then decoded: the C++ cascade with a prefix part, through the stack, as in Python."""
    runner = _runner(make_tiny_model("llama", tmp_path / "llama"), "bfloat16")
    prompts = [[(5 * j + 1) % 300 + 3 for j in range(80)]] * 4
    got, want = run_both(runner, prompts, steps=2, shared=80, extend=3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert stack_calls == [12, 4, 4]


def test_default_model_int4_and_panels_equal_the_python_layers(default_model_dir, stack_calls):
    """The default GGUF model in bf16: one-row steps take the 4-bit codes (and, with bf16
    panels, batches take the 4-bit panels), larger ones the bf16 products; the stack equals
    the Python layers at 1, INT4_ROWS + 1 and int4_panel_rows() + 1 rows."""
    runner = _runner(default_model_dir, "bfloat16")
    assert runner.int4_linears == 120
    for rows in (1, INT4_ROWS + 1, int4_panel_rows() + 1):
        prompts = [[(13 * r + j) % 40000 + 100 for j in range(5)] for r in range(rows)]
        stack_calls.clear()
        got, want = run_both(runner, prompts, steps=2)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), rows
        assert stack_calls[-2:] == [rows] * 2


@pytest.mark.cpu_caps
@pytest.mark.parametrize("recipe, arch", [("Q4_K_M", "llama"), ("Q8_0", "qwen2")])
def test_gguf_blocks_equal_the_python_layers(recipe, arch, tmp_path, stack_calls):
    """A GGUF file served from its blocks (packed groups where the CPU has them, a Q4_K + Q6_K
    q/k/v, biases on Qwen2): decode steps of 1, 5 and 40 rows through the stack give the
    Python layers' logits bit for bit."""
    from gguf_files import write_model

    path = write_model(str(tmp_path / f"{arch}-{recipe}.gguf"), recipe, arch, heads=4, kv_heads=2, tied=False)
    runner = _runner(path, "bfloat16", model_path=path)
    assert runner.gguf_formats and runner.model.model.cpp_stack is not None
    for rows in (1, 5, 40):
        prompts = [[(11 * r + j) % 300 + 3 for j in range(6 + r % 5)] for r in range(rows)]
        stack_calls.clear()
        got, want = run_both(runner, prompts, steps=2)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), rows
        assert stack_calls[-2:] == [rows] * 2


@pytest.fixture
def invariant() -> Iterator[None]:
    """Batch-invariant inference for one test (the runner turns it on; this turns it off)."""
    yield
    batch_invariant.enable(False)


@pytest.mark.cpu_caps
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_batch_invariant_steps_equal_the_python_layers(dtype, tmp_path, stack_calls, invariant):
    """With --enable-deterministic-inference every step's attention is the C++ prompt op; the
    stack then runs prompts as well as decode steps, with the Python layers' logits."""
    runner = _runner(make_tiny_model("llama", tmp_path / "llama"), dtype, enable_deterministic_inference=True)
    for rows in (1, 5):
        prompts = [[(11 * r + j) % 300 + 3 for j in range(6 + r % 5)] for r in range(rows)]
        stack_calls.clear()
        got, want = run_both(runner, prompts, steps=2)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), rows
        assert stack_calls == [sum(map(len, prompts)), rows, rows]


def test_batch_invariant_default_model_equals_the_python_layers(default_model_dir, stack_calls, invariant):
    """The default model's 4-bit panels at every row count, through the stack and in Python."""
    runner = _runner(default_model_dir, "bfloat16", enable_deterministic_inference=True)
    prompts = [[(13 * r + j) % 40000 + 100 for j in range(5 + r)] for r in range(3)]
    got, want = run_both(runner, prompts, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert stack_calls == [sum(map(len, prompts)), 3, 3]


def test_models_and_settings_it_does_not_cover_keep_the_python_layers(tmp_path, monkeypatch):
    """q/k norms (Qwen3) and torch.compile have no stack, nor does a process that turns it off;
    dropping a model releases its stack's tensors."""
    assert _runner(make_tiny_model("qwen3", tmp_path / "qwen3"), "float32").model.model.cpp_stack is None
    path = make_tiny_model("llama", tmp_path / "llama")
    assert _runner(path, "float32", enable_torch_compile=True).model.model.cpp_stack is None
    monkeypatch.setenv("SRT_LITE_DISABLE_CPP_DECODER", "1")
    assert _runner(path, "float32").model.model.cpp_stack is None
    monkeypatch.delenv("SRT_LITE_DISABLE_CPP_DECODER")
    runner = _runner(path, "float32")
    key = runner.model.model.cpp_stack.key
    h = Harness(runner)
    h.prefill([[5, 6, 7]])
    h.decode([8])  # runs
    del runner, h
    gc.collect()
    with pytest.raises(RuntimeError, match="no decoder stack"):
        torch.ops.srt_lite_cpu.decoder_layers(
            key, torch.zeros(1, 64), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long), torch.tensor([0, 1]), torch.tensor([0, 1]), -1, 0,
            torch.zeros(0, dtype=torch.long), 1.0, [], [],
        )
