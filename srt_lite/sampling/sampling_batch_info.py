"""SamplingBatchInfo: the sampling parameters of a batch as tensors, one row per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from srt_lite.managers.schedule_batch import Req


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B, 1] float32 (1.0 on greedy rows, unused there)
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, vocab size when disabled
    is_greedy: torch.Tensor  # [B] bool
    all_greedy: bool
    need_top_k_top_p: bool

    @classmethod
    def from_reqs(cls, reqs: list["Req"], vocab_size: int, device: str) -> "SamplingBatchInfo":
        params = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]
        top_ps = [p.top_p for p in params]
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            is_greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            need_top_k_top_p=any(k < vocab_size for k in top_ks) or any(p < 1.0 for p in top_ps),
        )
