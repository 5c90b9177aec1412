"""The token bitmask of grammar-constrained sampling, and its use on the logits.

One int32 word per 32 tokens, bit i of word w set when token 32 * w + i may come next: both
grammar libraries write this layout. The mask is built on the CPU and applied to the logits
wherever they are.
"""

from __future__ import annotations

import torch


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab_size / 32)] int32, every token allowed."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allow_token(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Sets one token's bit in bitmask[row]."""
    word = (int(bitmask[row, token // 32]) & 0xFFFFFFFF) | (1 << (token % 32))
    bitmask[row, token // 32] = word - (1 << 32) if word >= 1 << 31 else word  # back to int32


# Row b of this table is the additive mask of one bitmask byte of value b: 0.0 where its bit
# is set (allowed), -inf where not. Looking bytes up and adding is several times faster on
# the CPU than expanding the bits and calling masked_fill_ with a [B, V] bool mask.
_BYTE_BIAS = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1) == 0, float("-inf"), 0.0)  # [256, 8]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets to -inf, in place, the logits of tokens the bitmask forbids, in rows `rows`.
    logits [B, V] float32; bitmask [B, ceil(V / 32)] int32 on the CPU."""
    vocab = logits.shape[-1]
    words = bitmask if len(rows) == bitmask.shape[0] else bitmask[rows]  # [R, W]
    # Little-endian bytes of each word, in token order.
    byte_values = words.to(logits.device, non_blocking=True).contiguous().view(torch.uint8).flatten().int()  # [R * W * 4]
    table = _BYTE_BIAS.to(logits.device, logits.dtype)
    bias = table.index_select(0, byte_values).view(len(rows), -1)[:, :vocab]  # [R, V]
    if len(rows) == logits.shape[0]:
        logits.add_(bias)
    else:
        logits.index_add_(0, torch.tensor(rows, dtype=torch.int64, device=logits.device), bias)
