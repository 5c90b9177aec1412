"""The batched sampler: one pass over the batch's logits per step, no per-row Python loop."""

from __future__ import annotations

import torch

from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo


class Sampler:
    def __init__(self, seed: int, device: str):
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """logits [B, V] float32 -> next token ids [B] int64."""
        if info.all_greedy:
            return logits.argmax(-1)
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        if info.need_top_k_top_p:
            probs = top_k_top_p_renorm(probs, info.top_ks, info.top_ps)
        # Exponential race: argmax(p / q) with q ~ Exp(1) picks index i with probability p_i.
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        sampled = (probs / q).argmax(-1)
        return torch.where(info.is_greedy, logits.argmax(-1), sampled)


def top_k_top_p_renorm(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zeroes tokens outside each row's top-k and top-p nucleus, with one sort for the batch.
    probs [B, V]; top_ks [B] int; top_ps [B] float. Rows keep at least their best token."""
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    drop = ranks[None, :] >= top_ks[:, None]
    # Drop a token when the mass strictly before it already reaches top_p.
    mass_before = sorted_p.cumsum(-1) - sorted_p
    drop |= mass_before > top_ps[:, None]
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
