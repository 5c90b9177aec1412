from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt_lite import cpu_kernels


class SiluAndMul(nn.Module):
    """[..., 2d] (gate | up) -> [..., d] silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous() and cpu_kernels.eager_cpu(x):
            return torch.ops.srt_lite_cpu.silu_and_mul(x)  # one call, the same rounding
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
