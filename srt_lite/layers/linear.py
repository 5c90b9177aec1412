"""Linear layers sharded for tensor parallelism (Megatron style).

Column-parallel layers split the output dimension (no communication in forward); row-parallel
layers split the input dimension and all-reduce their partial sums. Each parameter carries a
`weight_loader(param, source, shard_id)` that reads only this rank's slice of a checkpoint
tensor, so loading never materialises a full tensor on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from srt_lite.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from srt_lite.layers.cpu_linear.packable import PackableLinear
from srt_lite.model_loader.weight_utils import TensorSource, read_narrow


def divide(a: int, b: int) -> int:
    if a % b != 0:
        raise ValueError(f"{a} is not divisible by {b}")
    return a // b


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
