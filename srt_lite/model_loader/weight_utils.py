"""Reading checkpoint tensors lazily, so a TP rank reads only the slice it keeps."""

from __future__ import annotations

import glob
import os
from typing import Iterator, Protocol

import torch
from safetensors import safe_open


class TensorSource(Protocol):
    """A checkpoint tensor not yet read: a safetensors slice or an in-memory tensor."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index) -> torch.Tensor: ...


class InMemory:
    """Wraps a tensor so it looks like a safetensors slice (used by tests)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def read_all(src: TensorSource) -> torch.Tensor:
    return src[tuple(slice(None) for _ in src.get_shape())]


def read_narrow(src: TensorSource, dim: int, start: int, length: int) -> torch.Tensor:
    """Reads src[..., start:start+length, ...] along `dim` without reading the rest."""
    index = [slice(None)] * len(src.get_shape())
    index[dim] = slice(start, start + length)
    return src[tuple(index)]


def checkpoint_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    return files


def count_checkpoint_tensors(model_dir: str) -> int:
    """Reads only the headers."""
    total = 0
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    return total


def iter_checkpoint(model_dir: str) -> Iterator[tuple[str, TensorSource]]:
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)
