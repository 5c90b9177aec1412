"""The GGUF tensor types srt_lite reads, and their block shapes.

A quantized GGUF row is a run of blocks, each `unit` weights in `bytes` bytes with one or
two float16 scales at fixed offsets (`halves`); everything else in a block is codes, and any
bytes there form a valid block. The kernels that read the blocks live in
csrc/cpu_gguf_linear.cpp; `dequantize` here is their reference and the fallback where they
do not run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class GGUFType:
    name: str
    id: int  # ggml's type id
    unit: int  # weights per block
    bytes: int  # bytes per block
    halves: tuple[int, ...] = ()  # offsets of the block's float16 scales

    @property
    def quantized(self) -> bool:
        return bool(self.halves)

    def row_bytes(self, cols: int) -> int:
        return cols // self.unit * self.bytes


TYPES = {t.id: t for t in (
    GGUFType("F32", 0, 1, 4),
    GGUFType("F16", 1, 1, 2),
    GGUFType("BF16", 30, 1, 2),
    GGUFType("Q4_0", 2, 32, 18, (0,)),
    GGUFType("Q4_1", 3, 32, 20, (0, 2)),
    GGUFType("Q5_0", 6, 32, 22, (0,)),
    GGUFType("Q5_1", 7, 32, 24, (0, 2)),
    GGUFType("Q8_0", 8, 32, 34, (0,)),
    GGUFType("Q4_K", 12, 256, 144, (0, 2)),
    GGUFType("Q5_K", 13, 256, 176, (0, 2)),
    GGUFType("Q6_K", 14, 256, 210, (208,)),
)}
BY_NAME = {t.name: t for t in TYPES.values()}
QUANTIZED = tuple(t.name for t in TYPES.values() if t.quantized)
_DENSE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class UnsupportedTensorType(ValueError):
    pass


def lookup(type_id: int, tensor: str = "") -> GGUFType:
    """The type of id `type_id`, or an error that names the type and the tensor."""
    if type_id not in TYPES:
        from gguf import GGMLQuantizationType

        try:
            name = GGMLQuantizationType(type_id).name
        except ValueError:
            name = f"id {type_id}"
        where = f" (tensor {tensor})" if tensor else ""
        supported = ", ".join(t.name for t in TYPES.values())
        raise UnsupportedTensorType(f"GGUF tensor type {name}{where} is not supported; supported: {supported}")
    return TYPES[type_id]


def dense(raw: torch.Tensor, t: GGUFType, cols: int) -> torch.Tensor:
    """A float type's bytes uint8 [rows, cols * size] as a tensor [rows, cols] (a view)."""
    return raw.view(_DENSE[t.name]).view(raw.shape[0], cols)


def dequantize(raw: torch.Tensor, t: GGUFType, cols: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] of type `t` -> float32 [rows, cols]: the C++ op where it is
    built, else gguf's own numpy reference."""
    if not t.quantized:
        return dense(raw, t, cols).float()
    if _kernels_built():
        return torch.ops.srt_lite_cpu.gguf_dequantize(raw.contiguous(), t.id, cols)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as np_dequantize

    out = np_dequantize(raw.contiguous().numpy(), GGMLQuantizationType(t.id))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).view(raw.shape[0], cols)


def _kernels_built() -> bool:
    from srt_lite import cpu_kernels

    return cpu_kernels.load()


def random_blocks(t: GGUFType, rows: int, cols: int, gen: torch.Generator, scale: float = 0.01) -> torch.Tensor:
    """uint8 [rows, row_bytes] of random blocks whose float16 scales lie in [scale / 2, scale]
    (for tests and synthetic benchmark files): every other byte is a valid code."""
    raw = torch.randint(0, 256, (rows, cols // t.unit, t.bytes), generator=gen, dtype=torch.uint8)
    for off in t.halves:
        halves = (torch.rand(rows, cols // t.unit, generator=gen) * 0.5 + 0.5) * scale
        raw[:, :, off : off + 2] = halves.half().view(torch.uint8).view(rows, cols // t.unit, 2)
    return raw.view(rows, -1)
