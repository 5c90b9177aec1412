"""RadixCache under a random mix of arriving, finishing and inserting requests, lookups and
evictions on a small pool, checked after every operation against a token-level reference trie
and the pool's own accounting."""

from __future__ import annotations

import random

import pytest
import torch

from radix_checks import assert_pool_balanced, assert_sizes, make_pool
from srt_lite.mem_cache.radix_cache import RadixCache, TreeNode


class Reference:
    """Token-level trie as a dict {prefix tuple: slot}, independent of the radix tree."""

    def __init__(self):
        self.slot: dict[tuple[int, ...], int] = {}

    def cached_len(self, key: list[int]) -> int:
        n = 0
        while n < len(key) and tuple(key[: n + 1]) in self.slot:
            n += 1
        return n

    def slots(self, key: list[int]) -> list[int]:
        return [self.slot[tuple(key[: i + 1])] for i in range(self.cached_len(key))]

    def insert(self, key: list[int], value: list[int]) -> None:
        for i in range(len(key)):
            self.slot.setdefault(tuple(key[: i + 1]), value[i])

    def drop_slots(self, freed: set[int]) -> None:
        self.slot = {k: s for k, s in self.slot.items() if s not in freed}


class Simulation:
    """A scheduler's use of the tree, one random operation at a time."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.pool = make_pool(96)  # small, so allocation pressure forces frequent evictions
        self.tree = RadixCache(self.pool)
        self.ref = Reference()
        # Running requests: (full key, matched prefix length, locked node, slots allocated for the rest).
        self.running: list[tuple[list[int], int, TreeNode, torch.Tensor]] = []
        self.outside = 0  # slots held by running requests, in neither the pool nor the tree

    def random_key(self) -> list[int]:
        # A small alphabet with a few common stems makes shared prefixes and splits frequent.
        stem = self.rng.choice([[], [1, 2, 3], [1, 2, 4, 5], [2, 2]])
        return stem + [self.rng.randrange(4) for _ in range(self.rng.randint(1, 8))]

    def evict(self, n: int) -> int:
        before = set(self.tree.all_slots().tolist())
        freed = self.tree.evict(n)
        gone = before - set(self.tree.all_slots().tolist())
        assert len(gone) == freed
        self.ref.drop_slots(gone)
        return freed

    def alloc_with_eviction(self, n: int) -> torch.Tensor | None:
        if self.pool.available_size() < n:
            self.evict(n - self.pool.available_size())
        slots = self.pool.alloc(n)
        return None if slots is None else slots.clone()

    def arrive(self) -> None:
        """A request arrives: reuse the cached prefix, lock it, allocate the rest."""
        key = self.random_key()
        got, node = self.tree.match_prefix(key)
        assert got.tolist() == self.ref.slots(key)
        self.tree.inc_lock_ref(node)
        slots = self.alloc_with_eviction(len(key) - got.numel())
        if slots is None:
            self.tree.dec_lock_ref(node)
        else:
            self.running.append((key, got.numel(), node, slots))
            self.outside += slots.numel()

    def finish(self, i: int) -> None:
        key, prefix_len, node, new_slots = self.running.pop(i)
        prefix_slots, _ = self.tree.match_prefix(key[:prefix_len])
        value = torch.cat((prefix_slots, new_slots))
        n = self.tree.insert(key, value)
        assert n == self.ref.cached_len(key)
        assert n >= prefix_len  # the locked prefix cannot have disappeared
        self.pool.free(value[prefix_len:n])
        self.ref.insert(key, value.tolist())
        self.outside -= len(new_slots)
        self.tree.dec_lock_ref(node)

    def insert_fresh(self) -> None:
        """A plain insert with fresh slots (a cached chunk); the caller frees the duplicates."""
        key = self.random_key()
        slots = self.alloc_with_eviction(len(key))
        if slots is not None:
            n = self.tree.insert(key, slots)
            assert n == self.ref.cached_len(key)
            self.pool.free(slots[:n])
            self.ref.insert(key, slots.tolist())

    def look_up(self) -> None:
        key = self.random_key()
        got, node = self.tree.match_prefix(key)
        assert got.tolist() == self.ref.slots(key)
        assert node.parent is not None or node is self.tree.root

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.35:
            self.arrive()
        elif op < 0.6 and self.running:
            self.finish(self.rng.randrange(len(self.running)))
        elif op < 0.75:
            self.insert_fresh()
        elif op < 0.9:
            self.look_up()
        else:
            evictable = self.tree.evictable_size()
            assert self.evict(self.rng.randint(1, 20)) <= evictable

    def check(self) -> None:
        """Every slot is in exactly one of: the pool's free list, the tree, a running request."""
        self.tree.check_invariants()
        assert_pool_balanced(self.tree, self.pool, self.outside)
        tree_slots = set(self.tree.all_slots().tolist())
        free_slots = set(self.pool.free_slots.tolist())
        held = set()
        for _, _, node, new_slots in self.running:
            held |= set(new_slots.tolist())
            assert node is self.tree.root or node.lock_ref > 0  # a locked prefix is never evicted
            assert node.parent is not None or node is self.tree.root
        assert not tree_slots & free_slots and not held & (tree_slots | free_slots)
        assert tree_slots | free_slots | held == set(range(1, self.pool.size + 1))
        assert set(self.ref.slot.values()) == tree_slots


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_against_pool_and_reference(seed):
    sim = Simulation(seed)
    for _ in range(300):
        sim.step()
        sim.check()
    while sim.running:
        sim.finish(len(sim.running) - 1)
    assert_sizes(sim.tree, sim.tree.total_size(), 0)
    assert sim.tree.flush() is True
    assert sim.pool.available_size() == sim.pool.size
