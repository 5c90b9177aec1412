"""The tensor-parallel group of this process. At tp_size 1 every collective is a no-op."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


def init_distributed(tp_rank: int, tp_size: int, device: str, dist_port: int | None) -> None:
    """Joins the TP group: gloo on CPU, NCCL on CUDA, rendezvous on 127.0.0.1:dist_port."""
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = tp_rank, tp_size
    if tp_size == 1:
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://127.0.0.1:{dist_port}",
        rank=tp_rank,
        world_size=tp_size,
        timeout=datetime.timedelta(seconds=600),
    )


def set_tp(tp_rank: int, tp_size: int) -> None:
    """For tests that build sharded layers without a process group."""
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = tp_rank, tp_size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates each rank's shard of `x` along `dim`, in rank order."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
