"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt_lite.distributed import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from srt_lite.model_loader.weight_utils import TensorSource, read_narrow

# Above this many tokens F.linear beats W @ x^T plus the transposing copy it needs (SmolLM2's
# 49152 x 576 head in bf16 on the 2-core CPU: 1.8 vs 2.6 ms at 16 rows, 4.9 vs 3.9 at 40,
# 9.7 vs 4.4 at 64).
WEIGHT_MAJOR_MAX_ROWS = 16


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        # Pad so that every rank gets the same number of rows; padded rows are never used.
        self.vocab_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.vocab_end = min(self.vocab_start + self.vocab_per_rank, vocab_size)
        # [vocab / tp, hidden]
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # Set for bfloat16 on CPU, where F.linear's oneDNN path reorders this large weight on
        # every call; for up to WEIGHT_MAJOR_MAX_ROWS tokens a matrix-vector product or W @ x^T
        # reads it in place and is faster.
        self.weight_major_logits = False

    def weight_loader(self, param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(read_narrow(src, 0, self.vocab_start, n))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return tp_all_reduce(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, vocab] float32 logits, each row contiguous."""
        rows = hidden.shape[0]
        if not self.weight_major_logits or rows > WEIGHT_MAJOR_MAX_ROWS:
            logits = F.linear(hidden, self.weight).float()
        elif rows == 1:
            logits = torch.mv(self.weight, hidden[0]).unsqueeze(0).float()
        else:
            w_h = torch.mm(self.weight, hidden.t())  # [vocab / tp, tokens]
            # One transposing pass into float32; rows must be contiguous for the sampler.
            logits = torch.empty(rows, w_h.shape[0], dtype=torch.float32, device=w_h.device).copy_(w_h.t())
        if self.tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection when it is not tied to the embedding."""
