"""The CUDA path: FlashInfer attention and decode CUDA graphs.

The index building runs everywhere (it is plain torch); the tests marked `gpu` need a CUDA
device and flashinfer-python and are skipped without them. They compare the flashinfer
backend with torch_native on the same GPU (prefill, cached-prefix extend mixed with decode
rows, speculative verify rows, decode), CUDA-graph replay with eager decode (including padded
batch sizes), and the served model's greedy answer."""

from __future__ import annotations

import pytest
import torch

from model_harness import Harness
from srt_lite.layers.attention import flashinfer_available
from srt_lite.layers.attention.flashinfer_backend import build_kv_indices
from srt_lite.model_executor.cuda_graph_runner import capture_batch_sizes

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and flashinfer_available()), reason="needs CUDA and flashinfer-python"
)


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


class _ReferenceWrapper:
    """FlashInfer's paged-KV wrapper contract in plain torch (per row SDPA; the causal mask
    aligned to the end of the row's KV, as FlashInfer documents), so the backend's planning
    and per-layer calls can be checked on the CPU. The real kernels are checked on a GPU."""

    def __init__(self, workspace, kv_layout, **kwargs):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.decode = True

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
    from test_tiny_models import make_tiny_model

    fake = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=_ReferenceWrapper, BatchPrefillWithPagedKVCacheWrapper=_ReferenceWrapper
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    path = make_tiny_model("llama", tmp_path / "llama")
    runners = [ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", max_total_tokens=2048)) for _ in range(2)]
    runners[0].attn_backend = FlashInferAttnBackend(runners[0])
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


def _tiny_runner(path: str, backend: str, cuda_graph: bool = False):
    from srt_lite.model_config import ModelConfig
    from srt_lite.model_executor.model_runner import ModelRunner
    from srt_lite.server_args import ServerArgs

    args = ServerArgs(
        device="cuda", dtype="bfloat16", attention_backend=backend, max_total_tokens=4096,
        max_running_requests=16, disable_cuda_graph=not cuda_graph,
    )
    return ModelRunner(ModelConfig.load(path), args)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    # bf16 activations through two different kernels: compare relative to the logit scale.
    scale = b.float().abs().max().item()
    assert (a.float() - b.float()).abs().max().item() <= 0.02 * scale + 1e-2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_flashinfer_matches_torch_native(kind, tmp_path):
    from test_tiny_models import make_tiny_model

    path = make_tiny_model(kind, tmp_path / kind)
    fi, ref = _tiny_runner(path, "flashinfer"), _tiny_runner(path, "torch_native")
    assert type(fi.attn_backend).__name__ == "FlashInferAttnBackend"
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
def test_cuda_graph_decode_matches_eager(tmp_path):
    from test_tiny_models import make_tiny_model

    path = make_tiny_model("llama", tmp_path / "llama")
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
@needs_gpu
def test_engine_on_cuda_answers_greedy():
    from srt_lite import Engine

    with Engine(device="cuda", log_level="warning") as eng:
        out = eng.generate(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
            {"temperature": 0, "max_new_tokens": 16},
        )
    assert "Paris" in out["text"]
