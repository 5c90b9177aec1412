"""SmolLM2 (the default model) through our runtime against Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch

from engine_utils import chat_ids
from model_harness import Harness
from srt_lite.layers.cpu_linear.products import EXACT_ROWS, bucketed_rows
from srt_lite.layers.cpu_linear.paths import PATH_PACKED
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.server_args import ServerArgs

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "def fibonacci(n):\n    ",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]


@pytest.fixture(scope="module")
def runner_fp32(default_model_config: ModelConfig) -> ModelRunner:
    return ModelRunner(default_model_config, ServerArgs(dtype="float32", max_total_tokens=8192))


def hf_greedy(hf_model, ids: list[int], steps: int, stop_at_eos: bool = False) -> tuple[list[int], torch.Tensor]:
    out = hf_model.generate(
        torch.tensor([ids]),
        max_new_tokens=steps,
        min_new_tokens=0 if stop_at_eos else steps,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(ids) :].tolist(), torch.stack(out.logits, 1)[0]


def test_batch_prefill_and_decode_match_transformers(runner_fp32, hf_model, tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3, "prompts must differ in length"
    h = Harness(runner_fp32)
    out = h.prefill(prompts)
    off = 0
    for ids in prompts:
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        mine = out.all_logits[off : off + len(ids)]
        off += len(ids)
        assert (mine - ref).abs().max().item() < 1e-3
        assert torch.equal(mine.argmax(-1), ref.argmax(-1))

    steps = 8
    refs = [hf_greedy(hf_model, ids, steps + 1) for ids in prompts]
    logits = out.next_token_logits
    for step in range(steps):
        # step 0 compares the prefill's last logits (= HF's first generated-token logits)
        for b, (toks, ref_logits) in enumerate(refs):
            assert (logits[b] - ref_logits[step]).abs().max().item() < 1e-3, (b, step)
            assert logits[b].argmax().item() == toks[step]
        logits = h.decode([toks[step] for toks, _ in refs])


def test_greedy_chat_equals_transformers_generate(runner_fp32, hf_model, tokenizer, default_model_config):
    prompts = [chat_ids(tokenizer, c) for c in CHATS]
    h = Harness(runner_fp32)
    logits = h.prefill(prompts).next_token_logits
    mine: list[list[int]] = [[] for _ in prompts]
    for _ in range(32):
        nxt = logits.argmax(-1).tolist()
        for b, t in enumerate(nxt):
            mine[b].append(t)
        logits = h.decode(nxt)
    eos = default_model_config.eos_token_ids
    for b, ids in enumerate(prompts):
        ref, _ = hf_greedy(hf_model, ids, 32, stop_at_eos=True)
        # transformers stops at EOS; compare up to and including it.
        cut = next((i + 1 for i, t in enumerate(mine[b]) if t in eos), len(mine[b]))
        assert mine[b][:cut] == ref, (CHATS[b], tokenizer.decode(mine[b]), tokenizer.decode(ref))


@pytest.mark.cpu_caps
@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float32", "float16"])
def test_capital_of_france_in_every_dtype(default_model_config, tokenizer, dtype):
    """Each dtype runs on any CPU, through the linear path this CPU has."""
    runner = ModelRunner(default_model_config, ServerArgs(dtype=dtype, max_total_tokens=1024))
    ids = chat_ids(tokenizer, "What is the capital of France?")
    h = Harness(runner)
    logits = h.prefill([ids]).next_token_logits
    out = []
    for _ in range(20):
        t = int(logits.argmax(-1))
        if t in default_model_config.eos_token_ids:
            break
        out.append(t)
        logits = h.decode([t])
    assert "Paris" in tokenizer.decode(out)


def test_cached_prefix_plus_extend_equals_from_scratch(runner_fp32, tokenizer):
    ids = tokenizer.encode("In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole")
    split = 9
    h = Harness(runner_fp32)
    full = h.prefill([ids]).all_logits
    # A second request reuses the first `split` KV slots of the first one (as the radix cache
    # does) and computes only the rest, in one batch with a fresh unrelated prompt.
    pool = runner_fp32.req_to_token_pool
    row = pool.alloc()
    pool.req_to_token[row, :split] = pool.req_to_token[h.rows[0], :split]
    other = tokenizer.encode("Unrelated text in the same batch")
    other_row = pool.alloc()
    out = h.extend([row, other_row], [split, 0], [ids[split:], other])
    tail = out.all_logits[: len(ids) - split]
    assert (tail - full[split:]).abs().max().item() < 1e-4
    assert torch.equal(tail.argmax(-1), full[split:].argmax(-1))


@pytest.mark.cpu_caps
def test_token_axis_padding_leaves_logits_and_kv_unchanged(default_model_config, tokenizer):
    """bf16 on the CPU: where the linears are packed for oneDNN, ModelRunner pads a step's
    tokens once to their row bucket. The padding rows must write no KV and never reach the
    logits: with and without it (each packed linear then pads for itself) the prefill's
    logits, and those of a following step that reads the prefill's KV, are bit-identical.
    On a CPU whose bf16 linears are not packed the runner does not pad; the same padding is
    then switched on by hand, and the logits must agree to the rounding of a product whose
    row count changed (the fp32 BLAS under the bf16 kernel blocks by row count): a padding
    row that wrote KV or reached the logits would change them far more, or change their
    count."""
    runner = ModelRunner(default_model_config, ServerArgs(dtype="bfloat16", max_total_tokens=1024))
    assert runner.pad_rows == (runner.linear_path == PATH_PACKED)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    more = [tokenizer.encode(" and then, after a long while, it")[:7] for _ in prompts]
    for step in (prompts, more):
        n = sum(map(len, step))
        assert n > EXACT_ROWS and bucketed_rows(n) != n  # both steps are padded
    runs = []
    for pad in (True, False):
        runner.pad_rows = pad
        h = Harness(runner)
        first = h.prefill(prompts).all_logits
        second = h.extend(h.rows, h.lens, more).all_logits
        runs.append((first, second))
    for a, b in zip(runs[0], runs[1]):
        assert a.shape == b.shape
        if runner.linear_path == PATH_PACKED:
            assert torch.equal(a, b)
        else:
            assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()
    assert runs[0][0].shape[0] == sum(map(len, prompts))
