"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt_lite.distributed import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from srt_lite.layers import batch_invariant
from srt_lite import cpu_kernels
from srt_lite.layers.cpu_linear.gguf import GGUFWeight
from srt_lite.layers.cpu_linear.products import (
    amx_panels_ok, bf16_kernel_linear, pack_panels, pack_weight, packed_linear, panel_linear, panel_shape,
)
from srt_lite.layers.cpu_linear.paths import bf16_gemv_available
from srt_lite.model_loader.gguf_model import QuantSource
from srt_lite.model_loader.weight_utils import TensorSource, read_narrow


class VocabParallelEmbedding(nn.Module):
    # Set on the input embedding of a model whose LM head is a separate weight: the lookup
    # is all it does, so it keeps no copy for the head's product.
    lookup_only = False

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        # Pad so that every rank gets the same number of rows; padded rows are never used.
        self.vocab_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.vocab_end = min(self.vocab_start + self.vocab_per_rank, vocab_size)
        # [vocab / tp, hidden]
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.packed_weight: torch.Tensor | None = None  # the LM head's copy, see pack_for_cpu
        self.bf16_kernel = False  # the LM head through the C++ bf16 kernel, see use_bf16_kernel
        self.gemv = False  # one token's logits from the plain weight, see pack_for_cpu
        self.panels: torch.Tensor | None = None  # the LM head in the panel layout, see use_panels
        self.panels_amx = False  # the panels go through AMX tiles (amx_panels_ok)
        self.gguf: GGUFWeight | None = None  # the weight in a GGUF file's blocks
        self.hidden_size = hidden_size

    def weight_loader(self, param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        n = self.vocab_end - self.vocab_start
        if isinstance(src, QuantSource) and src.keep:
            # Kept in its blocks: lookups dequantize their rows, the logits take the blocks.
            raw = src.narrow_rows(self.vocab_start, n).raw
            if n < self.vocab_per_rank:  # zero blocks (zero scales) for the padding rows
                raw = F.pad(raw, (0, 0, 0, self.vocab_per_rank - n))
            self.gguf = GGUFWeight([(src.type, raw)], src.cols, pack=not self.lookup_only)
            param.data = torch.empty(0, dtype=param.dtype)
            return
        param.data[:n].copy_(read_narrow(src, 0, self.vocab_start, n))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of this rank's weight, [T] -> [T, hidden]: from the panels when they
        replaced the plain weight (a gather of each row's k pairs)."""
        if self.gguf is not None:
            return self.gguf.lookup(ids, self.weight.dtype)
        if self.panels is None:
            return F.embedding(ids, self.weight)
        per_panel = self.panels.shape[2]
        rows = self.panels[ids // per_panel, :, ids % per_panel]  # [T, K / G, G]
        return rows.reshape(ids.shape[0], -1)[:, : self.hidden_size]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(mask, 0)
        out = self.lookup(local)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return tp_all_reduce(out)

    def pack_for_cpu(self) -> None:
        """bfloat16 on the CPU: F.linear reorders this large weight into oneDNN's layout on
        every call, so the LM head keeps a copy packed once (vocab x hidden x 2 bytes more;
        the lookup needs the plain weight). It beats both F.linear and W @ x^T with a
        transposing copy, at decode and at verify row counts (docs/benchmarks.md)."""
        if self.lookup_only or self.gguf is not None:
            return
        self.packed_weight = pack_weight(self.weight.data)
        # The plain weight stays for the lookup, and one token's logits read it faster in
        # srt_lite_cpu::bf16_gemv than oneDNN's GEMV reads the packed copy.
        self.gemv = bf16_gemv_available() and not batch_invariant.enabled()  # one product for all rows

    def use_panels(self, wide: bool = False) -> None:
        """PATH_PANELS / PATH_F32_PANELS / PATH_WIDE_PANELS (`wide`): the LM head in
        srt_lite's panel layout, as the linears. The panels replace the plain weight, and the
        lookup gathers its rows from them, so a tied embedding holds one copy. bf16's layout
        pairs K: an odd one keeps F.linear."""
        if self.lookup_only or self.gguf is not None or self.weight.shape[1] % panel_shape(self.weight.dtype, wide)[1]:
            return
        self.panels = pack_panels(self.weight.data, wide)
        self.panels_amx = amx_panels_ok(self.panels)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def use_bf16_kernel(self) -> None:
        """bfloat16 on a CPU where oneDNN has no bf16: the LM head's product as the linears'."""
        self.bf16_kernel = self.gguf is None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, vocab] float32 logits."""
        if self.gguf is not None:
            logits = self.gguf.forward(hidden, fp32_out=True)
        elif self.gemv and hidden.shape[0] == 1 and cpu_kernels.eager_cpu(hidden):
            logits = torch.ops.srt_lite_cpu.bf16_gemv(hidden, self.weight).float()
        elif self.panels is not None:
            logits = panel_linear(hidden, self.panels, None, self.vocab_per_rank, self.panels_amx).float()
        elif self.bf16_kernel:
            logits = bf16_kernel_linear(hidden, self.weight, None).float()
        elif self.packed_weight is not None:
            logits = packed_linear(hidden, self.packed_weight, None).float()
        else:
            logits = F.linear(hidden, self.weight).float()
        if self.tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection when it is not tied to the embedding."""

    def pack_for_cpu(self) -> None:
        if self.gguf is not None:
            return
        super().pack_for_cpu()
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)  # no lookup: the packed copy is enough
        self.gemv = False
