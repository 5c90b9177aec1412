from __future__ import annotations

from srt_lite.layers.attention.base import AttentionBackend


def create_attention_backend(name: str, device: str, **kwargs) -> AttentionBackend:
    """`auto` picks flashinfer on CUDA when it is installed, else torch_native."""
    if name == "auto":
        name = "torch_native"
        if device.startswith("cuda"):
            try:
                import flashinfer  # noqa: F401

                name = "flashinfer"
            except ImportError:
                pass
    if name == "torch_native":
        from srt_lite.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return TorchNativeAttnBackend(device=device)
    if name == "flashinfer":
        from srt_lite.layers.attention.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(device=device, **kwargs)
    raise ValueError(f"unknown attention backend {name!r}")
