"""The read probe the roofline figures divide by: memory read with every torch thread.

Two reductions over a buffer far past the caches, alternated: a sum of fp32 and a max of
bytes. Either alone can fall short of the memory: on a busy shared host the fp32 sum's
arithmetic (torch sums in cascades of partial sums) held it well under what the byte max and
the engines' own products read at the same minutes. The probe is a lower bound of the
bandwidth, so its callers take the best read.
"""

from __future__ import annotations

import time

import torch


def read_rates_gbs(seconds: float = 1.0, gib: float = 0.5, min_reads: int = 2) -> list[float]:
    """GB/s of each read for `seconds` (at least `min_reads` of each reduction)."""
    nbytes = int(gib * 2**30) // 4 * 4
    f32 = torch.ones(nbytes // 4, dtype=torch.float32)  # [N] touched, far past the caches
    u8 = f32.view(torch.uint8)  # the same bytes
    rates: list[float] = []
    end = time.perf_counter() + seconds
    while len(rates) < 2 * min_reads or time.perf_counter() < end:
        for reduce in (f32.sum, u8.max):
            t0 = time.perf_counter()
            reduce()
            rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return rates
