"""Which dtype a model runs in: names, and `auto` per device and CPU."""

from __future__ import annotations

import torch

from srt_lite import cpu_caps
from srt_lite import cpu_kernels

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str, device: str, num_params: int | None = None) -> torch.dtype:
    """`auto` means bf16 on CUDA; on a CPU, whichever of bf16 and fp32 weights was measured
    faster for its capabilities and a model of `num_params` (cpu_caps.bf16_is_faster)."""
    if dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        bf16 = cpu_caps.bf16_is_faster(cpu_caps.get(), cpu_kernels.load(), num_params)
        return torch.bfloat16 if bf16 else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]
