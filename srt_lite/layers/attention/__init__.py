from __future__ import annotations

from srt_lite.layers.attention.base import AttentionBackend


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


def create_attention_backend(name: str, device: str, model_runner=None) -> AttentionBackend:
    """`auto` picks flashinfer on CUDA when the package is installed, else torch_native."""
    on_cuda = device.startswith("cuda")
    if name == "auto":
        name = "flashinfer" if on_cuda and flashinfer_available() else "torch_native"
    if name == "torch_native":
        from srt_lite.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return TorchNativeAttnBackend(device=device)
    if name == "flashinfer":
        if not on_cuda:
            raise ValueError("--attention-backend flashinfer needs a CUDA device; use torch_native on the CPU")
        if not flashinfer_available():
            raise ValueError("--attention-backend flashinfer needs the flashinfer-python package (pip install flashinfer-python)")
        from srt_lite.layers.attention.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(model_runner)
    raise ValueError(f"unknown attention backend {name!r}")
