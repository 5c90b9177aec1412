"""A step's attention as the torch_native backend runs it: `init_forward_metadata` puts a
StepPlan in `ForwardBatch.attn_metadata`, and every layer calls its `run`. Usually the
step's rows are groups, each attended by a plan (GroupedStep); a step that is one token
cascade and can use the C++ op runs that op instead (CppCascadePlan)."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterator

import torch

from srt_lite.layers.attention.base import DecoderStackArgs
from srt_lite.layers.attention.torch_native.cascade import SharedPrefix
from srt_lite.layers.attention.torch_native.choose import PlanKind
from srt_lite.layers.attention.torch_native.plans import Plan

if TYPE_CHECKING:
    from srt_lite.layers.radix_attention import RadixAttention
    from srt_lite.model_executor.forward_batch import ForwardBatch


@dataclass(frozen=True, eq=False)
class PlanGroup:
    tokens: torch.Tensor | None  # [Tg] int64 batch token index of each query; None = all, in order
    plan: "Plan | CppCascadePlan"


class StepPlan(ABC):
    groups: list[PlanGroup]

    @abstractmethod
    def run(
        self,
        q: torch.Tensor,  # [rows, H * D]; rows past fb.num_tokens pad the token axis
        k: torch.Tensor,  # [rows, Hkv * D]
        v: torch.Tensor,  # [rows, Hkv * D]
        layer: "RadixAttention",
        fb: "ForwardBatch",
        out: torch.Tensor,  # [rows, H * D]: rows [0, T) written here
    ) -> None:
        """Stores the step's new K/V in this layer's pool and attends its queries."""

    def compiled_step(self, fb: "ForwardBatch", layers: dict[int, "RadixAttention"]) -> contextlib.AbstractContextManager:
        """Entered around a compiled forward; nothing unless the plan runs in the graph's C++ op."""
        return contextlib.nullcontext()

    def decoder_stack_args(self) -> DecoderStackArgs | None:
        """This step in the C++ decoder stack's form (AttentionBackend.decoder_stack_args)."""
        return None


@dataclass(frozen=True, eq=False)
class GroupedStep(StepPlan):
    groups: list[PlanGroup]

    def run(self, q, k, v, layer, fb, out):
        T, Hkv, D = fb.num_tokens, layer.num_kv_heads, layer.head_dim
        pool = fb.token_to_kv_pool
        if q.shape[0] != T:  # rows past T pad the token axis to a row bucket: no KV, zero output
            q, k, v = q[:T], k[:T], v[:T]
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k.view(T, Hkv, D), v.view(T, Hkv, D))
        k_buf, v_buf = pool.k_buffer[layer.layer_id], pool.v_buffer[layer.layer_id]
        if len(self.groups) == 1:
            self.groups[0].plan.attend(q, k_buf, v_buf, layer, out[:T])
            return
        for g in self.groups:
            out.index_copy_(0, g.tokens, g.plan.attend(q.index_select(0, g.tokens), k_buf, v_buf, layer))


@dataclass(frozen=True, eq=False)
class CppCascadePlan(StepPlan):
    """A step whose attention is one token cascade (TokenCascadePlan's data without its mask),
    run by the C++ op (csrc/cpu_attention.cpp) in one call a layer: the K/V store, the prefix
    part, each row's suffix attended on its own keys only (exactly, with no mask over every
    row's keys) and the merge, without the Python plan's dozens of op calls."""

    kind: ClassVar[PlanKind] = PlanKind.CPP_CASCADE
    prefix: SharedPrefix
    suffix_index: torch.Tensor  # [S] int64: every row's suffix slots, row after row
    # Where each row's queries and suffix keys start in the step's tokens and suffix_index
    # ([B + 1] int64 each on the host, from 0 to T and S).
    q_offsets: torch.Tensor
    k_offsets: torch.Tensor

    @property
    def groups(self) -> list[PlanGroup]:
        return [PlanGroup(None, self)]

    @property
    def shared_prefix_len(self) -> int:
        return self.prefix.length

    def run(self, q, k, v, layer, fb, out):
        pool, lid = fb.token_to_kv_pool, layer.layer_id
        torch.ops.srt_lite_cpu.cascade_attention(
            q, k, v, pool.k_buffer[lid], pool.v_buffer[lid], fb.out_cache_loc, self.suffix_index, self.q_offsets,
            self.k_offsets, self.prefix_start_slot, self.prefix.length, self.prefix.index, layer.num_heads, layer.scaling, out,
        )

    @contextlib.contextmanager
    def compiled_step(self, fb: "ForwardBatch", layers: dict[int, "RadixAttention"]) -> Iterator[None]:
        """The compiled graph's C++ op (`srt_lite_cpu::attention`, see RadixAttention) runs this
        step with no Python per layer: its metadata goes to C++ once here."""
        pool, layer = fb.token_to_kv_pool, next(iter(layers.values()))
        torch.ops.srt_lite_cpu.set_cascade_step(
            fb.out_cache_loc, self.suffix_index, self.q_offsets, self.k_offsets, self.prefix_start_slot,
            self.prefix.length, self.prefix.index, layer.num_heads, layer.scaling, pool.k_buffer, pool.v_buffer,
        )
        try:
            yield
        finally:
            torch.ops.srt_lite_cpu.clear_cascade_step()

    def decoder_stack_args(self) -> DecoderStackArgs:
        return DecoderStackArgs(
            self.suffix_index, self.q_offsets, self.k_offsets, self.prefix_start_slot, self.prefix.length,
            self.prefix.index,
        )

    @property
    def prefix_start_slot(self) -> int:
        """The prefix's first slot when its slots are consecutive, else -1 (the ops' form)."""
        return -1 if self.prefix.start is None else self.prefix.start
