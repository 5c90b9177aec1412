"""Cascade plans: short rows that share a long prefix of KV slots (a radix-cache hit: a
common system prompt, the n choices of one prompt) attend to that prefix once, all their
queries as one unpadded sequence, and to their own suffixes apart; the two partial results
are merged by their log-sum-exp (FlashInfer's cascade attention). The prefix KV is then read
once per layer instead of once per row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from srt_lite.layers.attention.torch_native import sdpa
from srt_lite.layers.attention.torch_native.choose import PlanKind
from srt_lite.layers.attention.torch_native.plans import Plan, QueryLayout, attend_folded


@dataclass(frozen=True, eq=False)
class SharedPrefix:
    """The KV slots at the start of every row of a cascade group."""

    index: torch.Tensor  # [Lp] int64 pool slots
    # The first slot when the slots are consecutive (a prompt prefilled in one go gets a run
    # of free slots): the layers then read the prefix as a view instead of gathering it.
    start: int | None

    @classmethod
    def of(cls, index: torch.Tensor) -> "SharedPrefix":
        index = index.contiguous()
        start = int(index[0])
        consecutive = bool((index == torch.arange(start, start + index.numel(), device=index.device)).all())
        return cls(index, start if consecutive else None)

    @property
    def length(self) -> int:
        return self.index.shape[0]


def _attend_prefix(
    q_seq: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, prefix: SharedPrefix, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared prefix attended by q_seq [1, Hkv, M, D] as one sequence: returns the
    output [1, Hkv, M, D] and its log-sum-exp [1, Hkv, M]."""
    lp, Hkv, D = prefix.length, q_seq.shape[1], q_seq.shape[3]
    if prefix.start is not None:
        k_pre, v_pre = k_buf[prefix.start : prefix.start + lp], v_buf[prefix.start : prefix.start + lp]
    else:
        k_pre, v_pre = k_buf.index_select(0, prefix.index), v_buf.index_select(0, prefix.index)
    k_pre = k_pre.view(1, lp, Hkv, D).transpose(1, 2).to(q_seq.dtype)  # [1, Hkv, Lp, D]
    v_pre = v_pre.view(1, lp, Hkv, D).transpose(1, 2).to(q_seq.dtype)
    return sdpa.sdpa_with_lse(q_seq, k_pre, v_pre, scale=scale)


@dataclass(frozen=True, eq=False)
class _OverSharedPrefix(Plan):
    """A plan whose rows all start with `prefix`, which every query of the group attends as
    one sequence: q [Tg, H * D] becomes [1, Hkv, Tg * G, D], query row t * G + g."""

    prefix: SharedPrefix

    @property
    def shared_prefix_len(self) -> int:
        return self.prefix.length

    @staticmethod
    def as_sequence(q: torch.Tensor, layer) -> torch.Tensor:
        T, Hkv, D = q.shape[0], layer.num_kv_heads, layer.head_dim
        return q.view(T, Hkv, layer.num_heads // Hkv, D).transpose(0, 1).reshape(1, Hkv, -1, D)


@dataclass(frozen=True, eq=False)
class CascadePlan(_OverSharedPrefix):
    """Folded rows (see FoldedPlan) over a shared prefix: each row's suffix padded to the
    longest suffix, the prefix unpadded."""

    kind: ClassVar[PlanKind] = PlanKind.CASCADE
    kv_index: torch.Tensor  # [B, Ls] int64 suffix slots (0 = padding slot)
    bias: torch.Tensor  # [B, 1, G * Lq, Ls] 0 / -inf, query row g * Lq + t
    layout: QueryLayout

    def attend(self, q, k_buf, v_buf, layer, out=None):
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        G = H // Hkv
        o_suf, lse_suf = attend_folded(q, k_buf, v_buf, self.kv_index, self.bias, self.layout, layer)
        # Back to token order: [Tg, Hkv, G, D] and [Tg, Hkv, G].
        if self.layout.rows is not None:
            o_suf, lse_suf = self.layout.take(o_suf), self.layout.take(lse_suf)
        else:
            o_suf, lse_suf = o_suf.reshape(T, Hkv, G, D), lse_suf.reshape(T, Hkv, G)
        o_pre, lse_pre = _attend_prefix(self.as_sequence(q, layer), k_buf, v_buf, self.prefix, layer.scaling)
        o_pre = o_pre.view(Hkv, T, G, D).transpose(0, 1)  # [Tg, Hkv, G, D]
        lse_pre = lse_pre.view(Hkv, T, G).transpose(0, 1)  # [Tg, Hkv, G]
        if out is None:
            return sdpa.merge(o_suf, lse_suf, o_pre, lse_pre).reshape(T, H * D)
        sdpa.merge(o_suf, lse_suf, o_pre, lse_pre, out.view(T, Hkv, G, D))
        return out


@dataclass(frozen=True, eq=False)
class TokenCascadePlan(_OverSharedPrefix):
    """A cascade whose suffix part is one sequence too: every row's suffix keys concatenated,
    attended by all the group's queries (unpadded, as for the prefix) under a mask that lets
    a query see its own row's keys up to its position. One large call computes many more
    pairs a second on the CPU than B small padded ones, and the suffix output then has the
    prefix output's layout (no padding, no reordering)."""

    kind: ClassVar[PlanKind] = PlanKind.TOKEN_CASCADE
    suffix_index: torch.Tensor  # [S] int64: every row's suffix slots, row after row
    bias: torch.Tensor  # [1, 1, Tg * G, S] 0 / -inf, query row t * G + g

    def attend(self, q, k_buf, v_buf, layer, out=None):
        T = q.shape[0]
        H, Hkv, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
        G = H // Hkv
        q_seq = self.as_sequence(q, layer)
        o_suf, lse_suf = _attend_token_suffixes(q_seq, k_buf, v_buf, self.suffix_index, self.bias, layer.scaling)
        o_pre, lse_pre = _attend_prefix(q_seq, k_buf, v_buf, self.prefix, layer.scaling)
        # [1, Hkv, Tg * G, D] -> token order, merged straight into the output's layout.
        o_suf, o_pre = o_suf.view(Hkv, T, G, D), o_pre.view(Hkv, T, G, D)
        lse_suf, lse_pre = lse_suf.view(Hkv, T, G), lse_pre.view(Hkv, T, G)
        if out is None:
            out = q.new_empty(T, H * D)
        sdpa.merge(o_suf, lse_suf, o_pre, lse_pre, out.view(T, Hkv, G, D).transpose(0, 1))
        return out


def _attend_token_suffixes(
    q_seq: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, suffix_index: torch.Tensor,
    bias: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_seq [1, Hkv, M, D] against the concatenated suffixes [S] under `bias`: the output
    [1, Hkv, M, D] and its log-sum-exp [1, Hkv, M]."""
    S, Hkv, D = suffix_index.shape[0], q_seq.shape[1], q_seq.shape[3]
    k = k_buf.index_select(0, suffix_index).view(1, S, Hkv, D).transpose(1, 2).to(q_seq.dtype)
    v = v_buf.index_select(0, suffix_index).view(1, S, Hkv, D).transpose(1, 2).to(q_seq.dtype)
    return sdpa.sdpa_with_lse(q_seq, k, v, attn_mask=bias, scale=scale)
