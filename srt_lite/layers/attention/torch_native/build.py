"""Builds a step's plans from the rule's choices (layers/attention/torch_native/choose.py): the groups'
KV slot indices, masks (as additive biases in the KV dtype, built once per step rather than
in every layer) and query layouts."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from srt_lite import cpu_kernels
from srt_lite.layers.attention.torch_native.cascade import CascadePlan, SharedPrefix, TokenCascadePlan
from srt_lite.layers.attention.torch_native.choose import GroupChoice, PlanKind
from srt_lite.layers.attention.torch_native.plans import (
    CppOwnKeysPlan, CppPromptPlan, DecodePlan, ExtendPlan, FoldedPlan, Plan, PrefillPlan, QueryLayout,
)
from srt_lite.layers.attention.torch_native.sdpa import additive
from srt_lite.layers.attention.torch_native.steps import CppCascadePlan, GroupedStep, PlanGroup, StepPlan

if TYPE_CHECKING:
    from srt_lite.model_executor.forward_batch import ForwardBatch


class RowSlots:
    """The KV slots of a step's rows, gathered once per group for both the rule's
    shared-prefix lookup and the group's plan."""

    def __init__(self, fb: "ForwardBatch"):
        self.fb = fb
        self._slots: dict[tuple[int, ...], torch.Tensor] = {}

    def of(self, rows: list[int]) -> torch.Tensor:
        """[B, Lk] int64 slots of these rows' first Lk positions (Lk: their longest KV)."""
        key = tuple(rows)
        if key not in self._slots:
            fb = self.fb
            max_k = max(fb.extend_prefix_lens_cpu[b] + fb.extend_seq_lens_cpu[b] for b in rows)
            pool_rows = fb.req_pool_indices if len(rows) == fb.batch_size else fb.req_pool_indices[rows]
            self._slots[key] = fb.req_to_token_pool.req_to_token[pool_rows, :max_k].to(torch.int64)
        return self._slots[key]

    def shared_prefix(self, rows: list[int]) -> int:
        """Positions at the start (at most the rows' shortest prefix) where every row has the
        same KV slot."""
        slots = self.of(rows)
        n = min(min(self.fb.extend_prefix_lens_cpu[b] for b in rows), slots.shape[1])
        if n <= 0:
            return 0
        same = (slots[:, :n] == slots[:1, :n]).all(0)  # [n]
        return int(same.cumprod(0).sum())


def build_step(fb: "ForwardBatch", choices: list[GroupChoice], slots: RowSlots, heads_per_kv: int) -> StepPlan:
    """The step's plan: one plan per chosen group, each with the batch tokens it attends
    (None when it is the step's only group)."""
    if len(choices) == 1 and choices[0].kind is PlanKind.CPP_CASCADE:
        return _cpp_cascade(fb, choices[0], slots)
    if len(choices) == 1:
        return GroupedStep([PlanGroup(None, build_plan(fb, choices[0], slots, heads_per_kv))])
    starts = [0, *itertools.accumulate(fb.extend_seq_lens_cpu)]
    device = fb.input_ids.device
    groups = []
    for choice in choices:
        tokens = [t for b in choice.rows for t in range(starts[b], starts[b + 1])]
        index = torch.tensor(tokens, dtype=torch.int64, device=device)  # [Tg]
        groups.append(PlanGroup(index, build_plan(fb, choice, slots, heads_per_kv)))
    return GroupedStep(groups)


def build_plan(fb: "ForwardBatch", choice: GroupChoice, slots: RowSlots, heads_per_kv: int) -> Plan:
    """One group's plan; G = heads_per_kv query heads share a KV head (folded plans' masks
    repeat per query head)."""
    rows, shared, G = choice.rows, choice.shared, heads_per_kv
    ext = [fb.extend_seq_lens_cpu[b] for b in rows]
    prefix = [fb.extend_prefix_lens_cpu[b] for b in rows]
    dtype, device = fb.token_to_kv_pool.dtype, fb.input_ids.device
    kv_index, key_valid = _kv_index(slots.of(rows), [p + e for p, e in zip(prefix, ext)])
    kind = choice.kind
    if kind is PlanKind.DECODE:
        # The only constraint is the sequence length (none for a single row).
        bias = additive(key_valid[:, None, None, :], dtype) if len(rows) > 1 else None  # [B, 1, 1, Lk]
        return DecodePlan(kv_index, bias)
    if kind is PlanKind.PREFILL:
        return PrefillPlan(kv_index)
    if kind in (PlanKind.CPP_OWN_KEYS, PlanKind.CPP_PROMPT):
        seq_lens = [p + e for p, e in zip(prefix, ext)]
        row_slots = kv_index[key_valid]  # [S] every row's slots, row after row
        q_offsets = torch.tensor([0, *itertools.accumulate(ext)], dtype=torch.int64)  # [B + 1], host
        k_offsets = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int64)
        if kind is PlanKind.CPP_PROMPT:
            return CppPromptPlan(row_slots, q_offsets, k_offsets, dtype == torch.bfloat16 and cpu_kernels.bf16_dots_available())
        new = torch.arange(kv_index.shape[1], device=device)[None, :] >= torch.tensor(prefix, device=device)[:, None]
        return CppOwnKeysPlan(kv_index[key_valid & new], row_slots, q_offsets, k_offsets)  # loc: [Tg] the new slots
    if kind is PlanKind.TOKEN_CASCADE:
        mask, suffix_index = _token_cascade_mask(kv_index, key_valid, shared, ext, prefix)
        bias = additive(mask[None, None], dtype).repeat_interleave(G, dim=2)  # [1, 1, Tg * G, S]
        return TokenCascadePlan(SharedPrefix.of(kv_index[0, :shared]), suffix_index, bias)
    layout = QueryLayout.of(ext, device)
    mask = _causal_mask(ext, prefix, key_valid, shared)  # [B, Lq, Lk]
    if kind is PlanKind.EXTEND:
        return ExtendPlan(kv_index, additive(mask.unsqueeze(1), dtype), layout)
    bias = additive(mask[:, None, :, shared:], dtype).repeat(1, 1, G, 1)  # [B, 1, G * Lq, Lk - shared]
    if kind is PlanKind.FOLDED:
        return FoldedPlan(kv_index, bias, layout)
    assert kind is PlanKind.CASCADE, kind
    return CascadePlan(SharedPrefix.of(kv_index[0, :shared]), kv_index[:, shared:], bias, layout)


def _kv_index(slots: torch.Tensor, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [B, Lk] -> (the same with positions past each row's length set to the padding
    slot 0, and key_valid [B, Lk] bool: the positions within it)."""
    key_pos = torch.arange(slots.shape[1], device=slots.device)  # [Lk]
    key_valid = key_pos.unsqueeze(0) < torch.tensor(seq_lens, device=slots.device).unsqueeze(1)  # [B, Lk]
    return slots.masked_fill(~key_valid, 0), key_valid


def _causal_mask(ext: list[int], prefix: list[int], key_valid: torch.Tensor, shared: int) -> torch.Tensor:
    """[B, Lq, Lk] bool, True = attend: causal in absolute positions (a new token at position
    p sees positions 0..p of its own row). Padded query rows attend to one real key only,
    the first after the shared prefix, so softmax never sees an empty row."""
    device, max_q = key_valid.device, max(ext)
    ext_t, prefix_t = torch.tensor(ext, device=device), torch.tensor(prefix, device=device)
    key_pos = torch.arange(key_valid.shape[1], device=device)  # [Lk]
    q_idx = torch.arange(max_q, device=device)  # [Lq]
    q_abs = prefix_t[:, None] + q_idx[None, :]  # [B, Lq] absolute position
    mask = (key_pos[None, None, :] <= q_abs[:, :, None]) & key_valid[:, None, :]
    mask[:, :, shared] |= q_idx[None, :] >= ext_t[:, None]  # [B, Lq] padded query rows
    return mask


def _token_cascade_mask(
    kv_index: torch.Tensor, key_valid: torch.Tensor, shared: int, ext: list[int], prefix: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A token cascade's suffix mask [Tg, S] (a query sees its own row's keys up to its
    position) and suffix slots [S] (every row's, row after row)."""
    device, B = kv_index.device, len(ext)
    ext_t = torch.tensor(ext, device=device)
    q_row = torch.repeat_interleave(torch.arange(B, device=device), ext_t)  # [T]
    starts = torch.cumsum(ext_t, 0) - ext_t
    q_col = torch.arange(int(ext_t.sum()), device=device) - starts[q_row]  # index within its row
    q_abs = torch.tensor(prefix, device=device)[q_row] + q_col  # [T] absolute position
    valid = key_valid[:, shared:]  # [B, Ls]
    ls = valid.shape[1]
    key_row = torch.arange(B, device=device)[:, None].expand(B, ls)[valid]  # [S]
    key_abs = (shared + torch.arange(ls, device=device))[None, :].expand(B, ls)[valid]  # [S]
    mask = (key_row[None, :] == q_row[:, None]) & (key_abs[None, :] <= q_abs[:, None])  # [T, S]
    return mask, kv_index[:, shared:][valid]


def _cpp_cascade(fb: "ForwardBatch", choice: GroupChoice, slots: RowSlots) -> CppCascadePlan:
    rows, shared = choice.rows, choice.shared
    ext = [fb.extend_seq_lens_cpu[b] for b in rows]
    seq_lens = [fb.extend_prefix_lens_cpu[b] + e for b, e in zip(rows, ext)]
    if len(rows) == 1 and not shared:
        # One row sharing nothing (one stream decoding): its slots are the suffix as they
        # are, with no padding to mask. A third of the ops below, in every step.
        suffix = slots.of(rows)[0]  # [L]
        return CppCascadePlan(SharedPrefix(suffix[:0], None), suffix, torch.tensor([0, ext[0]]),
                              torch.tensor([0, seq_lens[0]]))
    kv_index, key_valid = _kv_index(slots.of(rows), seq_lens)
    prefix = SharedPrefix.of(kv_index[0, :shared]) if shared else SharedPrefix(kv_index.new_empty(0), None)
    return CppCascadePlan(
        prefix,
        kv_index[:, shared:][key_valid[:, shared:]],  # [S]
        torch.tensor([0, *itertools.accumulate(ext)], dtype=torch.int64),  # [B + 1], host
        torch.tensor([0, *itertools.accumulate(n - shared for n in seq_lens)], dtype=torch.int64),
    )
