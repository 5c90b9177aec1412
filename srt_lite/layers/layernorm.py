from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt_lite import cpu_kernels
from srt_lite.model_loader.weight_utils import TensorSource, read_all


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Hugging Face does. With `residual`, adds it first and
    returns (normed, new_residual), which lets a decoder layer keep one residual stream."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        param.data.copy_(read_all(src))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # HF: normalise in float32, round to the input dtype, then scale by the weight.
        # F.rms_norm is one fused kernel for the first part (the pow/mean/rsqrt/mul chain
        # was four ops and four temporaries per call).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.weight.dtype == x.dtype and x.is_contiguous() and cpu_kernels.eager_cpu(x):
            # One C++ call for what is otherwise 5-8 small ops (same rounding).
            if residual is None:
                return torch.ops.srt_lite_cpu.rms_norm(x, self.weight, self.eps)
            if residual.is_contiguous():
                return torch.ops.srt_lite_cpu.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
