"""Tiny random Llama / Qwen2 / Qwen3 models, created with transformers' config classes:
our runtime's logits must match transformers' on prefill, decode and cached-prefix extend."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_harness import Harness, fragment_free_list
from tiny_models import CASES, make_tiny_model
from srt_lite.layers.cpu_linear.products import EXACT_ROWS
from srt_lite.layers.cpu_linear.paths import (
    PATH_BF16_KERNEL, PATH_F32_PANELS, PATH_PACKED, PATH_PANELS, PATH_TORCH, PATH_WIDE_PANELS, cpu_linear_path,
)
from srt_lite.layers.cpu_linear.packable import PackableLinear
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.server_args import ServerArgs

def decode_and_compare(h: Harness, hf, seqs: list[list[int]], logits: torch.Tensor, steps: int) -> None:
    """Greedy decode steps through the harness; each step's logits against a full HF recompute."""
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = h.decode(nxt)
        for b, s in enumerate(seqs):
            with torch.no_grad():
                ref = hf(torch.tensor([s])).logits[0, -1]
            assert (logits[b] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("kind", list(CASES))
def test_tiny_model_matches_transformers(kind, tmp_path):
    path = make_tiny_model(kind, tmp_path / kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", max_total_tokens=2048))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 40)]

    h = Harness(runner)
    out = h.prefill(prompts)
    off = 0
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        mine = out.all_logits[off : off + len(ids)]
        off += len(ids)
        assert (mine - ref).abs().max().item() < 1e-4
        assert torch.equal(mine.argmax(-1), ref.argmax(-1))

    # Decode 6 steps of greedy tokens; each step compares against a full recompute.
    seqs = [list(p) for p in prompts]
    logits = out.next_token_logits
    decode_and_compare(h, hf, seqs, logits, steps=6)

    # Cached prefix: a new request shares the first 10 slots of request 2 and extends.
    pool = runner.req_to_token_pool
    row = pool.alloc()
    pool.req_to_token[row, :10] = pool.req_to_token[h.rows[2], :10]
    tail = h.extend([row], [10], [seqs[2][10:]]).all_logits
    with torch.no_grad():
        ref = hf(torch.tensor([seqs[2]])).logits[0, 10:]
    assert (tail - ref).abs().max().item() < 1e-4


def test_warmup_runs_prefill_decode_verify_and_a_full_chunk_then_frees_its_kv(tmp_path, monkeypatch):
    path = make_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", max_total_tokens=2048))
    shapes = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda fb: shapes.append(fb.extend_seq_lens_cpu) or forward(fb))
    free, rows = runner.token_to_kv_pool.available_size(), runner.req_to_token_pool.available_size()
    runner.warmup(max_decode_batch=4, num_draft_tokens=2, prefill_chunk=200)
    assert shapes == [[8] * 4, [1], [1] * 2, [1] * 4, [2], [3], [200]]
    assert runner.token_to_kv_pool.available_size() == free and runner.req_to_token_pool.available_size() == rows
    shapes.clear()
    runner.warmup(max_decode_batch=4, num_draft_tokens=2, prefill_chunk=1500)  # longer than the context: skipped
    assert shapes == [[8] * 4, [1], [1] * 2, [1] * 4, [2], [3]]
    # Verify rows stop at the row counts the CPU linears run unpadded; none without drafts.
    shapes.clear()
    runner.warmup(max_decode_batch=1, num_draft_tokens=40, prefill_chunk=0)
    assert shapes == [[8], [1]] + [[n] for n in range(2, EXACT_ROWS + 1)]
    shapes.clear()
    runner.warmup(max_decode_batch=2, num_draft_tokens=0, prefill_chunk=0)
    assert shapes == [[8] * 2, [1], [1] * 2]
    assert runner.token_to_kv_pool.available_size() == free and runner.req_to_token_pool.available_size() == rows


def fast_and_plain(path, dtype: str) -> tuple[ModelRunner, ModelRunner]:
    """Runners of one model in `dtype`: on this CPU's linear path, and on plain F.linear."""
    fast, plain = (
        ModelRunner(ModelConfig.load(path), ServerArgs(dtype=dtype, max_total_tokens=512, disable_weight_packing=off))
        for off in (False, True)
    )
    assert fast.linear_path == cpu_linear_path(getattr(torch, dtype)) and plain.linear_path == PATH_TORCH
    return fast, plain


def prefill_and_decode(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a padded two-prompt prefill (23 tokens) and of the decode step after it."""
    h = Harness(runner)
    first = h.prefill([list(range(5, 20)), list(range(30, 38))]).all_logits
    return first, h.decode([3, 4])


@pytest.mark.cpu_caps
@pytest.mark.parametrize("kind", ["llama", "llama_tied_bias"])
def test_bf16_cpu_linears_give_the_plain_logits(kind, tmp_path):
    """bf16 on the CPU: the linears and the LM head (tied to the embedding or not) run
    through the path this CPU has: srt_lite's panel layout (AVX512-BF16 without AMX), weights
    packed once for oneDNN where it computes bf16, the fp32 panel layout widened as it is read
    (AVX2, AVX-512 without BF16), else the C++ bf16 kernel. Logits of a
    padded prefill (23 tokens) and a decode step equal the plain F.linear weights': bit for
    bit when packed (the same oneDNN product), to bf16 rounding through the panels or the
    kernel (fp32 accumulation in another order). A packed untied head keeps no plain copy."""
    runners = fast, plain = fast_and_plain(make_tiny_model(kind, tmp_path / kind), "bfloat16")
    head = fast.model.lm_head
    embed = fast.model.model.embed_tokens
    if kind == "llama":  # untied: the input embedding is only looked up, and keeps one plain copy
        assert embed.lookup_only and embed.packed_weight is None and embed.panels is None and embed.weight.numel() > 0
    if fast.linear_path == PATH_PACKED:
        assert head.packed_weight is not None and plain.model.lm_head.packed_weight is None
        assert (head.weight.numel() == 0) == (kind == "llama")  # tied: the lookup needs it
    elif fast.linear_path in (PATH_PANELS, PATH_WIDE_PANELS):
        assert head.panels is not None and plain.model.lm_head.panels is None
        assert head.panels.shape[2] == (64 if fast.linear_path == PATH_PANELS else 32)  # the layout
        assert head.weight.numel() == 0  # tied: the lookup gathers from the panels
        linears = [m for m in fast.model.modules() if isinstance(m, PackableLinear)]
        assert all(m.panels is not None and m.weight.numel() == 0 for m in linears)
    else:
        assert fast.linear_path == PATH_BF16_KERNEL and head.bf16_kernel and not plain.model.lm_head.bf16_kernel
        assert all(m.bf16_kernel for m in fast.model.modules() if isinstance(m, PackableLinear))
    out = [prefill_and_decode(runner) for runner in runners]
    assert out[0][0].dtype == torch.float32 and out[0][0].shape[0] == 23
    for a, b in zip(out[0], out[1]):
        if fast.linear_path == PATH_PACKED:
            assert torch.equal(a, b)
        else:
            assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()
            assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.cpu_caps
@pytest.mark.parametrize("kind", ["llama", "llama_tied_bias"])
def test_fp32_cpu_linears_give_the_plain_logits(kind, tmp_path):
    """fp32 on an AVX2 or AVX-512 CPU with the ops built: every linear and the LM head in the
    fp32 panel layout, which replaces the plain weights (a tied head's lookup gathers from
    its panels). Logits of a prefill and a decode step agree with plain F.linear's to fp32
    rounding (another summation order), and the greedy tokens are the same."""
    runners = fast, plain = fast_and_plain(make_tiny_model(kind, tmp_path / kind), "float32")
    if fast.linear_path != PATH_F32_PANELS:
        pytest.skip("no fp32 panels on this CPU or build")
    linears = [m for m in fast.model.modules() if isinstance(m, PackableLinear)]
    assert linears and all(m.panels is not None and m.weight.numel() == 0 for m in linears)
    assert fast.model.lm_head.panels is not None and fast.model.lm_head.weight.numel() == 0
    out = [prefill_and_decode(runner) for runner in runners]
    for a, b in zip(out[0], out[1]):
        assert (a - b).abs().max().item() < 1e-4 * max(b.abs().max().item(), 1.0)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_qwen3_q_k_norm_weights_are_used(tmp_path):
    """Guards the test above: zeroing q_norm changes our logits (the norm is not ignored)."""
    path = make_tiny_model("qwen3", tmp_path / "q3")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", max_total_tokens=512))
    ids = list(range(5, 25))
    before = Harness(runner).prefill([ids]).all_logits.clone()
    runner.model.model.layers[0].self_attn.q_norm.weight.data.mul_(3.0)
    after = Harness(runner).prefill([ids]).all_logits
    assert (before - after).abs().max().item() > 1e-3


def _record_cascade_calls(monkeypatch) -> tuple[list, list]:
    """(calls, starts), filled as the model runs: each layer's call of a folded plan or the C++
    op as (queries, True for a token cascade, False for a padded cascade, "cpp" for the C++ op,
    "folded" without a shared prefix), and each shared prefix's start (None where gathered)."""
    from srt_lite.layers.attention.torch_native import cascade
    from srt_lite.layers.attention.torch_native import plans
    from srt_lite.layers.attention.torch_native.steps import CppCascadePlan

    calls, starts = [], []
    recorded = {
        cascade.TokenCascadePlan: True, cascade.CascadePlan: False, CppCascadePlan: "cpp", plans.FoldedPlan: "folded",
    }
    for cls, tag in recorded.items():
        name = "run" if cls is CppCascadePlan else "attend"
        original = getattr(cls, name)
        record = lambda self, q, *a, _tag=tag, _f=original: calls.append((q.shape[0], _tag)) or _f(self, q, *a)  # noqa: E731
        monkeypatch.setattr(cls, name, record)
    original_prefix = cascade.SharedPrefix.of

    def prefix_of(index):
        prefix = original_prefix(index)
        starts.append(prefix.start)
        return prefix

    monkeypatch.setattr(cascade.SharedPrefix, "of", staticmethod(prefix_of))
    return calls, starts


@pytest.mark.parametrize(
    "consecutive,token_suffix,cpp", [(True, True, True), (False, True, True), (True, True, False), (True, False, False)]
)
def test_cascade_decode_over_shared_prefix_matches_transformers(tmp_path, monkeypatch, consecutive, token_suffix, cpp):
    """Rows that share their first 80 KV slots (a radix hit) take the cascade path (shared
    prefix once + own suffixes, merged by log-sum-exp): in the extend step a decode row,
    verify rows (as in speculative decoding) and a 24-token prompt on the cached prefix, all
    in one group, then the decode steps; logits still match HF. The prefix is read as a view
    of the pool when its slots are consecutive, else gathered; the suffixes are attended as
    one masked sequence (in the C++ op, or with torch ops), or (when that would cost more)
    row by row, padded."""
    from srt_lite import cpu_kernels
    from srt_lite.layers.attention.torch_native import choose

    assert cpu_kernels.load()  # built here: CI's machine has the compiler inductor uses
    # The plans' own calls are counted: the C++ decoder stack would run the op without them
    # (tests/e2e/test_cpp_decoder.py checks it against these layers).
    monkeypatch.setenv("SRT_LITE_DISABLE_CPP_DECODER", "1")
    if not token_suffix:
        monkeypatch.setattr(choose, "TOKEN_SUFFIX_GAIN", 0)
    calls, starts = _record_cascade_calls(monkeypatch)
    path = make_tiny_model("llama", tmp_path / "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", max_total_tokens=2048))
    assert runner.attn_backend.cpu_kernels
    runner.attn_backend.cpu_kernels = cpp
    if not consecutive:
        fragment_free_list(runner, 5)
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 320, (80,), generator=g).tolist()
    suffixes = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (1, 4, 9, 24)]

    h = Harness(runner)
    h.prefill([prefix])
    rows = h.rows_sharing_prefix(len(suffixes), 80)
    out = h.extend(rows, [80] * len(rows), suffixes, all_logits=False)
    seqs = [prefix + s for s in suffixes]
    h.rows, h.lens = rows, [len(s) for s in seqs]
    logits = out.next_token_logits
    decode_and_compare(h, hf, seqs, logits, steps=3)
    # Both layers, one group each: the extend step (rows of 1, 4, 9 and 24 tokens: 38 queries)
    # and every decode step (4 queries).
    kind = "cpp" if cpp else token_suffix
    assert calls == [(38, kind)] * 2 + [(4, kind)] * 3 * 2
    assert len(starts) == 4 and all((st is not None) == consecutive for st in starts)


@pytest.mark.cpu_caps
@pytest.mark.parametrize("kind,dtype", [("qwen3", "float32"), ("llama_tied_bias", "bfloat16")])
def test_torch_compile_matches_eager(kind, dtype, tmp_path):
    """--enable-torch-compile: the compiled decoder stack (attention and the bf16 matmuls,
    packed for oneDNN or the C++ bf16 kernel, as opaque custom ops) gives the eager logits on
    prefill, single-row decode (its own graph) and batched decode; in fp32 also
    transformers' logits. The warm-up compiles both graphs, and batches built as the
    scheduler builds them compile nothing more."""
    from torch._dynamo.utils import counters

    path = make_tiny_model(kind, tmp_path / kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def runner(compile_: bool) -> ModelRunner:
        args = ServerArgs(dtype=dtype, max_total_tokens=2048, enable_torch_compile=compile_)
        return ModelRunner(ModelConfig.load(path), args)

    eager, compiled = runner(False), runner(True)
    assert compiled.compiled_body is not None
    if dtype == "bfloat16" and compiled.linear_path == PATH_PACKED:
        packed = [m for m in compiled.model.modules() if getattr(m, "packed_weight", None) is not None]
        assert packed and all(m.cpp_key >= 0 for m in packed if hasattr(m, "cpp_key"))  # the graph's C++ op
    elif dtype == "bfloat16" and compiled.linear_path in (PATH_PANELS, PATH_WIDE_PANELS):
        assert all(m.panels is not None for m in compiled.model.modules() if isinstance(m, PackableLinear))
    elif dtype == "bfloat16":
        assert compiled.linear_path == PATH_BF16_KERNEL
        assert all(m.bf16_kernel for m in compiled.model.modules() if isinstance(m, PackableLinear))
    elif compiled.linear_path == PATH_F32_PANELS:  # the graph calls the fp32 panel op
        assert all(m.panels is not None for m in compiled.model.modules() if isinstance(m, PackableLinear))
    graphs_before = counters["stats"]["unique_graphs"]
    compiled.warmup(max_decode_batch=2, num_draft_tokens=2, prefill_chunk=0)
    assert counters["stats"]["unique_graphs"] - graphs_before == 2  # many tokens, one token
    graphs_before = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (7, 19)]
    he, hc = Harness(eager), Harness(compiled)
    le, lc = he.prefill(prompts).all_logits, hc.prefill(prompts).all_logits
    tol = 1e-4 if dtype == "float32" else 0.1
    assert (le.float() - lc.float()).abs().max().item() < tol
    if dtype == "float32":
        with torch.no_grad():
            ref = hf(torch.tensor([prompts[0]])).logits[0]
        assert (lc[: len(prompts[0])] - ref).abs().max().item() < 1e-4
    seqs = [list(p) for p in prompts]
    for step in range(4):
        nxt = [s[-1] for s in seqs] if step else lc[[6, 25]].argmax(-1).tolist()
        if step == 2:  # one row alone: the single-token graph
            he.rows, he.lens, hc.rows, hc.lens = he.rows[:1], he.lens[:1], hc.rows[:1], hc.lens[:1]
            seqs, nxt = seqs[:1], nxt[:1]
        de, dc = he.decode(nxt), hc.decode(nxt)
        assert (de.float() - dc.float()).abs().max().item() < tol
        assert torch.equal(de.argmax(-1), dc.argmax(-1))
        for s, t in zip(seqs, dc.argmax(-1).tolist()):
            s.append(t)
    assert counters["stats"]["unique_graphs"] == graphs_before  # no recompilation after warm-up
