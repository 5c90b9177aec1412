from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from srt_lite.model_executor.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """One attention layer's view of the shared KV pool; the work is the backend's."""

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id
        # Under torch.compile: the C++ op (srt_lite_cpu::attention), which runs a token-cascade
        # step itself and hands every other step to the Python op `srt_lite::attention`.
        self.cpp_graph_op = False

    def use_cpp_graph_op(self) -> None:
        _register_cpp_fake()
        self.cpp_graph_op = True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: "ForwardBatch | None"
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Under torch.compile the batch's metadata is not a graph input: the opaque op
            # reads it from the forward context (see `compiled_forward_batch`).
            if self.cpp_graph_op:
                return torch.ops.srt_lite_cpu.attention(q, k, v, self.layer_id)
            return torch.ops.srt_lite.attention(q, k, v, self.layer_id)
        return attend(q, k, v, self, forward_batch)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: "ForwardBatch"
) -> torch.Tensor:
    """The backend's attention for the batch's tokens. Rows past fb.num_tokens only pad the
    token axis to a linear's row bucket (ModelRunner.forward): no KV, a zero output."""
    T = fb.num_tokens
    if q.shape[0] == T or fb.attn_backend.takes_padded_rows:
        return fb.attn_backend.forward(q, k, v, layer, fb)
    out = fb.attn_backend.forward(q[:T], k[:T], v[:T], layer, fb)  # [T, num_heads * head_dim]
    return F.pad(out, (0, 0, 0, q.shape[0] - T))


# ---- torch.compile support: attention is one opaque custom op per layer, as in vLLM --------
# The graph passes only (q, k, v, layer id): a ForwardBatch cannot be a graph input, so the op finds the step's here.
_CURRENT: list[tuple["ForwardBatch", dict[int, RadixAttention]]] = []


@contextlib.contextmanager
def compiled_forward_batch(fb: "ForwardBatch", layers: dict[int, RadixAttention]) -> Iterator[None]:
    """Makes `fb` the batch that `srt_lite::attention` attends for the enclosed forward;
    `layers` maps layer ids to the RadixAttention modules of the model being run."""
    _CURRENT.append((fb, layers))
    try:
        yield
    finally:
        _CURRENT.pop()


@torch.library.custom_op("srt_lite::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    fb, layers = _CURRENT[-1]
    return attend(q, k, v, layers[layer_id], fb)


@_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
    return torch.empty_like(q)  # [T, num_heads * head_dim]


@functools.cache
def _register_cpp_fake() -> None:
    @torch.library.register_fake("srt_lite_cpu::attention")
    def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int) -> torch.Tensor:
        return torch.empty_like(q)  # [T, num_heads * head_dim]
