from __future__ import annotations

from srt_lite.layers.attention.base import AttentionBackend


def create_attention_backend(name: str, device: str, **kwargs) -> AttentionBackend:
    """`auto` is torch_native for now: the FlashInfer backend (CUDA) is not written yet, and
    asking for it explicitly fails with a clear message instead of an ImportError."""
    if name == "auto":
        name = "torch_native"
    if name == "torch_native":
        from srt_lite.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return TorchNativeAttnBackend(device=device)
    if name == "flashinfer":
        raise ValueError("--attention-backend flashinfer is not available yet; use torch_native")
    raise ValueError(f"unknown attention backend {name!r}")
