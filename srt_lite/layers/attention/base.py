"""The attention backend contract: what the model runner, the CUDA graph runner and the C++
decoder stack may ask of a backend, in terms of the batch and the KV pool alone."""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from srt_lite.layers.radix_attention import RadixAttention
    from srt_lite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
    from srt_lite.model_executor.forward_batch import ForwardBatch


@dataclasses.dataclass
class AttentionConfig:
    """What a backend is built from: the model's attention shape on this rank and the pools."""

    device: str
    dtype: torch.dtype
    num_heads: int  # query heads per rank
    num_kv_heads: int = 0  # KV heads per rank
    head_dim: int = 0
    scaling: float = 0.0  # softmax scale of the model's layers
    architectures: tuple[str, ...] = ()  # the checkpoint's HF architectures
    req_to_token_pool: "ReqToTokenPool | None" = None
    token_to_kv_pool: "TokenToKVPool | None" = None


@dataclasses.dataclass
class DecoderStackArgs:
    """A step's attention as the C++ decoder stack (srt_lite_cpu::decoder_layers) runs it: each
    row's own slots (`slots`, by q_offsets/k_offsets), and a prefix shared by every row
    (`prefix_index` from `prefix_start`, `prefix_len` keys; none when prefix_len is 0)."""

    slots: torch.Tensor
    q_offsets: torch.Tensor
    k_offsets: torch.Tensor
    prefix_start: int = -1
    prefix_len: int = 0
    prefix_index: torch.Tensor | None = None


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
    # the backend then implements the graph hooks at the end of this class.
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

    def decoder_stack_args(self, forward_batch: "ForwardBatch") -> DecoderStackArgs | None:
        """The step's attention in the form the C++ decoder stack runs it, or None where this
        step's plan has no such form (the stack then leaves the step to the Python layers)."""
        return None

    # ---- decode CUDA graphs (only where supports_cuda_graph) ------------------------------
    # A graph is captured once per batch size over fixed input buffers; the backend keeps
    # whatever fixed buffers its kernels read, and replans them before each replay.

    def init_graph_state(self, max_bs: int, max_context: int) -> None:
        """Allocates the fixed buffers for graphs of up to max_bs rows of max_context tokens."""
        raise NotImplementedError(f"{type(self).__name__} does not capture CUDA graphs")

    def graph_can_run(self, forward_batch: "ForwardBatch") -> bool:
        """Whether a decode batch fits the fixed buffers."""
        return True

    def init_forward_metadata_capture(self, forward_batch: "ForwardBatch") -> None:
        """Sets forward_batch.attn_metadata for capturing its batch size, every row a padding
        row (one token of KV at slot 0)."""
        raise NotImplementedError(f"{type(self).__name__} does not capture CUDA graphs")

    def init_forward_metadata_replay(self, forward_batch: "ForwardBatch", size: int) -> None:
        """Replans the graph captured for `size` rows for this real batch (rows past its
        batch size are padding rows, as at capture)."""
        raise NotImplementedError(f"{type(self).__name__} does not capture CUDA graphs")
