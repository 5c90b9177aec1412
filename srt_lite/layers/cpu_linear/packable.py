"""PackableLinear: a linear layer that computes through the CPU path its model runner chose,
the registration of its products as ops for torch.compile and the C++ decoder stack."""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from srt_lite import cpu_kernels
from srt_lite.layers import batch_invariant
from srt_lite.layers.cpu_linear.gguf import GGUFStaging, GGUFWeight
from srt_lite.layers.cpu_linear.paths import (
    PATH_BF16_KERNEL, PATH_F32_PANELS, PATH_PACKED, PATH_PANELS, PATH_WIDE_PANELS, bf16_kernel_rows, int4_panel_rows,
    int4_rows,
)
from srt_lite.layers.cpu_linear.products import (
    amx_panels_ok, bf16_kernel_linear, int4_linear, int4_pack, int4_panel_linear, pack_int4_panels, pack_panels,
    pack_weight, packed_linear, panel_linear, panel_shape,
)
from srt_lite.model_loader.gguf_model import QuantSource
from srt_lite.model_loader.weight_utils import TensorSource


class PackableLinear(nn.Module):
    """y = x W^T (+ b), through the CPU linear path the model runner chose.

    On a CPU in bfloat16, F.linear hands oneDNN a plain weight that it reorders into its
    blocked layout on every call; for the small M of decode steps that reorder costs more
    than the product itself (docs/benchmarks.md has the figures). pack_for_cpu() does
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
        (the oneDNN-packed weight). Keep in step with matmul: tests/e2e/test_cpp_decoder.py
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
