"""Linear layers sharded for tensor parallelism (Megatron style).

Column-parallel layers split the output dimension (no communication in forward); row-parallel
layers split the input dimension and all-reduce their partial sums. Each parameter carries a
`weight_loader(param, source, shard_id)` that reads only this rank's slice of a checkpoint
tensor, so loading never materialises a full tensor on every rank.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from srt_lite import cpu_caps
from srt_lite.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from srt_lite.layers import batch_invariant, cpu_kernels
from srt_lite.layers.gguf_linear import GGUFStaging, GGUFWeight
from srt_lite.model_loader.gguf_model import QuantSource
from srt_lite.model_loader.weight_utils import TensorSource, read_narrow


def divide(a: int, b: int) -> int:
    if a % b != 0:
        raise ValueError(f"{a} is not divisible by {b}")
    return a // b


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


def bf16_kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] -> [n, out] with bf16 weight [out, in], fp32 accumulation (PATH_BF16_KERNEL)."""
    return torch.ops.srt_lite_cpu.bf16_linear(x, weight, bias, bf16_kernel_rows())


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


class PackableLinear(nn.Module):
    """y = x W^T (+ b), through the CPU linear path the model runner chose.

    On a CPU in bfloat16, F.linear hands oneDNN a plain weight that it reorders into its
    blocked layout on every call; for the small M of decode steps that reorder costs more
    than the product itself (a 1 x 576 x 3072 product ran at ~8 GB/s). pack_for_cpu() does
    the reorder once after loading; the results are bit-identical to F.linear. Where oneDNN
    has no bf16, use_bf16_kernel() sends the product to the C++ bf16 kernel instead.
    """

    weight: nn.Parameter
    packed_weight: torch.Tensor | None = None
    packed_key: int = -1  # index in _PACKED, for the compiled graph's opaque op
    cpp_key: int = -1  # the weight's key for srt_lite_cpu::packed_linear (C++), if built
    bf16_kernel: bool = False
    int4: tuple[torch.Tensor, torch.Tensor] | None = None  # see use_int4
    int4_panels: tuple[torch.Tensor, torch.Tensor] | None = None  # see use_int4
    panels: torch.Tensor | None = None  # see use_panels
    panels_amx: bool = False  # the panels go through AMX tiles (amx_panels_ok)
    gguf: GGUFWeight | None = None  # the weight in a GGUF file's blocks, see stage_gguf
    gguf_parts = 1  # checkpoint tensors the weight is made of
    _gguf_staging: GGUFStaging | None = None

    def stage_gguf(self, param: nn.Parameter, src: TensorSource, key, offset: int,
                   rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> bool:
        """Keeps the quantized blocks of this rank's slice of `src` (its `rows` or `cols`,
        (start, length)) as the part of the weight at output `offset`, instead of reading them
        dequantized. False where `src` is not kept in blocks or the slice cuts a block."""
        if param is not self.weight or not isinstance(src, QuantSource) or not src.keep:
            return False
        piece = src.narrow_rows(*rows) if rows is not None else src.narrow_cols(*cols)
        if piece is None:
            return False
        if self._gguf_staging is None:
            self._gguf_staging = GGUFStaging(self.gguf_parts)
        self._gguf_staging.add(key, offset, piece)
        return True

    def finish_gguf(self) -> None:
        """After loading: the staged blocks replace the float weight when they make all of it
        (GGUFStaging.finish); else they were written into it dequantized."""
        if self._gguf_staging is None:
            return
        self.gguf = self._gguf_staging.finish(self.weight.data)
        self._gguf_staging = None
        if self.gguf is not None:
            self.out_features = self.weight.shape[0]
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def use_bf16_kernel(self) -> None:
        if self.gguf is None:
            self.bf16_kernel = True

    def use_panels(self, wide: bool = False) -> None:
        """PATH_PANELS / PATH_F32_PANELS / PATH_WIDE_PANELS (`wide`): the weight in the panel
        layout, which replaces the plain one (a plain tensor, so a compiled graph takes it as
        an input and calls the op directly)."""
        if self.gguf is not None or self.weight.shape[1] % panel_shape(self.weight.dtype, wide)[1]:
            return  # bf16's layout pairs K: an odd one keeps F.linear
        self.out_features = self.weight.shape[0]
        self.panels = pack_panels(self.weight.data, wide)
        self.panels_amx = amx_panels_ok(self.panels)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def use_int4(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Adds a 4-bit copy of the weight (this rank's codes [N, K] and per-32 scale/zero
        [N, K/32]) for products of at most INT4_ROWS rows: a decode step at one stream reads
        a quarter of the bytes; and where the weight is in bf16 panels, 4-bit panels for
        products of up to int4_panel_rows() rows (batched decode). The full-precision weight
        stays for larger products. Batch-invariant, a layer keeps one product: the 4-bit panels
        for every row count where it has bf16 panels, else its full-precision weight alone."""
        bf16_panels = self.panels is not None and self.panels.shape[3] == 2
        if batch_invariant.enabled() and not bf16_panels:
            return
        if not batch_invariant.enabled():
            self.int4 = int4_pack(codes, scale, zero, self.weight.dtype)
        if bf16_panels:
            self.int4_panels = pack_int4_panels(codes, scale, zero)

    def pack_for_cpu(self) -> None:
        if self.gguf is not None:
            return
        out_features = self.weight.shape[0]
        # The opaque packed copy replaces the plain one, so the weights are not held twice.
        self.packed_weight = pack_weight(self.weight.data)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        self.out_features = out_features
        self.packed_key = len(_PACKED)
        _PACKED.append(weakref.ref(self))
        if cpu_kernels.load():
            self.cpp_key = torch.ops.srt_lite_cpu.register_packed_weight(self.packed_weight)
            _CPP_OUT_FEATURES[self.cpp_key] = out_features
            _register_cpp_fake()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # A traced graph serves many row counts (a symbolic size): only the single-token
        # graph, whose size is a plain int, takes the 4-bit copies.
        if self.gguf is not None:
            return self.gguf.forward(x, bias)
        rows = x.shape[0]
        if self.int4 is not None and isinstance(rows, int) and rows <= int4_rows():
            y = int4_linear(x, *self.int4)
            return y if bias is None else y + bias
        if self.int4_panels is not None and isinstance(rows, int) and rows <= int4_panel_rows():
            return int4_panel_linear(x, self.int4_panels, bias, self.out_features, self.panels_amx)
        if self.panels is not None:
            return panel_linear(x, self.panels, bias, self.out_features, self.panels_amx)
        if self.bf16_kernel:
            return bf16_kernel_linear(x, self.weight, bias)
        if self.packed_weight is None:
            return F.linear(x, self.weight, bias)
        if torch.compiler.is_compiling():
            # A oneDNN-packed weight is an opaque tensor that torch.compile cannot trace:
            # the graph calls the product as one custom op by the layer's key: the C++ op
            # when it is built (called from inductor's C++ wrapper without Python).
            if self.cpp_key >= 0:
                return torch.ops.srt_lite_cpu.packed_linear(x, bias, self.cpp_key)
            return torch.ops.srt_lite.packed_linear(x, bias, self.packed_key)
        return packed_linear(x, self.packed_weight, bias)


    def cpp_choice(self, rows: int) -> tuple[int, torch.Tensor, torch.Tensor | None, int] | None:
        """The product matmul() runs for `rows` rows (no traced graph), as the C++ decoder
        stack takes it: (kind, weight, its scales or None, n); None where it has no C++ form
        (the oneDNN-packed weight). Keep in step with matmul: tests/test_cpp_decoder.py
        checks the stack against the Python layers at each row class."""
        if self.gguf is not None:  # GGUFWeight.forward through its registered parts
            return CPP_GGUF, self.gguf.kernel_parts[0], None, self.gguf.cpp_key()
        if self.int4 is not None and rows <= int4_rows():
            return CPP_INT4, self.int4[0], self.int4[1], 0
        if self.int4_panels is not None and rows <= int4_panel_rows():
            kind = CPP_AMX_INT4 if self.panels_amx else CPP_INT4_PANELS
            return kind, self.int4_panels[0], self.int4_panels[1], self.out_features
        if self.panels is not None:
            if self.panels.shape[3] == 1:
                return CPP_F32_PANELS, self.panels, None, self.out_features
            return (CPP_AMX_PANELS if self.panels_amx else CPP_PANELS), self.panels, None, self.out_features
        if self.bf16_kernel:
            return CPP_BF16_KERNEL, self.weight, None, bf16_kernel_rows()
        if self.packed_weight is None:
            return CPP_TORCH, self.weight, None, 0
        return None


# The products of srt_lite_cpu::decoder_layers (enum Kind in csrc/cpu_decoder.cpp).
(CPP_INT4, CPP_AMX_INT4, CPP_PANELS, CPP_AMX_PANELS, CPP_F32_PANELS, CPP_BF16_KERNEL, CPP_TORCH,
 CPP_INT4_PANELS, CPP_GGUF) = range(1, 10)


def cpp_row_bounds() -> tuple[int, int]:
    """Row counts at which matmul's choice can change: the C++ stack holds one choice per
    class (up to the first bound, up to the second, more)."""
    return int4_rows(), min(int4_panel_rows(), 1 << 20)


# Every packed linear of the process, by packed_key; weak, so a dropped model is freed.
_PACKED: list["weakref.ref[PackableLinear]"] = []


@torch.library.custom_op("srt_lite::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    return packed_linear(x, _PACKED[key]().packed_weight, bias)


@_packed_linear_op.register_fake
def _(x: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], _PACKED[key]().out_features)  # [T, out_features]


# out_features of each weight registered with the C++ op, for its fake (shape) function.
_CPP_OUT_FEATURES: dict[int, int] = {}


@functools.cache
def _register_cpp_fake() -> None:
    """Shape functions of the C++ linears, for torch.compile's tracing."""

    @torch.library.register_fake("srt_lite_cpu::packed_linear")
    def _(x: torch.Tensor, bias: torch.Tensor | None, key: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], _CPP_OUT_FEATURES[key])  # [T, out_features]

    @torch.library.register_fake("srt_lite_cpu::bf16_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])  # [T, out_features]

    @torch.library.register_fake("srt_lite_cpu::panel_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)  # [T, out_features]

    @torch.library.register_fake("srt_lite_cpu::amx_panel_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)  # [T, out_features]

    @torch.library.register_fake("srt_lite_cpu::amx_int4_panel_linear")
    def _(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)  # [T, out_features]

    @torch.library.register_fake("srt_lite_cpu::int4_panel_linear")
    def _(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)  # [T, out_features]

    @torch.library.register_fake("srt_lite_cpu::f32_panel_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)  # [T, out_features]


def prepare_linears_for_cpu(model: nn.Module, path: str) -> None:
    """Readies every linear of a CPU model, and the LM head (the embedding, see
    VocabParallelEmbedding), for `path`: prepacked for oneDNN, in srt_lite's panel layout,
    or the C++ bf16 kernel."""
    if path in (PATH_BF16_KERNEL, PATH_PANELS, PATH_F32_PANELS, PATH_WIDE_PANELS):
        _register_cpp_fake()  # for torch.compile, before any graph is traced
    for m in model.modules():
        if path == PATH_PACKED and hasattr(m, "pack_for_cpu"):
            m.pack_for_cpu()
        elif path in (PATH_PANELS, PATH_F32_PANELS, PATH_WIDE_PANELS) and hasattr(m, "use_panels"):
            m.use_panels(wide=path == PATH_WIDE_PANELS)
        elif path == PATH_BF16_KERNEL and hasattr(m, "use_bf16_kernel"):
            m.use_bf16_kernel()


class ColumnParallelLinear(PackableLinear):
    """y = x W^T + b with W split by rows (output features) across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_size_per_rank = divide(output_size, self.tp_size)
        self.weight_shape = (self.output_size_per_rank, input_size)  # kept when the weight is packed
        # [out / tp, in]
        self.weight = nn.Parameter(torch.empty(*self.weight_shape), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None

    def weight_loader(self, param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        n = param.shape[0]
        if not self.stage_gguf(param, src, None, 0, rows=(self.tp_rank * n, n)):
            param.data.copy_(read_narrow(src, 0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (e.g. gate_proj and up_proj). Each rank holds its slice of every part, concatenated."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        self.gguf_parts = len(output_sizes)

    def weight_loader(self, param: nn.Parameter, src: TensorSource, shard_id: int) -> None:
        per_rank = [divide(s, self.tp_size) for s in self.output_sizes]
        offset = sum(per_rank[:shard_id])
        n = per_rank[shard_id]
        if not self.stage_gguf(param, src, shard_id, offset, rows=(self.tp_rank * n, n)):
            param.data[offset : offset + n].copy_(read_narrow(src, 0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused. Query heads are split across ranks; KV heads are split
    when there are at least tp_size of them, else each is replicated on tp_size/num_kv ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
    ):
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size)
        if num_kv_heads >= tp_size:
            self.num_kv_heads = divide(num_kv_heads, tp_size)
            self.num_kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.num_kv_replicas = divide(tp_size, num_kv_heads)
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, total, bias)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.gguf_parts = 3

    def weight_loader(self, param: nn.Parameter, src: TensorSource, shard_id: str) -> None:
        if shard_id == "q":
            offset, n = 0, self.q_size
            start = self.tp_rank * n
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            n = self.kv_size
            start = (self.tp_rank // self.num_kv_replicas) * n
        if not self.stage_gguf(param, src, shard_id, offset, rows=(start, n)):
            param.data[offset : offset + n].copy_(read_narrow(src, 0, start, n))


class RowParallelLinear(PackableLinear):
    """y = x W^T + b with W split by columns (input features); partial sums are all-reduced.
    The input arrives already split (it is the output of a column-parallel layer)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_rank = divide(input_size, self.tp_size)
        self.weight_shape = (output_size, self.input_size_per_rank)  # kept when the weight is packed
        # [out, in / tp]
        self.weight = nn.Parameter(torch.empty(*self.weight_shape), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self._load_bias
        else:
            self.bias = None

    def weight_loader(self, param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        n = param.shape[1]
        if not self.stage_gguf(param, src, None, 0, cols=(self.tp_rank * n, n)):
            param.data.copy_(read_narrow(src, 1, self.tp_rank * n, n))

    @staticmethod
    def _load_bias(param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        param.data.copy_(read_narrow(src, 0, 0, param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = tp_all_reduce(self.matmul(x, None))
        if self.bias is not None:
            # Added once, after the reduction, not once per rank.
            y = y + self.bias
        return y
