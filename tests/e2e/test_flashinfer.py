"""The CUDA path: FlashInfer attention, decode CUDA graphs, and torch_native off the CPU.

The index building, the backend choice, the backend's planning (against a reference of
FlashInfer's wrappers) and torch_native's non-CPU attention branch run everywhere (plain
torch). The tests marked `gpu` need a CUDA device (and flashinfer-python, most of them) and
are skipped without them. They run tiny models of head_dim 64 and 128 (FlashInfer's prefill
rejects the CPU suite's 16 and 32; tests/helpers/gpu_check_models.py), and compare the flashinfer
backend with torch_native on the same GPU (prefill, cached-prefix extend mixed with decode
rows, speculative verify rows, decode), CUDA-graph replay with eager decode (including padded
batch sizes), torch_native's cascade steps on CUDA with transformers, and the served model's
greedy answer."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

import srt_lite.layers.attention as attention
from gpu_check_models import GPU_CASES, make_gpu_tiny_model
from model_harness import Harness
from srt_lite.layers.attention import choose_attention_backend, create_attention_backend, flashinfer_available
from srt_lite.layers.attention.base import AttentionConfig
from srt_lite.layers.attention.torch_native import sdpa as sdpa_ops
from srt_lite.layers.attention.torch_native import backend as tnb
from srt_lite.layers.attention.flashinfer_backend import (QWEN_WORKSPACE_BYTES, WORKSPACE_BYTES, WORKSPACE_ENV,
                                                         build_kv_indices, workspace_bytes)
from srt_lite.model_executor.cuda_graph_runner import capture_batch_sizes

needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and flashinfer_available()),
                               reason="needs CUDA and flashinfer-python")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_build_kv_indices_lists_each_rows_slots():
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.randint(1, 1000, (6, 40), generator=g, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])
    seq_lens = torch.tensor([7, 1, 33])
    indptr, indices = build_kv_indices(req_to_token, rows, seq_lens, seq_lens.tolist())
    assert indptr.tolist() == [0, 7, 8, 41] and indptr.dtype == torch.int32
    want = torch.cat([req_to_token[r, :n] for r, n in zip(rows.tolist(), seq_lens.tolist())])
    assert indices.dtype == torch.int32 and torch.equal(indices, want)


def test_capture_batch_sizes_cover_every_batch_up_to_the_max():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    sizes = capture_batch_sizes(160)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 160 and all(b % 8 == 0 for b in sizes[3:])


# ---- the backend choice ----------------------------------------------------------------


@pytest.mark.parametrize("installed", [True, False])
def test_auto_picks_flashinfer_on_cuda_only_for_its_dtypes(monkeypatch, caplog, installed):
    monkeypatch.setattr(attention, "flashinfer_available", lambda: installed)
    fi = "flashinfer" if installed else "torch_native"
    assert choose_attention_backend("auto", "cuda", torch.bfloat16) == fi
    assert choose_attention_backend("auto", "cuda:0", torch.float16) == fi
    assert choose_attention_backend("auto", "cpu", torch.bfloat16) == "torch_native"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="srt_lite.layers.attention"):
        assert choose_attention_backend("auto", "cuda", torch.float32) == "torch_native"
    # One line says why, only when flashinfer was there to be passed over.
    assert len(caplog.records) == int(installed)
    assert all("float32" in r.getMessage() for r in caplog.records)


def test_explicit_flashinfer_rejects_what_cannot_run(monkeypatch):
    monkeypatch.setattr(attention, "flashinfer_available", lambda: True)
    assert choose_attention_backend("flashinfer", "cuda", torch.bfloat16) == "flashinfer"
    with pytest.raises(ValueError, match="float16/bfloat16 only, not float32"):
        choose_attention_backend("flashinfer", "cuda", torch.float32)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_attention_backend("flashinfer", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_attention_backend("triton", "cuda", torch.bfloat16)
    monkeypatch.setattr(attention, "flashinfer_available", lambda: False)
    with pytest.raises(ValueError, match="flashinfer-python"):
        choose_attention_backend("flashinfer", "cuda", torch.bfloat16)


def test_create_attention_backend_checks_the_runners_dtype_first(monkeypatch):
    """fp32 on CUDA: auto builds torch_native; flashinfer raises before building anything
    (no CUDA needed: neither path touches the device here)."""
    monkeypatch.setattr(attention, "flashinfer_available", lambda: True)
    config = AttentionConfig("cuda", torch.float32, num_heads=4)
    backend = create_attention_backend("auto", config)
    assert isinstance(backend, tnb.TorchNativeAttnBackend) and not backend.cpu_kernels
    with pytest.raises(ValueError, match="float32"):
        create_attention_backend("flashinfer", config)


def test_workspace_is_sized_as_sglang_sizes_it(monkeypatch):
    monkeypatch.delenv(WORKSPACE_ENV, raising=False)
    assert workspace_bytes(["LlamaForCausalLM"]) == WORKSPACE_BYTES == 384 * 2**20
    assert workspace_bytes(None) == WORKSPACE_BYTES
    assert workspace_bytes(["Qwen3ForCausalLM"]) == workspace_bytes(["Qwen2ForCausalLM"]) == QWEN_WORKSPACE_BYTES
    monkeypatch.setenv(WORKSPACE_ENV, str(2**20))
    assert workspace_bytes(["Qwen3ForCausalLM"]) == 2**20


# ---- torch_native off the CPU -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_with_lse_generic_branch_matches_the_cpu_op(dtype, masked):
    """The branch other devices take (plain torch math in fp32) against the CPU flash op
    that the CPU takes: the same output and log-sum-exp, for the shapes the backend uses."""
    g = torch.Generator().manual_seed(3)
    B, H, Lq, Lk, D = 3, 2, 12, 70, 64
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (Lq, Lk, Lk))
    mask = None
    if masked:  # an additive bias broadcast over heads; every query keeps some keys
        keep = torch.rand(B, 1, Lq, Lk, generator=g) < 0.6
        keep[..., 0] = True
        mask = torch.zeros(B, 1, Lq, Lk, dtype=dtype).masked_fill_(~keep, float("-inf"))
    want_o, want_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=0.2)
    o, lse = sdpa_ops.sdpa_with_lse_math(q, k, v, mask, 0.2)
    assert o.dtype == want_o.dtype == dtype and o.shape == want_o.shape
    assert lse.dtype == want_lse.dtype == torch.float32 and lse.shape == want_lse.shape
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the CPU op rounds its partial sums
    assert (o.float() - want_o.float()).abs().max().item() < tol
    assert (lse - want_lse).abs().max().item() < tol
    # The CPU dispatch is the op itself, untouched.
    o_cpu, lse_cpu = sdpa_ops.sdpa_with_lse(q, k, v, attn_mask=mask, scale=0.2)
    assert torch.equal(o_cpu, want_o) and torch.equal(lse_cpu, want_lse)


def test_torch_native_steps_through_the_generic_branch_match_the_cpu_op(tmp_path, monkeypatch):
    """Every call site of sdpa_with_lse (folded verify rows, a cascade's prefix, a token
    cascade's suffixes) fed by the generic branch, as on CUDA: the same logits as through
    the CPU op, with the C++ ops off in both so that the Python paths run."""
    from srt_lite.model_config import ModelConfig
    from srt_lite.model_executor.model_runner import ModelRunner
    from srt_lite.server_args import ServerArgs
    from tiny_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "llama")
    runners = [ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", max_total_tokens=4096)) for _ in range(2)]
    for r in runners:
        r.attn_backend = tnb.TorchNativeAttnBackend(r.attention_config(), use_cpu_kernels=False)
    generic, callers = [False], set()
    original = sdpa_ops.sdpa_with_lse

    def sdpa(q, k, v, attn_mask=None, scale=None):
        if not generic[0]:
            return original(q, k, v, attn_mask=attn_mask, scale=scale)
        callers.add(inspect.stack()[1].function)
        return sdpa_ops.sdpa_with_lse_math(q, k, v, attn_mask, scale)

    monkeypatch.setattr(sdpa_ops, "sdpa_with_lse", sdpa)
    hs = [Harness(r) for r in runners]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (100, 9, 23)]

    def both(step) -> None:
        outs = []
        for h, flag in zip(hs, (False, True)):
            generic[0] = flag
            outs.append(step(h))
        assert (outs[0] - outs[1]).abs().max().item() < 1e-4

    both(lambda h: h.prefill(prompts).all_logits)
    # Verify rows (4 and 6 tokens after their own KV), no shared prefix: folded.
    new = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (4, 6)]
    both(lambda h: h.extend(h.rows[1:], h.lens[1:], new).all_logits)
    # Rows sharing row 0's first 80 slots: a decode row and verify rows (a token cascade),
    # then 6 rows of equal suffixes decoding (a folded cascade: one padded call is cheaper).
    tails = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (1, 5, 3)]
    both(lambda h: h.extend(h.rows_sharing_prefix(3, 80), [80] * 3, tails).all_logits)
    decode_tails = [[int(t)] for t in torch.randint(3, 320, (6,), generator=g)]
    both(lambda h: h.extend(h.rows_sharing_prefix(6, 80), [80] * 6, decode_tails).all_logits)
    assert callers == {"attend_folded", "_attend_token_suffixes", "_attend_prefix"}


# ---- FlashInfer's wrappers, on the CPU ----------------------------------------------------


class _ReferenceWrapper:
    """FlashInfer's paged-KV wrapper contract in plain torch (per row SDPA; the causal mask
    aligned to the end of the row's KV, as FlashInfer documents), so the backend's planning
    and per-layer calls can be checked on the CPU. The real kernels are checked on a GPU."""

    def __init__(self, workspace, kv_layout, **kwargs):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        assert kwargs["backend"] == "fa2"  # pinned, as SGLang pins it

    def plan(self, *args, causal=False, sm_scale=None, q_data_type=None, kv_data_type=None, **kwargs):
        if len(args) == 8:  # prefill: qo_indptr first
            self.qo_indptr, args = args[0], args[1:]
        else:
            self.qo_indptr = None
        self.kv_indptr, self.kv_indices, last_page_len, self.hq, self.hkv, self.d, page_size = args
        assert page_size == 1 and bool((last_page_len == 1).all()) and self.kv_indices.dtype == torch.int32
        self.causal, self.scale = causal, sm_scale

    def run(self, q, kv_cache):
        k_cache, v_cache = kv_cache  # [pages, 1, Hkv, D]
        B = self.kv_indptr.shape[0] - 1
        qo = self.qo_indptr if self.qo_indptr is not None else torch.arange(B + 1)
        out = torch.empty_like(q)  # [T, H, D]
        for b in range(B):
            idx = self.kv_indices[self.kv_indptr[b] : self.kv_indptr[b + 1]].long()
            k, v = k_cache[idx, 0], v_cache[idx, 0]  # [L, Hkv, D]
            qb = q[qo[b] : qo[b + 1]]  # [n, H, D]
            n, L = qb.shape[0], k.shape[0]
            mask = torch.arange(L)[None, :] <= torch.arange(L - n, L)[:, None] if self.causal else None
            o = torch.nn.functional.scaled_dot_product_attention(
                qb.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, scale=self.scale, enable_gqa=True,
            )  # [H, n, D]
            out[qo[b] : qo[b + 1]] = o.transpose(0, 1)
        return out


def test_flashinfer_backend_logic_against_reference_kernels(tmp_path, monkeypatch):
    """The backend's index building, planning and per-layer calls, with FlashInfer's
    wrappers replaced by the reference above: fp32 logits equal torch_native's on prefill,
    decode and a mixed step (cached-prefix extend, verify row, decode row)."""
    import sys
    import types

    from srt_lite.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from srt_lite.model_config import ModelConfig
    from srt_lite.model_executor.model_runner import ModelRunner
    from srt_lite.server_args import ServerArgs
    from tiny_models import make_tiny_model

    fake = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_ReferenceWrapper, BatchPrefillWithPagedKVCacheWrapper=_ReferenceWrapper
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setenv(WORKSPACE_ENV, str(2**20))  # not the real 384 MiB on the CPU
    path = make_tiny_model("llama", tmp_path / "llama")
    runners = [ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", max_total_tokens=2048)) for _ in range(2)]
    runners[0].attn_backend = FlashInferAttnBackend(runners[0].attention_config())
    assert runners[0].attn_backend.workspace.numel() == 2**20
    hs = [Harness(r) for r in runners]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 60)]

    def same(outs) -> None:
        assert (outs[0] - outs[1]).abs().max().item() < 1e-4

    same([h.prefill(prompts).all_logits for h in hs])
    for nxt in ([7, 8, 9], [10, 11, 12]):
        same([h.decode(nxt) for h in hs])
    new = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (30, 5, 1)]
    outs = []
    for h in hs:
        pool = h.runner.req_to_token_pool
        row = pool.alloc()
        pool.req_to_token[row, :40] = pool.req_to_token[h.rows[2], :40]
        outs.append(h.extend([row, h.rows[0], h.rows[1]], [40, h.lens[0], h.lens[1]], new).all_logits)
    same(outs)


# ---- on a GPU ---------------------------------------------------------------------------


def _tiny_runner(path: str, backend: str, cuda_graph: bool = False, dtype: str = "bfloat16"):
    from srt_lite.model_config import ModelConfig
    from srt_lite.model_executor.model_runner import ModelRunner
    from srt_lite.server_args import ServerArgs

    args = ServerArgs(
        device="cuda", dtype=dtype, attention_backend=backend, max_total_tokens=4096,
        max_running_requests=16, disable_cuda_graph=not cuda_graph,
    )
    return ModelRunner(ModelConfig.load(path), args)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # bf16 activations through two different kernels: compare relative to the logit scale.
    scale = b.float().abs().max().item()
    assert (a.float() - b.float()).abs().max().item() <= 0.02 * scale + 1e-2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", list(GPU_CASES))
def test_flashinfer_matches_torch_native(kind, tmp_path):
    path = make_gpu_tiny_model(kind, tmp_path / kind)
    fi, ref = _tiny_runner(path, "flashinfer"), _tiny_runner(path, "torch_native")
    assert type(fi.attn_backend).__name__ == "FlashInferAttnBackend"
    assert fi.attn_backend.decode_tensor_cores == (kind == "qwen3_hd128")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 90)]
    hf, hr = Harness(fi), Harness(ref)
    _close(hf.prefill(prompts).all_logits, hr.prefill(prompts).all_logits)
    # Decode steps (the decode wrapper).
    nxt = [7, 8, 9]
    for _ in range(3):
        a, b = hf.decode(nxt), hr.decode(nxt)
        _close(a, b)
        nxt = b.argmax(-1).tolist()
    # One mixed step: a new request on row 2's first 40 slots (cached prefix) extending 30
    # tokens, a verify row of 5 tokens after row 0's KV, and row 1 decoding one token.
    for h in (hf, hr):
        pool = h.runner.req_to_token_pool
        row = pool.alloc()
        pool.req_to_token[row, :40] = pool.req_to_token[h.rows[2], :40]
        h.tmp = row
    new = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (30, 5, 1)]
    outs = [
        h.extend([h.tmp, h.rows[0], h.rows[1]], [40, h.lens[0], h.lens[1]], new).all_logits for h in (hf, hr)
    ]
    _close(*outs)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", list(GPU_CASES))
def test_cuda_graph_decode_matches_eager(kind, tmp_path):
    path = make_gpu_tiny_model(kind, tmp_path / kind)
    graphs, eager = _tiny_runner(path, "flashinfer", cuda_graph=True), _tiny_runner(path, "flashinfer")
    assert graphs.cuda_graph_runner is not None and eager.cuda_graph_runner is None
    assert graphs.cuda_graph_runner.batch_sizes == [1, 2, 4, 8, 16]
    replays = []
    original = graphs.cuda_graph_runner.replay
    graphs.cuda_graph_runner.replay = lambda fb: replays.append(fb.batch_size) or original(fb)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 11, 60)]
    hg, he = Harness(graphs), Harness(eager)
    hg.prefill(prompts), he.prefill(prompts)
    nxt = [5, 6, 7]
    for _ in range(4):  # 3 rows run in the size-4 graph with one padding row
        a, b = hg.decode(nxt), he.decode(nxt)
        _close(a, b)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        nxt = b.argmax(-1).tolist()
    hg.rows, hg.lens, he.rows, he.lens = hg.rows[2:], hg.lens[2:], he.rows[2:], he.lens[2:]
    _close(hg.decode(nxt[2:]), he.decode(nxt[2:]))  # one row: the size-1 graph
    assert replays == [3, 3, 3, 3, 1]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", list(GPU_CASES))
def test_torch_native_cascade_on_cuda_matches_transformers(kind, tmp_path):
    """fp32 on CUDA runs torch_native (auto), whose verify rows and shared-prefix cascades
    take sdpa_with_lse's non-CPU branch: each step's logits against transformers on the GPU."""
    from transformers import AutoModelForCausalLM

    path = make_gpu_tiny_model(kind, tmp_path / kind)
    runner = _tiny_runner(path, "auto", dtype="float32")
    assert isinstance(runner.attn_backend, tnb.TorchNativeAttnBackend) and runner.cuda_graph_runner is None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()

    def want(seq: list[int], n: int) -> torch.Tensor:  # transformers' logits of seq's last n tokens
        with torch.no_grad():
            return hf(torch.tensor([seq], device="cuda")).logits[0, -n:]

    g = torch.Generator().manual_seed(6)
    h = Harness(runner)
    seqs = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (100, 9)]
    h.prefill(seqs)
    # Verify rows after each row's own KV (folded), then rows sharing row 0's first 80 slots
    # (a cascade), as a radix-cache hit lays them out.
    new = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (4, 6)]
    out = h.extend(h.rows, h.lens, new).all_logits
    assert (out - torch.cat([want(s + t, len(t)) for s, t in zip(seqs, new)])).abs().max().item() < 1e-3
    # Decode and verify rows: a token cascade; 6 decode rows of equal suffixes: a folded one.
    for lens in ((1, 5, 3, 1), (1,) * 6):
        tails = [torch.randint(3, 320, (n,), generator=g).tolist() for n in lens]
        out = h.extend(h.rows_sharing_prefix(len(lens), 80), [80] * len(lens), tails).all_logits
        ref = torch.cat([want(seqs[0][:80] + t, len(t)) for t in tails])
        assert (out - ref).abs().max().item() < 1e-3


@pytest.mark.gpu
@needs_gpu
def test_float32_on_cuda_runs_torch_native_and_rejects_flashinfer(tmp_path):
    path = make_gpu_tiny_model("llama_hd64", tmp_path / "llama")
    assert isinstance(_tiny_runner(path, "auto", dtype="float32").attn_backend, tnb.TorchNativeAttnBackend)
    with pytest.raises(ValueError, match="float16/bfloat16 only"):
        _tiny_runner(path, "flashinfer", dtype="float32")


@pytest.mark.gpu
@needs_gpu
def test_engine_on_cuda_answers_greedy():
    from srt_lite import Engine

    with Engine(device="cuda", log_level="warning") as eng:
        out = eng.generate(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
            {"temperature": 0, "max_new_tokens": 16},
        )
    assert "Paris" in out["text"]
