"""The CPU products of a linear and the weight layouts they read: oneDNN's prepacked weight,
srt_lite's bf16/fp32 panels, the C++ bf16 kernel, and the 4-bit copies (torch's int4 matmul
and the 4-bit panels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from srt_lite.layers.cpu_linear.paths import INT4_GROUP, amx_panels_built, bf16_kernel_rows


# Batch size oneDNN tunes a prepacked weight's layout for (decode batches are small).
PACK_BATCH_HINT = 16


# oneDNN builds (JIT) and caches a primitive per input shape, which costs time and memory for
# each new token count. Mixed batches see a new count almost every step, so counts above
# EXACT_ROWS are padded up to a multiple of ROW_BUCKET: a few dozen shapes, all soon cached.
# 16, not 32: verify steps often carry 33-48 tokens, and while the weights are read once a
# few dozen rows cost little more than 16, padding them to 64 costs noticeably more
# (docs/benchmarks.md, "Row buckets").
EXACT_ROWS = 16


ROW_BUCKET = 16


def bucketed_rows(n: int) -> int:
    return n if n <= EXACT_ROWS else -(-n // ROW_BUCKET) * ROW_BUCKET


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight reordered once into oneDNN's blocked layout (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] -> [n, out] through a pack_weight() weight, bit-identical to F.linear."""
    n = x.shape[0]
    rows = bucketed_rows(n)
    if rows != n:
        x = F.pad(x, (0, 0, 0, rows - n))  # [rows, in]; the extra rows are dropped below
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")[:n]


def bf16_kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] -> [n, out] with bf16 weight [out, in], fp32 accumulation (PATH_BF16_KERNEL)."""
    return torch.ops.srt_lite_cpu.bf16_linear(x, weight, bias, bf16_kernel_rows())


# Output rows of one panel of pack_panels' layout (kPanelRows and kF32PanelRows in
# cpu_linear.cpp), and the k elements grouped in a vector lane: bf16's dot product takes
# a pair of k, fp32's multiply-add one.
PANEL_ROWS = 64


F32_PANEL_ROWS = 32


# k pairs of one AMX tile (kTilePairs in cpu_amx_linear.cpp): the AMX op takes K in whole
# tiles, other K the AVX-512 panel op.
AMX_TILE_PAIRS = 16


def panel_shape(dtype: torch.dtype, wide: bool = False) -> tuple[int, int]:
    """(outputs a panel holds, k elements grouped) of the panel layout for `dtype` weights;
    wide: bf16 in the fp32 layout (PATH_WIDE_PANELS)."""
    return (PANEL_ROWS, 2) if dtype == torch.bfloat16 and not wide else (F32_PANEL_ROWS, 1)


def pack_panels(weight: torch.Tensor, wide: bool = False) -> torch.Tensor:
    """A [N, K] weight in srt_lite's panel layout, [N / R, K / G, R, G] (zero padded), with
    (R, G) = panel_shape: bf16 [N / 64, K / 2, 64, 2], fp32 (and bf16 with `wide`)
    [N / 32, K, 32, 1]. Each k group of a panel's outputs is contiguous, as
    srt_lite_cpu::panel_linear / f32_panel_linear read it."""
    rows, group = panel_shape(weight.dtype, wide)
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -k % group, 0, -n % rows))  # [N', K']
    return padded.view(padded.shape[0] // rows, rows, padded.shape[1] // group, group).transpose(1, 2).contiguous()


def amx_panels_ok(panels: torch.Tensor) -> bool:
    """Whether a pack_panels() weight goes through AMX tiles: bf16's layout, K in whole
    tiles, and the AMX op runs here."""
    return panels.shape[3] == 2 and panels.shape[1] % AMX_TILE_PAIRS == 0 and amx_panels_built()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                 amx: bool | None = None) -> torch.Tensor:
    """x [n, in] -> [n, out] through a pack_panels() weight, in x's dtype. The fp32 layout
    (bf16 weights too, with `wide`) computes in fp32: a bf16 x is widened, the output rounded.
    amx: the bf16 layout through AMX tiles (default: amx_panels_ok). Layers decide it once
    when they pack, so that a traced graph holds a constant rather than the checks."""
    if panels.shape[3] == 1:
        y = torch.ops.srt_lite_cpu.f32_panel_linear(x.float(), panels, bias, out_features)
        return y.to(x.dtype)
    if amx_panels_ok(panels) if amx is None else amx:
        return torch.ops.srt_lite_cpu.amx_panel_linear(x, panels, bias, out_features)
    return torch.ops.srt_lite_cpu.panel_linear(x, panels, bias, out_features)


def int4_pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K] (0..15), scale/zero [N, K/32] with w = (q - 8) * scale + zero ->
    the weight and scales_and_zeros of torch._weight_int4pack_mm_for_cpu, in `dtype`."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)  # [N, K/2]
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()  # [K/32, N, 2]
    return packed, scales_and_zeros


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [n, in] -> [n, out] through an int4_pack() weight."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, INT4_GROUP, scales_and_zeros)


def pack_int4_panels(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K] (0..15), scale/zero [N, K/32] with w = (q - 8) * scale + zero ->
    the 4-bit panels of srt_lite_cpu::amx_int4_panel_linear and int4_panel_linear (the
    layout of csrc/cpu_int4.h): codes [N / 64, K / 4, 4, 32] uint8 (for each two k pairs
    and each 16-output AMX tile of a panel, 32 bytes holding element j of the first pair's
    tile row in byte j's low nibble and of the second's in its high one; element e is
    output e / 2 at k 2p + e % 2) and sz [N / 64, K / 32, 2, 64] fp32 (scale, then zero,
    per group and output). Padded outputs get code 0 and scale = zero = 0."""
    n, k = codes.shape
    pad = -n % PANEL_ROWS
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad)).view(-1, PANEL_ROWS, k // 2, 2)  # [P, 64, K/2, 2]
    rows = codes.transpose(1, 2).reshape(-1, k // 4, 2, 4, 32)  # [P, K/4, pair, tile, element]
    packed = (rows[:, :, 0] | (rows[:, :, 1] << 4)).contiguous()  # [P, K/4, 4, 32]
    sz = torch.stack([scale.float(), zero.float()], dim=1)  # [N, 2, K/32]
    sz = torch.nn.functional.pad(sz, (0, 0, 0, 0, 0, pad)).view(-1, PANEL_ROWS, 2, k // INT4_GROUP)
    return packed, sz.permute(0, 3, 2, 1).contiguous()  # [P, K/32, 2, 64]


def int4_panel_linear(x: torch.Tensor, int4_panels: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None,
                      out_features: int, amx: bool) -> torch.Tensor:
    """x [n, in] -> [n, out] bf16 through pack_int4_panels()' (codes, sz), on AMX tiles or in
    AVX512-BF16 dot products (`amx`: the layer's bf16 panels go through the tiles)."""
    if amx:
        return torch.ops.srt_lite_cpu.amx_int4_panel_linear(x, *int4_panels, bias, out_features)
    return torch.ops.srt_lite_cpu.int4_panel_linear(x, *int4_panels, bias, out_features)
