"""A small KV pool and the size checks the radix-cache tests share."""

from __future__ import annotations

import torch

from srt_lite.mem_cache.memory_pool import TokenToKVPool
from srt_lite.mem_cache.radix_cache import RadixCache

POOL_SIZE = 256


def make_pool(size: int = POOL_SIZE) -> TokenToKVPool:
    return TokenToKVPool(size=size, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu")


def assert_sizes(tree: RadixCache, evictable: int, protected: int) -> None:
    tree.check_invariants()
    assert tree.evictable_size() == evictable
    assert tree.protected_size() == protected
    assert tree.total_size() == evictable + protected


def assert_pool_balanced(tree: RadixCache, pool: TokenToKVPool, outside: int = 0) -> None:
    """Every slot is free, in the tree, or held by a running request (`outside`)."""
    assert pool.available_size() + tree.total_size() + outside == pool.size
