"""What keeps a model's outputs from being batch-invariant on this device and build, reported
by the model runner when `--enable-deterministic-inference` is asked for (layers/
batch_invariant.py says what the flag changes)."""

from __future__ import annotations

import torch

from srt_lite import cpu_kernels
from srt_lite.layers.attention.torch_native.choose import cpp_cascade_ok
from srt_lite.layers.cpu_linear.paths import PATH_PACKED, PATH_TORCH


def gaps(device: str, dtype: torch.dtype, linear_path: str, head_dims: set[int], torch_compile: bool) -> list[str]:
    """What keeps a model's outputs from being batch-invariant here, in words (empty: nothing)."""
    out = []
    if device != "cpu":
        out.append(f"on {device} the attention and matmul kernels are not batch-invariant")
        return out
    if not all(cpp_cascade_ok(cpu_kernels.load(), dtype, d) for d in head_dims):
        out.append("attention: the C++ ops do not run here (not built, or dtype/head size they lack)")
    if linear_path == PATH_TORCH and dtype == torch.float32:
        out.append("linears: torch's fp32 matmul (the C++ panels are not built for this CPU)")
    elif linear_path in (PATH_TORCH, PATH_PACKED):
        out.append(f"linears: {linear_path} (oneDNN or torch picks its kernel by row count)")
    if torch_compile:
        out.append("--enable-torch-compile (inductor fuses differently per graph)")
    return out
