"""A linear's weight kept in a GGUF file's quantized blocks.

`GGUFWeight` is one object with one interface, `forward(x, bias)`, whatever the row count:
srt_lite_cpu::gguf_linear (csrc/cpu_gguf_linear.cpp) takes integer dot products with int8
activations up to DOT_ROWS rows (every row count for packed weights without AMX, see
dot_rows) and dequantized slabs through a matmul above. Without the C++ ops, slabs are
dequantized in Python and go through F.linear.

On CPUs with AVX512-VNNI, parts of every type above (PACKED_TYPES) are repacked once at load, 16 rows
interleaved (csrc/cpu_gguf_linear.cpp describes the layout): one int8 dot-product instruction
then serves 16 outputs, which keeps decode at the memory's speed. With AVX2 the same types
are repacked the same way and read 8 rows a load. The file's own blocks stay
mapped for embedding lookups and checks; the packed copy is what the products read.

`GGUFStaging` collects a layer's parts while the checkpoint loads (a fused q/k/v or
gate/up projection has one per shard, possibly of different types) and decides at the end:
all parts quantized -> a GGUFWeight replaces the float weight; otherwise the parts are
dequantized into it.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from srt_lite import cpu_caps
from srt_lite.layers import batch_invariant
from srt_lite import cpu_kernels
from srt_lite.model_loader.gguf_types import GGUFType, dequantize

# Rows up to which the integer dot products run; above, dequantized slabs and a matmul,
# whose cost per row is lower once the weight's unpacking is shared by many rows.
DOT_ROWS = 16
# Output rows a Python-side slab dequantizes at once (no C++ ops): bounds the scratch copy.
_SLAB_ROWS = 1024
# The C++ ops' packed layouts: rows interleaved by PACK_ROWS, a packed part's type id is its
# GGUF id + PACKED_ID.
PACKED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
PACK_ROWS = 16
PACKED_ID = 256


def dot_rows(all_packed: bool = False) -> int:
    """Rows up to which the integer dot products run. Every row count when batch-invariant
    (the slabs' matmul rounds otherwise than the int8 products, and by its own blocking), and
    for a weight whose parts are all packed on a CPU without AMX: one vpdpbusd takes 64
    products where a bf16 dot instruction takes 32 (with AVX2, a vpmaddubsw 32 where an fp32
    fused multiply-add takes 8), and the slabs also pay for writing the dequantized weight, so
    the packed products win at every prompt length there (as llama.cpp's int8 activations do
    for its prompts). With AMX the slabs' bf16 matmul runs
    on tiles, which these products were not measured against, so AMX keeps the slabs."""
    if batch_invariant.enabled() or (all_packed and not cpu_caps.get().amx_bf16):
        return batch_invariant.ALL_ROWS
    return DOT_ROWS


def packs(t: GGUFType, rows: int) -> bool:
    """Whether a part of `rows` rows of type t is repacked for the products on this CPU (the
    C++ ops say which types their build has a packed kernel for here)."""
    return (t.name in PACKED_TYPES and rows % PACK_ROWS == 0 and cpu_kernels.load()
            and torch.ops.srt_lite_cpu.gguf_packs(t.id))


@functools.cache
def _mm_bf16() -> bool:
    """Whether a bf16 matmul is fast here (the CPU has bf16 dot products); else the slabs of a
    bf16 model's prefill are dequantized to fp32."""
    caps = cpu_caps.get()
    return caps.onednn_bf16 and caps.native_bf16


class GGUFWeight:
    """Parts uint8 [n_i, row_bytes_i] of GGUF types, outputs concatenated: [sum n_i, cols].
    pack: repack the parts the CPU has a packed kernel for (not for a lookup-only table)."""

    def __init__(self, parts: list[tuple[GGUFType, torch.Tensor]], cols: int, pack: bool = True):
        self.types = [t for t, _ in parts]
        self.raws = [raw for _, raw in parts]
        self.cols = cols
        self.rows = sum(raw.shape[0] for raw in self.raws)
        # What the products read: packed groups uint8 [n_i / 16, ...] where the CPU has them.
        self.kernel_parts, self.kernel_ids = [], []
        for t, raw in parts:
            packed = pack and packs(t, raw.shape[0])
            self.kernel_parts.append(torch.ops.srt_lite_cpu.gguf_repack(raw, t.id, cols) if packed else raw)
            self.kernel_ids.append(t.id + PACKED_ID if packed else t.id)
        self.all_packed = all(i >= PACKED_ID for i in self.kernel_ids)
        self._cpp_key: int | None = None

    def cpp_key(self) -> int:
        """This weight's key for the C++ decoder stack (srt_lite_cpu::gguf_linear_registered,
        the same product as forward), registered once and released with the weight."""
        if self._cpp_key is None:
            self._cpp_key = torch.ops.srt_lite_cpu.register_gguf_weight(self.kernel_parts, self.kernel_ids,
                                                                        dot_rows(self.all_packed), _mm_bf16())
            weakref.finalize(self, torch.ops.srt_lite_cpu.release_gguf_weight, self._cpp_key)
        return self._cpp_key

    @property
    def format(self) -> str:
        """The weight format, e.g. "Q4_K" or "Q4_K+Q6_K" for mixed parts."""
        return "+".join(dict.fromkeys(t.name for t in self.types))

    @property
    def nbytes(self) -> int:
        """Bytes the products read (a packed part holds the file's blocks, rearranged)."""
        return sum(part.numel() for part in self.kernel_parts)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None, fp32_out: bool = False) -> torch.Tensor:
        """x [n, cols] -> [n, rows] in x's dtype, or in fp32 with `fp32_out` (the logits)."""
        out_dtype = torch.float32 if fp32_out else x.dtype
        if cpu_kernels.load() and x.device.type == "cpu":
            xin = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
            rows = dot_rows(self.all_packed)
            if fp32_out and x.shape[0] <= rows:
                # The integer products quantize x whatever its dtype (bf16 widens exactly), and
                # write their fp32 sums in x's dtype: given fp32, the logits skip a bf16 rounding.
                xin = xin.float()
            mm_bf16 = xin.dtype == torch.bfloat16 and _mm_bf16()
            y = torch.ops.srt_lite_cpu.gguf_linear(xin, self.kernel_parts, self.kernel_ids, bias, rows, mm_bf16)
            return y.to(out_dtype)
        outs = []
        for t, raw in zip(self.types, self.raws):
            for r0 in range(0, raw.shape[0], _SLAB_ROWS):
                w = dequantize(raw[r0 : r0 + _SLAB_ROWS], t, self.cols).to(x.dtype)  # [slab, cols]
                outs.append(F.linear(x, w))
        y = torch.cat(outs, dim=-1)
        return (y if bias is None else y + bias).to(out_dtype)

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, cols] (for tests and checks)."""
        return torch.cat([dequantize(raw, t, self.cols) for t, raw in zip(self.types, self.raws)])

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized, [T] -> [T, cols] (an embedding held in blocks; one part).
        Read from what the products read: for a table tied to the output head that is its
        packed copy, whose values are the file's. The file's pages of it, dropped after the
        repack, would otherwise come back a few at a time with the tokens seen (the kernel
        maps neighbouring pages on each fault) until the table is resident twice."""
        if cpu_kernels.load() and ids.device.type == "cpu":
            return torch.ops.srt_lite_cpu.gguf_rows(self.kernel_parts[0], self.kernel_ids[0], self.cols, ids).to(dtype)
        return dequantize(self.raws[0].index_select(0, ids.flatten()), self.types[0], self.cols).to(dtype)


class GGUFStaging:
    """A layer's quantized parts while loading: key -> (output offset, source slice)."""

    def __init__(self, num_parts: int):
        self.num_parts = num_parts
        self.parts: dict = {}

    def add(self, key, offset: int, src) -> None:
        self.parts[key] = (offset, src)

    def finish(self, weight: torch.Tensor) -> GGUFWeight | None:
        """A GGUFWeight when every part of the layer came quantized and fills the weight's rows
        in order; else None, after writing the staged parts dequantized into `weight`."""
        ordered = sorted(self.parts.values(), key=lambda p: p[0])
        rows, contiguous = 0, True
        for offset, src in ordered:
            contiguous &= offset == rows
            rows += src.raw.shape[0]
        if len(ordered) == self.num_parts and contiguous and rows == weight.shape[0]:
            return GGUFWeight([(src.type, src.raw) for _, src in ordered], weight.shape[1])
        for offset, src in ordered:
            n = src.raw.shape[0]
            weight[offset : offset + n].copy_(dequantize(src.raw, src.type, src.cols))
        return None
