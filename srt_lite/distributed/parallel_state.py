"""The tensor-parallel group of this process. At tp_size 1 every collective is a no-op."""

from __future__ import annotations

import datetime
import logging
import os
import sys

import torch
import torch.distributed as dist

from srt_lite.distributed.rendezvous import bind_collectives_to, open_store, split_host_port

logger = logging.getLogger(__name__)

# How long a rank waits for the others: to join (a node may start minutes after another, and
# load its weights slower) and in any one collective.
JOIN_TIMEOUT = datetime.timedelta(seconds=600)
# What gloo's errors say when the rank at the other end of a connection is gone.
_PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out")

_TP_RANK = 0
_TP_SIZE = 1
_CPU_GROUP = None  # gloo group for host-side control traffic (also when NCCL does the math)
_SUM_IN_RANK_ORDER = False  # see sum_in_rank_order


def init_distributed(
    tp_rank: int, tp_size: int, device: str, dist_init_addr: str | None, local_rank: int | None = None
) -> None:
    """Joins the TP group: gloo on CPU, NCCL on CUDA, meeting at `dist_init_addr` (HOST:PORT,
    rank 0's TCP store). `local_rank` is the rank's index on its own node (its GPU)."""
    global _TP_RANK, _TP_SIZE, _CPU_GROUP
    _TP_RANK, _TP_SIZE = tp_rank, tp_size
    if tp_size == 1:
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device((tp_rank if local_rank is None else local_rank) % torch.cuda.device_count())
    host, port = split_host_port(dist_init_addr)
    bind_collectives_to(host, port)
    if tp_rank == 0:
        logger.info("Waiting at %s:%d for the other %d rank(s) to join", host, port, tp_size - 1)
    store = open_store(host, port, tp_rank, tp_size, JOIN_TIMEOUT)
    dist.init_process_group(backend=backend, store=store, rank=tp_rank, world_size=tp_size, timeout=JOIN_TIMEOUT)
    _CPU_GROUP = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    if tp_rank == 0:
        logger.info("All %d ranks joined", tp_size)


def is_peer_lost(e: BaseException) -> bool:
    """Whether a collective failed because another rank's process or node went away (gloo
    reports a closed or reset connection, NCCL a DistBackendError) or stopped answering."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(m in text for m in _PEER_LOST_MARKERS)


def exit_together(code: int = 0) -> None:
    """Ends this process once every rank got here. Past the barrier no rank needs another,
    and the process ends without C++ teardown: destroying gloo's process group (or letting
    interpreter exit destroy it) while a peer's connections close races with gloo's own
    threads, which then call std::terminate (SIGABRT instead of a clean exit)."""
    if _TP_SIZE > 1 and dist.is_initialized():
        dist.barrier()
    exit_now(code)


def exit_now(code: int) -> None:
    """Ends this process at once, logs flushed, without C++ teardown (see exit_together): a
    rank whose peer is gone must not abort on its way out."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def sum_in_rank_order(on: bool) -> None:
    """Makes tp_all_reduce add the ranks' parts in rank order, element by element, whatever the
    tensor's size. A ring all-reduce starts each element's sum at a rank that depends on which
    chunk of the buffer the element falls in, and the chunks follow the buffer's length (the
    batch's row count): with three or more ranks a row's sum, and so its rounding, would
    change with the batch. Batch-invariant inference turns this on."""
    global _SUM_IN_RANK_ORDER
    _SUM_IN_RANK_ORDER = on


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `x`, in place."""
    if _TP_SIZE == 1:
        return x
    if not _SUM_IN_RANK_ORDER:
        dist.all_reduce(x)
        return x
    parts = torch.empty((_TP_SIZE, *x.shape), dtype=x.dtype, device=x.device)  # [tp, *x.shape]
    dist.all_gather(list(parts.unbind(0)), x.contiguous())
    total = parts[0]
    for part in parts[1:]:
        total += part
    x.copy_(total)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates each rank's shard of `x` along `dim`, in rank order."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast_messages(raw: list[bytes]) -> list[bytes]:
    """Rank 0's received messages (already orjson bytes) to every rank, as one length-prefixed
    byte tensor over the CPU group: no pickling, so nothing but our own message types ever
    travels. Other ranks pass [] and get rank 0's list back."""
    lengths = torch.tensor([len(m) for m in raw] if _TP_RANK == 0 else [], dtype=torch.int64)
    count = torch.tensor([lengths.numel()], dtype=torch.int64)
    dist.broadcast(count, src=0, group=_CPU_GROUP)
    n = int(count.item())
    if n == 0:
        return []
    if _TP_RANK != 0:
        lengths = torch.empty(n, dtype=torch.int64)
    dist.broadcast(lengths, src=0, group=_CPU_GROUP)
    total = int(lengths.sum().item())
    if _TP_RANK == 0:
        payload = torch.frombuffer(bytearray(b"".join(raw)), dtype=torch.uint8)
    else:
        payload = torch.empty(total, dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=_CPU_GROUP)
    if _TP_RANK == 0:
        return raw
    data = payload.numpy().tobytes()
    out, off = [], 0
    for length in lengths.tolist():
        out.append(data[off : off + length])
        off += length
    return out


def tp_broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank (in place). Ranks on different machines may compute
    slightly different floats from the same inputs; this keeps a choice made from them (a
    sampled token) the same on every rank."""
    if _TP_SIZE == 1:
        return x
    dist.broadcast(x, src=0)
    return x


def tp_min(value: int) -> int:
    """The smallest of every rank's `value` (the same answer on all ranks)."""
    if _TP_SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CPU_GROUP)
    return int(t.item())
