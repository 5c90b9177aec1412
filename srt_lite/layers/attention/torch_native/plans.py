"""Attention plans of the torch_native backend: how one group of a step's rows is attended.

A plan is built once per step (layers/attention/torch_native/build.py) from the group's KV slots and
masks, and its `attend` runs in every layer: q [Tg, H * D] of the group's tokens, in batch
order, against the layer's KV pool -> [Tg, H * D]. Which plan a group gets is decided in
layers/attention/torch_native/choose.py. The cascade plans (a shared prefix attended once) are in
layers/attention/torch_native/cascade.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from srt_lite.layers.attention.torch_native import sdpa
from srt_lite.layers.attention.torch_native.choose import PlanKind

if TYPE_CHECKING:
    from srt_lite.layers.radix_attention import RadixAttention


@dataclass(frozen=True, eq=False)
class QueryLayout:
    """Where a group's Tg queries sit when its B rows are padded to the longest, max_q."""

    batch: int
    max_q: int
    rows: torch.Tensor | None  # [Tg] group row of each query; None when no row is padded
    cols: torch.Tensor | None  # [Tg] index within its row

    @classmethod
    def of(cls, ext: list[int], device: str) -> "QueryLayout":
        B, max_q = len(ext), max(ext)
        if all(e == max_q for e in ext):
            return cls(B, max_q, None, None)  # [Tg] is [B, max_q] already: a view is enough
        ext_t = torch.tensor(ext, device=device)
        rows = torch.repeat_interleave(torch.arange(B, device=device), ext_t)  # [Tg]
        starts = torch.cumsum(ext_t, 0) - ext_t
        cols = torch.arange(int(ext_t.sum()), device=device) - starts[rows]  # [Tg]
        return cls(B, max_q, rows, cols)

    def pad(self, q: torch.Tensor, H: int, D: int) -> torch.Tensor:
        """q [Tg, H * D] -> [B, Lq, H, D], zero rows where a request has fewer tokens."""
        if self.rows is None:
            return q.view(self.batch, self.max_q, H, D)
        q_pad = q.new_zeros(self.batch, self.max_q, H, D)
        q_pad[self.rows, self.cols] = q.view(q.shape[0], H, D)
        return q_pad

    def take(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, Lq, ...] -> the group's tokens: [Tg, ...], or [B, Lq, ...] when unpadded."""
        return o if self.rows is None else o[self.rows, self.cols]


class Plan(ABC):
    kind: ClassVar[PlanKind]

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,  # [Tg, H * D]
        k_buf: torch.Tensor,  # [slots, Hkv, D], this layer's pool
        v_buf: torch.Tensor,
        layer: "RadixAttention",
        out: torch.Tensor | None = None,  # [Tg, H * D] with contiguous rows: written when given
    ) -> torch.Tensor:  # [Tg, H * D]
        ...

    @property
    def shared_prefix_len(self) -> int:
        """KV slots attended once for all the group's rows (cascade plans), else 0."""
        return 0


@dataclass(frozen=True, eq=False)
class DecodePlan(Plan):
    """One new token per row against its whole KV, padded to the longest row."""

    kind: ClassVar[PlanKind] = PlanKind.DECODE
    kv_index: torch.Tensor  # [B, Lk] int64 pool slots (0 = padding slot)
    bias: torch.Tensor | None  # [B, 1, 1, Lk] 0 / -inf key-length mask; None for one row

    def attend(self, q, k_buf, v_buf, layer, out=None):
        B = self.kv_index.shape[0]
        o = _attend_padded(q.view(B, 1, layer.num_heads, layer.head_dim), k_buf, v_buf, self.kv_index, self.bias, False, layer)
        return _write(o, out, q.shape[0])


@dataclass(frozen=True, eq=False)
class PrefillPlan(Plan):
    """A single fresh prompt: plain causal attention, no mask tensor."""

    kind: ClassVar[PlanKind] = PlanKind.PREFILL
    kv_index: torch.Tensor  # [1, L] int64 pool slots

    def attend(self, q, k_buf, v_buf, layer, out=None):
        T = q.shape[0]
        o = _attend_padded(q.view(1, T, layer.num_heads, layer.head_dim), k_buf, v_buf, self.kv_index, None, True, layer)
        return _write(o, out, T)


@dataclass(frozen=True, eq=False)
class ExtendPlan(Plan):
    """Prompts or chunks (maybe after a cached prefix), queries padded to [B, Lq] under a
    mask that is causal in absolute positions: a new token at position p sees slots 0..p of
    its own request."""

    kind: ClassVar[PlanKind] = PlanKind.EXTEND
    kv_index: torch.Tensor  # [B, Lk] int64 pool slots (0 = padding slot)
    bias: torch.Tensor  # [B, 1, Lq, Lk] 0 / -inf
    layout: QueryLayout

    def attend(self, q, k_buf, v_buf, layer, out=None):
        q_pad = self.layout.pad(q, layer.num_heads, layer.head_dim)
        o = _attend_padded(q_pad, k_buf, v_buf, self.kv_index, self.bias, False, layer)  # [B, Lq, H, D]
        return _write(self.layout.take(o), out, q.shape[0])


@dataclass(frozen=True, eq=False)
class FoldedPlan(Plan):
    """Rows of a few new tokens (verify rows, short prompts): the G query heads of each KV
    head and a row's Lq tokens become G * Lq query rows of one sequence, which the CPU flash
    kernel runs faster than GQA over [B, H, Lq, D], and which needs no GQA expansion."""

    kind: ClassVar[PlanKind] = PlanKind.FOLDED
    kv_index: torch.Tensor  # [B, Lk] int64 pool slots (0 = padding slot)
    bias: torch.Tensor  # [B, 1, G * Lq, Lk] 0 / -inf, query row g * Lq + t
    layout: QueryLayout

    def attend(self, q, k_buf, v_buf, layer, out=None):
        o, _ = attend_folded(q, k_buf, v_buf, self.kv_index, self.bias, self.layout, layer)  # [B, Lq, Hkv, G, D]
        return _write(self.layout.take(o), out, q.shape[0])


def _attend_padded(
    q_pad: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_index: torch.Tensor,
    bias: torch.Tensor | None, causal: bool, layer: "RadixAttention",
) -> torch.Tensor:
    """q_pad [B, Lq, H, D] against the slots kv_index [B, Lk] -> [B, Lq, H, D] (GQA SDPA)."""
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    B, lk = kv_index.shape
    # index_select on the flat index is several times faster than advanced indexing.
    flat = kv_index.view(-1)
    k_all = k_buf.index_select(0, flat).view(B, lk, Hkv, D)
    v_all = v_buf.index_select(0, flat).view(B, lk, Hkv, D)
    return F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        k_all.transpose(1, 2).to(q_pad.dtype),
        v_all.transpose(1, 2).to(q_pad.dtype),
        attn_mask=bias,
        is_causal=causal,
        scale=layer.scaling,
        enable_gqa=H != Hkv,
    ).transpose(1, 2)


def attend_folded(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_index: torch.Tensor, bias: torch.Tensor,
    layout: QueryLayout, layer: "RadixAttention",
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Tg, H * D] folded against the slots kv_index [B, Lk]: the output [B, Lq, Hkv, G, D]
    and its log-sum-exp [B, Lq, Hkv, G] (strided views in token order)."""
    H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    G, Lq = H // Hkv, layout.max_q
    B, lk = kv_index.shape
    q_pad = layout.pad(q, H, D)  # [B, Lq, H, D]
    # Row order within a KV head: (g, t), so the mask of token t repeats G times.
    qf = q_pad.view(B, Lq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Lq, D)
    flat = kv_index.reshape(-1)
    k = k_buf.index_select(0, flat).view(B, lk, Hkv, D).transpose(1, 2).to(q.dtype)
    v = v_buf.index_select(0, flat).view(B, lk, Hkv, D).transpose(1, 2).to(q.dtype)
    o, lse = sdpa.sdpa_with_lse(qf, k, v, attn_mask=bias, scale=layer.scaling)  # [B, Hkv, G * Lq, (D)]
    return o.view(B, Hkv, G, Lq, D).permute(0, 3, 1, 2, 4), lse.view(B, Hkv, G, Lq).permute(0, 3, 1, 2)


def _write(o: torch.Tensor, out: torch.Tensor | None, T: int) -> torch.Tensor:
    """An attention output whose leading dims are the T tokens in order ([T, ...] or
    [B, Lq, ...] with B * Lq = T, any strides) as [T, H * D]: one copy, into `out` when
    given."""
    if out is None:
        return o.reshape(T, -1)
    out.view(o.shape).copy_(o)
    return out


@dataclass(frozen=True, eq=False)
class CppOwnKeysPlan(Plan):
    """A group of short rows in a step of several groups (decode rows beside a prompt chunk),
    each row on its own keys in the C++ cascade op without a prefix part; the step has
    stored its KV already, so the op is given no rows to store."""

    kind: ClassVar[PlanKind] = PlanKind.CPP_OWN_KEYS
    loc: torch.Tensor  # [Tg] int64: the group's new slots (only their count is used)
    suffix_index: torch.Tensor  # [S] int64: every row's slots, row after row
    q_offsets: torch.Tensor  # [B + 1] int64 on the host: where each row's queries start
    k_offsets: torch.Tensor  # [B + 1] int64 on the host: where each row's keys start in suffix_index

    def attend(self, q, k_buf, v_buf, layer, out=None):
        q = q.contiguous()
        dst = q.new_empty(q.shape) if out is None else out  # [Tg, H * D]
        none = q.new_empty(0, k_buf.shape[1] * k_buf.shape[2])  # [0, Hkv * D]
        torch.ops.srt_lite_cpu.cascade_attention(
            q, none, none, k_buf, v_buf, self.loc, self.suffix_index, self.q_offsets, self.k_offsets,
            -1, 0, self.suffix_index[:0], layer.num_heads, layer.scaling, dst,
        )
        return dst



@dataclass(frozen=True, eq=False)
class CppPromptPlan(Plan):
    """Prompts or chunks of them (maybe after a cached prefix), each row's queries on its own
    keys up to their positions, in the C++ prompt op (csrc/cpu_prompt_attention.cpp): no
    padding, no mask, only the causal pairs. The step has stored its KV already."""

    kind: ClassVar[PlanKind] = PlanKind.CPP_PROMPT
    slots: torch.Tensor  # [S] int64: every row's key slots, row after row
    q_offsets: torch.Tensor  # [B + 1] int64 on the host: where each row's queries start
    k_offsets: torch.Tensor  # [B + 1] int64 on the host: where each row's keys start in slots
    bf16_dot: bool  # a bf16 pool on a CPU with AVX512-BF16: the op's bf16 dot products

    def attend(self, q, k_buf, v_buf, layer, out=None):
        dst = q.new_empty(q.shape[0], layer.num_heads * layer.head_dim) if out is None else out  # [Tg, H * D]
        torch.ops.srt_lite_cpu.prompt_attention(
            q, k_buf, v_buf, self.slots, self.q_offsets, self.k_offsets, layer.num_heads, layer.scaling, self.bf16_dot, dst,
        )
        return dst
