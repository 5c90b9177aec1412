"""Attention backends by name: choose_attention_backend resolves a name for a device and dtype,
create_attention_backend builds it from an AttentionConfig."""

from __future__ import annotations

import importlib
import logging

import torch

from srt_lite.layers.attention.base import AttentionBackend, AttentionConfig

logger = logging.getLogger(__name__)

# Activation dtypes FlashInfer's kernels are built for. Its JIT maps dtypes to kernel names
# with a table that has no float32 entry, so fp32 would end in a KeyError deep inside plan().
FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def choose_attention_backend(name: str, device: str, dtype: torch.dtype | None) -> str:
    """The backend `name` (auto, torch_native or flashinfer) resolves to for this device and
    model dtype, or a ValueError with one clear message for a combination that cannot run.
    `auto` picks flashinfer on CUDA when the package is installed and the dtype is one it
    has kernels for, else torch_native. dtype None (not known yet) skips the dtype rule."""
    on_cuda = device.startswith("cuda")
    fi_dtype_ok = dtype is None or dtype in FLASHINFER_DTYPES
    if name == "auto":
        if not (on_cuda and flashinfer_available()):
            return "torch_native"
        if not fi_dtype_ok:
            logger.info(
                "Attention backend: torch_native, since FlashInfer has no %s kernels "
                "(it runs float16/bfloat16)", str(dtype).removeprefix("torch."),
            )
            return "torch_native"
        return "flashinfer"
    if name == "flashinfer":
        if not on_cuda:
            raise ValueError("--attention-backend flashinfer needs a CUDA device; use torch_native on the CPU")
        if not flashinfer_available():
            raise ValueError(
                "--attention-backend flashinfer needs the flashinfer-python package (pip install flashinfer-python)"
            )
        if not fi_dtype_ok:
            raise ValueError(
                f"--attention-backend flashinfer runs float16/bfloat16 only, not "
                f"{str(dtype).removeprefix('torch.')}: use --dtype bfloat16, or --attention-backend "
                "torch_native (or auto) for float32"
            )
        return name
    if name == "torch_native":
        return name
    raise ValueError(f"unknown attention backend {name!r}")


# Registered backends: name -> "module:class", imported when chosen, so that an optional
# package (flashinfer) is loaded only where it runs. Each class is built as cls(config).
BACKENDS = {
    "torch_native": "srt_lite.layers.attention.torch_native.backend:TorchNativeAttnBackend",
    "flashinfer": "srt_lite.layers.attention.flashinfer_backend:FlashInferAttnBackend",
}


def create_attention_backend(name: str, config: AttentionConfig) -> AttentionBackend:
    """The backend choose_attention_backend picks for the config's device and dtype."""
    name = choose_attention_backend(name, config.device, config.dtype)
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(config)
