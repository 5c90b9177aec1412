"""Batch-invariant (deterministic) inference: a row's result depends on that row alone.

Without it, the CPU products and attention pick their kernel by how many rows a step has
(a 4-bit copy for one or two rows, 4-bit panels for a few, bf16 panels above; integer dot
products up to 16 rows of a GGUF weight, a dequantized matmul above; a cascade over a shared
prefix, a flash call for a long prompt), and each kernel rounds differently. So the same
request gives other tokens beside other requests, after a radix-cache hit (one row computed
instead of many) or with its prompt chunked otherwise.

Enabled (`--enable-deterministic-inference`), each layer keeps one product for every row
count, each of those products computes a row the same way whatever else is in the batch
(fixed reduction order over k, no split of k by row count), and attention runs every row
(decode, verify and prompt alike) through one exact loop over its own keys, the C++ cascade
op with no shared prefix, whose result for a query depends only on the query and its keys.
With tensor parallelism the ranks' partial sums are added in rank order (a fixed TP size
gives a fixed order; another size may give other tokens).
`enable()` must run before the model loads: the layers read the setting when they pack.
"""

from __future__ import annotations

import torch

from srt_lite.distributed import parallel_state
from srt_lite import cpu_kernels

_enabled = False


def enable(on: bool = True) -> None:
    """Turns batch invariance on (or off) for this process (a scheduler rank), before the model
    loads; a model loaded under one setting keeps its products."""
    global _enabled
    _enabled = on
    parallel_state.sum_in_rank_order(on)
    if cpu_kernels.load():
        torch.ops.srt_lite_cpu.set_batch_invariant(on)


def enabled() -> bool:
    return _enabled


# A row bound that no step reaches: the product chosen for one row serves every row count.
ALL_ROWS = 1 << 30
