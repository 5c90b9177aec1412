from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from srt_lite.layers.radix_attention import RadixAttention
    from srt_lite.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Attention over the paged KV pool for a ragged batch.

    `init_forward_metadata` runs once per forward pass (index and mask set-up shared by all
    layers, kept in `forward_batch.attn_metadata`); `forward` runs once per layer: it stores
    the new tokens' K/V at `forward_batch.out_cache_loc` and attends each new token to its
    request's whole KV. The model runner asks a backend what it can do only through the
    capabilities below.
    """

    # True when `forward` accepts q, k, v padded past forward_batch.num_tokens (the CPU's
    # row buckets) and returns as many rows, zero past num_tokens; otherwise the caller
    # slices the padding off and pads the output again.
    takes_padded_rows: bool = False

    # True when decode steps can be captured in CUDA graphs (model_executor/cuda_graph_runner.py):
    # the backend then implements make_cuda_graph_decode_wrapper and plan_decode.
    supports_cuda_graph: bool = False

    @property
    def has_cpp_graph_op(self) -> bool:
        """True when a torch.compile graph should call the C++ attention op
        (`srt_lite_cpu::attention`, see RadixAttention) instead of the Python one."""
        return False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None: ...

    def compiled_step(self, forward_batch: "ForwardBatch", layers: dict) -> contextlib.AbstractContextManager:
        """Entered around a compiled forward (after init_forward_metadata); `layers` maps layer
        ids to the model's RadixAttention modules. Nothing by default."""
        return contextlib.nullcontext()

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim]
        v: torch.Tensor,  # [T, num_kv_heads * head_dim]
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        ...

    # ---- decode CUDA graphs (only where supports_cuda_graph) ------------------------------

    def make_cuda_graph_decode_wrapper(
        self, indptr_buf: torch.Tensor, indices_buf: torch.Tensor, last_page_len_buf: torch.Tensor
    ) -> Any:
        """A decode planner whose index tensors live in the given fixed buffers, as a CUDA
        graph needs; one per captured batch size."""
        raise NotImplementedError(f"{type(self).__name__} does not capture CUDA graphs")

    def plan_decode(
        self, wrapper: Any, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor
    ) -> None:
        """Plans a decode step of a wrapper from make_cuda_graph_decode_wrapper."""
        raise NotImplementedError(f"{type(self).__name__} does not capture CUDA graphs")
