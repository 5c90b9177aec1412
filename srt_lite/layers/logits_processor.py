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
        if fb.return_all_logits:
            all_logits = lm_head.compute_logits(hidden)
            return LogitsProcessorOutput(all_logits[index], all_logits)
        return LogitsProcessorOutput(lm_head.compute_logits(hidden[index]))
