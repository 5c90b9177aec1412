"""Logit adjustments applied before temperature: bias, min-token bans, penalties, and last
the grammar masks of constrained rows (so nothing can lift a token the grammar forbids)."""

from __future__ import annotations

import torch

from srt_lite.constrained.bitmask import allocate_bitmask, apply_bitmask
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo


def apply_logit_adjustments(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """logits [B, V] float32, modified in place and returned."""
    if info.logit_bias is not None:
        rows, ids, vals = info.logit_bias_index()
        logits.index_put_((rows, ids), vals, accumulate=True)
    if info.min_tokens_left is not None:
        active = (info.min_tokens_left > 0).unsqueeze(1) & info.min_tokens_ban
        logits.masked_fill_(active, float("-inf"))
    if info.output_counts is not None:
        rows = info.penalized_rows
        if rows.numel() == logits.shape[0]:
            apply_penalties(
                logits, info.output_counts, info.prompt_mask,
                info.rep_penalties, info.freq_penalties, info.pres_penalties,
            )
        elif rows.numel():
            sub = logits[rows]
            apply_penalties(
                sub, info.output_counts[rows], info.prompt_mask[rows],
                info.rep_penalties[rows], info.freq_penalties[rows], info.pres_penalties[rows],
            )
            logits[rows] = sub
    if info.grammars is not None:
        apply_grammars(logits, info.grammars)
    return logits


def apply_grammars(logits: torch.Tensor, grammars: list) -> None:
    """Forbids, in place, the tokens each constrained row's grammar does not allow next: one
    bitmask for the batch, filled by each row's matcher on the CPU."""
    rows = [i for i, g in enumerate(grammars) if g is not None and g.constrains_next()]
    if not rows:
        return
    bitmask = allocate_bitmask(logits.shape[0], logits.shape[1])  # [B, ceil(V / 32)] int32
    for i in rows:
        grammars[i].fill_bitmask(bitmask, i)
    apply_bitmask(logits, bitmask, rows)


def apply_penalties(
    logits: torch.Tensor,  # [B, V]
    output_counts: torch.Tensor,  # [B, V] float
    prompt_mask: torch.Tensor,  # [B, V] bool
    rep: torch.Tensor,  # [B, 1]
    freq: torch.Tensor,  # [B, 1]
    pres: torch.Tensor,  # [B, 1]
) -> None:
    """vLLM's formulas. Repetition (CTRL): a seen token's logit is divided by the penalty
    when positive, multiplied when negative. Frequency: minus penalty * count. Presence:
    minus penalty once if the token occurred. The latter two count output tokens only."""
    seen = prompt_mask | (output_counts > 0)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, scaled, logits))
    logits -= freq * output_counts
    logits -= pres * (output_counts > 0).float()
