from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from srt_lite.layers.embedding import ParallelLMHead
    from srt_lite.model_executor.forward_batch import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    # [B, vocab] float32 at each request's last new token, or [R, vocab] at fb.logit_index
    next_token_logits: torch.Tensor
    all_logits: torch.Tensor | None = None  # [T, vocab] float32 when return_all_logits
    pooled: torch.Tensor | None = None  # [B, hidden] float32 when fb.pool (see pool_hidden)


class LogitsProcessor(nn.Module):
    """Picks the hidden states whose logits are needed and projects only those."""

    def forward(
        self, hidden: torch.Tensor, lm_head: "ParallelLMHead", fb: "ForwardBatch"
    ) -> LogitsProcessorOutput:
        if fb.forward_mode.is_decode():
            return LogitsProcessorOutput(lm_head.compute_logits(hidden))
        index = fb.logit_index
        if index is None:
            index = torch.tensor(fb.extend_seq_lens_cpu, device=hidden.device).cumsum(0) - 1
        pooled = pool_hidden(hidden, fb) if fb.pool else None
        if fb.return_all_logits:
            all_logits = lm_head.compute_logits(hidden)
            return LogitsProcessorOutput(all_logits[index], all_logits, pooled)
        return LogitsProcessorOutput(lm_head.compute_logits(hidden[index]), pooled=pooled)


def pool_hidden(hidden: torch.Tensor, fb: "ForwardBatch") -> torch.Tensor:
    """Per request, in fp32: its last new token's hidden state ("last"), or the sum of its new
    tokens' hidden states ("mean": the scheduler adds the chunks up and divides)."""
    lens = torch.tensor(fb.extend_seq_lens_cpu, device=hidden.device)  # [B]
    if fb.pool == "last":
        return hidden[lens.cumsum(0) - 1].float()  # [B, hidden]
    rows = torch.repeat_interleave(torch.arange(fb.batch_size, device=hidden.device), lens)  # [T]
    out = torch.zeros(fb.batch_size, hidden.shape[-1], dtype=torch.float32, device=hidden.device)  # [B, hidden]
    return out.index_add_(0, rows, hidden.float())
