"""Attention with FlashInfer's paged-KV kernels (the CUDA path).

The pool's per-layer K and V buffers [slots + 1, Hkv, D] are FlashInfer's paged layout with
page size 1 (NHD): `buf.view(-1, 1, Hkv, D)`. A request's pages are its req_to_token slots,
so a batch is described by `kv_indices` (every row's slots, concatenated), `kv_indptr` (their
offsets) and `last_page_len` (all ones).

- Decode batches (one new token per row) use `BatchDecodeWithPagedKVCacheWrapper`.
- Everything else (prefill, chunked prefill on a cached prefix, decode rows mixed into a
  prefill step, speculative verify rows) uses `BatchPrefillWithPagedKVCacheWrapper` with
  `causal=True`: FlashInfer aligns the causal mask to the end of each row's KV, which is
  exactly our rule (a row's new tokens come after its prefix).

`plan` runs once per forward in `init_forward_metadata` (index set-up shared by all layers);
`run` once per layer; `fb.attn_metadata` is the planned wrapper. The index pointers are built
on the host from the batch's host lists: `plan` copies them to the host anyway, so device
copies would cost a sync per step. Decode CUDA graphs (`model_executor/cuda_graph_runner.py`)
use their own decode wrappers over fixed buffers, one per captured batch size, re-planned
before each replay. Every wrapper runs FlashInfer's FA2 kernels (FLASHINFER_KERNELS below),
in float16 or bfloat16 only: `auto` gives float32 models torch_native (layers/attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from srt_lite import envs
from srt_lite.layers.attention.base import AttentionBackend, AttentionConfig

if TYPE_CHECKING:
    from srt_lite.model_executor.forward_batch import ForwardBatch
    from srt_lite.layers.radix_attention import RadixAttention

# The float workspace (split-KV partial results of a batch) is sized as SGLang sizes it:
# SGLANG_FLASHINFER_WORKSPACE_SIZE (python/sglang/srt/environ.py) defaults to 384 MiB, and
# its flashinfer_backend.py raises it to 512 MiB for Qwen2/Qwen3 models ("Qwen2/Qwen3 models
# require higher flashinfer workspace size"). FlashInfer's docstring suggests 128 MiB; a
# batch whose partials do not fit fails in plan(), mid-serving, so we take the sizes of the
# engine that serves large batches with this code path, not the smallest that may do.
WORKSPACE_BYTES = 384 * 2**20
QWEN_WORKSPACE_BYTES = 512 * 2**20
WORKSPACE_ENV = envs.FLASHINFER_WORKSPACE_SIZE.name  # bytes; overrides the above, as SGLang's env does
_QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")

# Both wrappers are pinned to FlashInfer's FA2 kernels, as SGLang pins them
# (prefill_backend = decode_backend = "fa2" in its flashinfer_backend.py). With "auto",
# FlashInfer picks per GPU and per call: FA3 for prefill on Hopper GPUs, and it may
# route decode to cuDNN. That would run a kernel family SGLang does not serve with, need a
# further (and much longer) JIT build or package, and fix the choice at the first plan.
FLASHINFER_KERNELS = "fa2"


def workspace_bytes(architectures: list[str] | None) -> int:
    """The float workspace size for a model with these HF architectures."""
    env = envs.FLASHINFER_WORKSPACE_SIZE.get()
    if env:
        return int(env)
    if any(a in _QWEN_ARCHITECTURES for a in architectures or []):
        return QWEN_WORKSPACE_BYTES
    return WORKSPACE_BYTES


def build_kv_indices(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged-KV description of a batch with page size 1, without a host sync.

    req_to_token [rows, max_context] int32, req_pool_indices [B], seq_lens [B] (tokens of KV
    per request, new ones included) on the device, and the same lengths as a host list.
    Returns kv_indptr [B + 1] int32 on the host (FlashInfer's plan reads it there; a device
    copy would cost a sync per step) and kv_indices [sum(seq_lens)] int32 on the device
    (row b's first seq_lens[b] slots at kv_indptr[b]:kv_indptr[b + 1])."""
    device = req_to_token.device
    B, total = len(seq_lens_cpu), sum(seq_lens_cpu)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32)  # [B + 1], host
    kv_indptr[1:] = torch.cumsum(torch.tensor(seq_lens_cpu, dtype=torch.int32), 0)
    starts = kv_indptr[:-1].to(device, non_blocking=True).to(torch.int64)  # [B]
    owner = torch.repeat_interleave(
        torch.arange(B, device=device), seq_lens, output_size=total
    )  # [total] batch row of each KV entry
    col = torch.arange(total, device=device) - starts[owner]  # [total] position in its row
    kv_indices = req_to_token[req_pool_indices[owner], col].to(torch.int32)  # [total]
    return kv_indptr, kv_indices


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, config: AttentionConfig):
        import flashinfer  # optional dependency: only the CUDA path needs it

        self.flashinfer = flashinfer
        self.device = config.device
        self.dtype = config.dtype
        self.num_qo_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scaling = config.scaling
        self.req_to_token = config.req_to_token_pool.req_to_token
        pool = config.token_to_kv_pool
        shape = (-1, 1, self.num_kv_heads, self.head_dim)  # [pages, page_size = 1, Hkv, D]
        self.kv_caches = [(k.view(shape), v.view(shape)) for k, v in zip(pool.k_buffer, pool.v_buffer)]
        # uint8, shared by every wrapper (they never run concurrently). Zeroed: FlashInfer
        # documents that the float workspace must be zero at its first use.
        size = workspace_bytes(list(config.architectures))
        self.workspace = torch.zeros(size, dtype=torch.uint8, device=self.device)
        # Tensor-core decode pays off once several query heads share a KV head: FlashInfer
        # then fuses the head group with the token axis in its MMA (SGLang's rule, >= 4).
        self.decode_tensor_cores = self.num_qo_heads // self.num_kv_heads >= 4
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores, backend=FLASHINFER_KERNELS
        )
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=FLASHINFER_KERNELS
        )

    # ---- planning -----------------------------------------------------------------------

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        kv_indptr, kv_indices = build_kv_indices(self.req_to_token, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu)
        last_page_len = torch.ones(fb.batch_size, dtype=torch.int32)  # [B], host
        if fb.forward_mode.is_decode():
            self.plan_decode(self.decode_wrapper, kv_indptr, kv_indices, last_page_len)
            fb.attn_metadata = self.decode_wrapper
            return
        qo_indptr = torch.zeros(fb.batch_size + 1, dtype=torch.int32)  # [B + 1], host
        qo_indptr[1:] = torch.cumsum(torch.tensor(fb.extend_seq_lens_cpu), 0)
        self.prefill_wrapper.plan(
            qo_indptr, kv_indptr, kv_indices, last_page_len,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, 1,
            causal=True, sm_scale=self.scaling, q_data_type=self.dtype, kv_data_type=self.dtype,
        )
        fb.attn_metadata = self.prefill_wrapper

    def plan_decode(
        self, wrapper: Any, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor
    ) -> None:
        wrapper.plan(
            kv_indptr, kv_indices, last_page_len,
            self.num_qo_heads, self.num_kv_heads, self.head_dim, 1,
            sm_scale=self.scaling, q_data_type=self.dtype, kv_data_type=self.dtype,
        )

    # ---- decode CUDA graphs ---------------------------------------------------------------

    def init_graph_state(self, max_bs: int, max_context: int) -> None:
        # One decode wrapper per captured size over fixed index buffers: indptr and
        # last_page_len per size, indices shared. Rows that share a cached prefix list the
        # same slots, so the sum of lengths is bounded by rows x context, not by the pool.
        self.graph_kv_indices = torch.zeros(max_bs * max_context, dtype=torch.int32, device=self.device)  # [max_bs * max_context]
        self.graph_max_bs = max_bs
        self.graph_wrappers: dict[int, Any] = {}
        self.host_ones = torch.ones(max_bs, dtype=torch.int32)  # [max_bs] last_page_len for plan, host

    def graph_can_run(self, fb: "ForwardBatch") -> bool:
        return sum(fb.seq_lens_cpu) + self.graph_max_bs <= self.graph_kv_indices.numel()

    def init_forward_metadata_capture(self, fb: "ForwardBatch") -> None:
        bs = fb.batch_size
        indptr = torch.arange(bs + 1, dtype=torch.int32, device=self.device)  # [bs + 1]
        last_page_len = torch.ones(bs, dtype=torch.int32, device=self.device)  # [bs]
        wrapper = self.graph_wrappers[bs] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
            backend=FLASHINFER_KERNELS, paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=self.graph_kv_indices,
            paged_kv_last_page_len_buffer=last_page_len,
        )
        # Captured with every row a padding row: one KV page, slot 0.
        self.plan_decode(wrapper, torch.arange(bs + 1, dtype=torch.int32), self.graph_kv_indices[:bs].zero_(),
                         self.host_ones[:bs])
        fb.attn_metadata = wrapper

    def init_forward_metadata_replay(self, fb: "ForwardBatch", size: int) -> None:
        bs, total = fb.batch_size, sum(fb.seq_lens_cpu)
        kv_indptr, kv_indices = build_kv_indices(self.req_to_token, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu)
        # Padding rows get one page each (slot 0) after the real rows' pages.
        pad = torch.arange(1, size - bs + 1, dtype=torch.int32) + total
        kv_indptr = torch.cat((kv_indptr, pad))  # [size + 1]
        kv_indices = torch.cat((kv_indices, kv_indices.new_zeros(size - bs)))  # [total + size - bs]
        # plan copies them into the wrapper's fixed buffers, which the captured kernels read.
        self.plan_decode(self.graph_wrappers[size], kv_indptr, kv_indices, self.host_ones[:size])

    # ---- per layer ----------------------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        fb: "ForwardBatch",
    ) -> torch.Tensor:
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        fb.token_to_kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k.view(T, Hkv, D), v.view(T, Hkv, D))
        # q is a strided view into the model's fused q/k tensor; FlashInfer gets it dense, as
        # SGLang hands it over (q.contiguous()), rather than relying on its stride support.
        out = fb.attn_metadata.run(q.contiguous().view(T, H, D), self.kv_caches[layer.layer_id])  # [T, H, D]
        return out.view(T, H * D)
