from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from srt_lite.layers.radix_attention import RadixAttention
    from srt_lite.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """Attention over the paged KV pool for a ragged batch.

    `init_forward_metadata` runs once per forward pass (index and mask set-up shared by all
    layers); `forward` runs once per layer: it stores the new tokens' K/V at
    `forward_batch.out_cache_loc` and attends each new token to its request's whole KV.
    """

    # True when `forward` accepts q, k, v padded past forward_batch.num_tokens (the CPU's
    # row buckets) and returns as many rows, zero past num_tokens; otherwise the caller
    # slices the padding off and pads the output again.
    takes_padded_rows: bool = False

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
