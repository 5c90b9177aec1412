"""Which product a CPU linear runs: the path a model's linears take (chosen once per model),
and the row counts at which a layer switches between its copies of a weight."""

from __future__ import annotations

import functools

import torch

from srt_lite import cpu_caps
from srt_lite import cpu_kernels
from srt_lite.layers import batch_invariant


# How a CPU model's linears (and LM head) compute, chosen once per model by cpu_linear_path().
PATH_TORCH = "torch"  # F.linear: fp32 (MKL/oneDNN), fp16, or bf16 without a better path


PATH_PACKED = "onednn-packed"  # bf16 weights prepacked once for oneDNN (where it runs bf16)


PATH_BF16_KERNEL = "bf16-kernel"  # bf16 weights, fp32 math in srt_lite_cpu::bf16_linear


PATH_PANELS = "bf16-panels"  # bf16 weights in srt_lite's panel layout (srt_lite_cpu::panel_linear)


PATH_F32_PANELS = "f32-panels"  # fp32 weights in the panel layout (srt_lite_cpu::f32_panel_linear)


PATH_WIDE_PANELS = "bf16-wide-panels"  # bf16 weights in the fp32 panel layout, widened as they are read


# Rows up to which bf16_linear runs its weight-streaming kernel; above, a widened fp32 copy
# and the fp32 matmul are faster (on AVX2 the two are level at about 16 rows).
BF16_KERNEL_ROWS = 16


def cpu_linear_path(dtype: torch.dtype, disable_packing: bool = False, caps: cpu_caps.CpuCaps | None = None,
                    kernels_built: bool | None = None, amx_built: bool | None = None) -> str:
    """The fastest linear path that runs on this CPU (or `caps`) for `dtype` weights;
    `kernels_built` and `amx_built` (the AMX panel op runs, which defaults to
    `kernels_built`) stand in for this process's build of the ops in tests.
    oneDNN's bf16 is fast where the CPU has bf16 instructions; without them oneDNN either
    refuses bf16 (AVX2) or emulates it slowly (AVX-512 without BF16), and torch's own bf16
    matmul is a reference loop beyond one row. There srt_lite's own kernels run, when built
    (docs/benchmarks.md, "The dtype rule", has the figures).
    With AVX512-BF16 but no AMX, srt_lite's panel kernel reads a one-token product's weight
    about twice as fast as oneDNN's packed GEMV and is level with it from a few dozen rows
    up (docs/benchmarks.md, "Panel layout"). With AMX the same panels go through AMX tiles
    (srt_lite_cpu::amx_panel_linear), which stream a decode step's weights about a third
    faster than oneDNN's AMX kernels (docs/benchmarks.md, "AMX panels"); without the AMX op
    in the build (or the OS's leave to use the tiles) AMX CPUs keep oneDNN.
    fp32 takes the fp32 panel kernel on AVX2 and AVX-512, where MKL reads a decode step's
    weights at a fraction of the memory's speed (docs/benchmarks.md, "fp32 panels"), and
    bf16 on those CPUs without BF16 instructions the same kernel with the weights widened to
    fp32 as they are read, which beat the C++ bf16 kernel at every row count measured; other
    CPUs keep F.linear or the bf16 kernel, on which the panels are not measured."""
    if disable_packing or dtype not in (torch.bfloat16, torch.float32):
        return PATH_TORCH
    caps = caps or cpu_caps.get()
    x86_vectors = caps.level in ("avx2", "avx512")
    if dtype == torch.float32:
        built = cpu_kernels.load() if kernels_built is None else kernels_built
        return PATH_F32_PANELS if built and x86_vectors else PATH_TORCH
    built = panels_built() if kernels_built is None else kernels_built
    if amx_built is None:
        amx_built = amx_panels_built() if kernels_built is None else kernels_built
    if caps.avx512_bf16 and built and (not caps.amx_bf16 or amx_built):
        return PATH_PANELS
    if caps.onednn_bf16 and caps.native_bf16:
        return PATH_PACKED
    if cpu_kernels.load() if kernels_built is None else kernels_built:
        return PATH_WIDE_PANELS if x86_vectors else PATH_BF16_KERNEL
    return PATH_PACKED if caps.onednn_bf16 else PATH_TORCH


def bf16_kernel_rows() -> int:
    """Rows up to which bf16_linear streams the weight; batch-invariant: every row count (the
    widened matmul above rounds by its own blocking)."""
    return batch_invariant.ALL_ROWS if batch_invariant.enabled() else BF16_KERNEL_ROWS


@functools.cache
def panels_built() -> bool:
    """Whether srt_lite_cpu::panel_linear (and bf16_gemv) are in this process's build of the
    ops and the CPU runs them (AVX512-BF16, checked by the op itself)."""
    return cpu_kernels.load() and torch.ops.srt_lite_cpu.bf16_gemv_supported()


@functools.cache
def amx_panels_built() -> bool:
    """Whether srt_lite_cpu::amx_panel_linear runs here: AMX-BF16 in the CPU (not capped by
    SRT_LITE_CPU_CAPS), in this build of the ops, and granted by the OS."""
    return cpu_caps.get().amx_bf16 and panels_built() and torch.ops.srt_lite_cpu.amx_supported()


@functools.cache
def bf16_gemv_available() -> bool:
    """Whether srt_lite_cpu::bf16_gemv runs here: AVX512-BF16 in the CPU (not capped by
    SRT_LITE_CPU_CAPS) and in the build. One token's product with a plain bf16 weight reads
    it faster than oneDNN's prepacked GEMV (docs/benchmarks.md, "One-token GEMV")."""
    return cpu_kernels.bf16_dots_available()


# Rows up to which a linear with a 4-bit copy (a GGUF's Q4_0/Q4_1 weights) uses it. torch's
# CPU int4 matmul reads the weight once per row: at one or two rows it reads a quarter of the
# bf16 bytes and wins; from a few rows on, the bf16 product is faster.
INT4_ROWS = 2


INT4_GROUP = 32


# Rows up to which a linear with bf16 panels takes its 4-bit panels beyond INT4_ROWS: a third
# of bf16's bytes, with each group's products scaled after, which costs more per row than the
# bf16 product from some rows up: a few dozen on AMX tiles (srt_lite_cpu::amx_int4_panel_linear),
# fewer in AVX512-BF16 dot products (srt_lite_cpu::int4_panel_linear), where each group's
# values are also looked up for every pass (docs/benchmarks.md, "AMX panels", "4-bit panels").
AMX_INT4_ROWS = 32


DOT_INT4_ROWS = 8


def int4_rows() -> int:
    """Rows up to which torch's int4 matmul runs; none when batch-invariant (a layer then
    keeps one product for every row count)."""
    return 0 if batch_invariant.enabled() else INT4_ROWS


def int4_panel_rows() -> int:
    """This process's bound for the 4-bit panels: a 4-bit linear's K is whole groups of 32,
    so its panels go through AMX tiles wherever the tiles run (amx_panels_ok). Batch-invariant:
    every row count, so that the layer's weights are the same 4 bits at any batch size."""
    if batch_invariant.enabled():
        return batch_invariant.ALL_ROWS
    return AMX_INT4_ROWS if amx_panels_built() else DOT_INT4_ROWS
