"""RadixCache: prefix matching with splits, insert ownership, locking, LRU eviction, flush."""

from __future__ import annotations

import pytest
import torch

from radix_checks import assert_pool_balanced, assert_sizes, make_pool
from srt_lite.mem_cache.memory_pool import TokenToKVPool
from srt_lite.mem_cache.radix_cache import RadixCache, TreeNode

@pytest.fixture()
def pool() -> TokenToKVPool:
    return make_pool()


@pytest.fixture()
def tree(pool) -> RadixCache:
    return RadixCache(pool)


def alloc(pool: TokenToKVPool, n: int) -> torch.Tensor:
    slots = pool.alloc(n)
    assert slots is not None
    return slots.clone()


def put(tree: RadixCache, pool: TokenToKVPool, key: list[int]) -> torch.Tensor:
    """Inserts key with fresh slots the way a scheduler would: frees its duplicate part."""
    slots = alloc(pool, len(key))
    n = tree.insert(key, slots)
    pool.free(slots[:n])
    return slots


def test_pool_alloc_hands_out_fresh_slots_then_freed_ones_in_free_order():
    """Freed slots are held back without copying the free list and join it, in the order
    they were freed, only when the fresh ones run short; nothing is lost or handed out twice."""
    pool = make_pool(8)
    a, b = alloc(pool, 3), alloc(pool, 3)
    assert a.tolist() == [1, 2, 3] and b.tolist() == [4, 5, 6]
    pool.free(b[1:])
    pool.free(a[:1])
    assert pool.available_size() == 5
    assert pool.alloc(6) is None and pool.available_size() == 5  # refused: nothing taken
    assert alloc(pool, 2).tolist() == [7, 8]  # fresh slots first, released ones untouched
    assert pool.available_size() == 3
    assert alloc(pool, 2).tolist() == [5, 6]  # then the released ones, in the order freed
    assert pool.free_slots.tolist() == [1]
    mine = torch.tensor([2, 3])
    pool.free(mine)
    mine[:] = 0  # the pool keeps its own copy
    assert pool.free_slots.tolist() == [1, 2, 3] and pool.available_size() == 3
    pool.clear()
    assert pool.available_size() == 8 and pool.free_slots.tolist() == list(range(1, 9))


def test_insert_then_exact_and_longer_match(tree, pool):
    slots = alloc(pool, 5)
    assert tree.insert([1, 2, 3, 4, 5], slots) == 0
    assert_sizes(tree, 5, 0)

    got, node = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert got.dtype == torch.int64
    assert torch.equal(got, slots)
    assert node.key == [1, 2, 3, 4, 5]
    assert node.parent is tree.root

    got, node = tree.match_prefix([9, 1, 2])
    assert got.numel() == 0 and got.dtype == torch.int64
    assert node is tree.root

    got, node = tree.match_prefix([])
    assert got.numel() == 0 and node is tree.root
    assert_sizes(tree, 5, 0)


def test_match_ending_mid_edge_splits(tree, pool):
    slots = alloc(pool, 5)
    tree.insert([1, 2, 3, 4, 5], slots)

    got, node = tree.match_prefix([1, 2, 3, 7])
    assert torch.equal(got, slots[:3])
    # The returned node's path is exactly the matched prefix.
    assert node.key == [1, 2, 3]
    assert torch.equal(node.value, slots[:3])
    assert node.parent is tree.root
    assert list(node.children) == [4]
    lower = node.children[4]
    assert lower.key == [4, 5] and torch.equal(lower.value, slots[3:])
    # A split moves tokens between nodes, it never adds or drops any.
    assert_sizes(tree, 5, 0)

    # The full key is still matched across the two nodes.
    got, node = tree.match_prefix([1, 2, 3, 4, 5])
    assert torch.equal(got, slots)
    assert node is lower


def test_insert_returns_duplicate_prefix_length(tree, pool):
    a = put(tree, pool, [1, 2, 3, 4, 5])
    assert_pool_balanced(tree, pool)

    b = alloc(pool, 5)
    assert tree.insert([1, 2, 3, 9, 9], b) == 3
    pool.free(b[:3])
    assert_sizes(tree, 7, 0)
    assert_pool_balanced(tree, pool)

    # The shared prefix keeps the tree's original slots; the new suffix uses the caller's.
    got, node = tree.match_prefix([1, 2, 3, 9, 9])
    assert torch.equal(got, torch.cat((a[:3], b[3:])))
    assert node.key == [9, 9]
    assert node.parent.key == [1, 2, 3]

    # A key that is entirely cached (whole or a prefix of an edge) adds nothing.
    c = alloc(pool, 5)
    assert tree.insert([1, 2, 3, 4, 5], c) == 5
    pool.free(c)
    d = alloc(pool, 2)
    assert tree.insert([1, 2], d) == 2
    pool.free(d)
    assert_sizes(tree, 7, 0)
    assert_pool_balanced(tree, pool)

    # Extending an existing leaf reports the whole old key as duplicate.
    e = alloc(pool, 7)
    assert tree.insert([1, 2, 3, 4, 5, 6, 7], e) == 5
    pool.free(e[:5])
    got, _ = tree.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert torch.equal(got, torch.cat((a, e[5:])))
    assert_sizes(tree, 9, 0)
    assert_pool_balanced(tree, pool)


def test_insert_rejects_length_mismatch(tree):
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3], torch.tensor([1, 2], dtype=torch.int64))


def test_lock_protects_from_eviction(tree, pool):
    a = put(tree, pool, [1, 2, 3])
    put(tree, pool, [7, 8])
    _, node = tree.match_prefix([1, 2, 3])

    assert tree.inc_lock_ref(node) == -3
    assert_sizes(tree, 2, 3)

    assert tree.evict(100) == 2
    assert_sizes(tree, 0, 3)
    assert_pool_balanced(tree, pool)
    got, _ = tree.match_prefix([1, 2, 3])
    assert torch.equal(got, a)
    # Nothing evictable is left: evict returns 0 rather than touching the locked path.
    assert tree.evict(1) == 0

    assert tree.dec_lock_ref(node) == 3
    assert_sizes(tree, 3, 0)
    assert tree.evict(1) == 3
    assert_sizes(tree, 0, 0)
    assert pool.available_size() == pool.size


def test_lock_counts_shared_prefix_once_and_survives_split(tree, pool):
    put(tree, pool, [1, 2, 3, 4])
    put(tree, pool, [1, 2, 3, 5, 6])
    _, n4 = tree.match_prefix([1, 2, 3, 4])
    _, n56 = tree.match_prefix([1, 2, 3, 5, 6])
    assert n4.key == [4] and n56.key == [5, 6]

    assert tree.inc_lock_ref(n4) == -4
    assert_sizes(tree, 2, 4)
    # The shared [1, 2, 3] is already locked, so only [5, 6] changes state.
    assert tree.inc_lock_ref(n56) == -2
    assert_sizes(tree, 0, 6)
    assert n56.parent.lock_ref == 2

    # Splitting a locked edge keeps the lock on both halves and the counters unchanged.
    got, mid = tree.match_prefix([1, 2, 9])
    assert mid.key == [1, 2] and mid.lock_ref == 2 and got.numel() == 2
    assert_sizes(tree, 0, 6)

    assert tree.dec_lock_ref(n4) == 1
    assert_sizes(tree, 1, 5)
    assert tree.evict(10) == 1
    assert_sizes(tree, 0, 5)
    assert tree.dec_lock_ref(n56) == 5
    assert_sizes(tree, 5, 0)

    with pytest.raises(RuntimeError):
        tree.dec_lock_ref(n56)


def test_evicts_least_recently_used_leaf_first(tree, pool):
    a = put(tree, pool, [1, 1])
    b = put(tree, pool, [2, 2])
    c = put(tree, pool, [3, 3])
    tree.match_prefix([1, 1])  # a is now the most recently used

    def cached(key):
        return tree.match_prefix(key)[0].numel() == len(key)

    assert tree.evict(1) == 2
    assert not cached([2, 2]) and cached([1, 1]) and cached([3, 3])
    assert pool.free_slots[-2:].tolist() == b.tolist()
    assert_sizes(tree, 4, 0)
    # cached() just touched 1 then 3, so 1 is now the oldest.
    assert tree.evict(1) == 2
    assert pool.free_slots[-2:].tolist() == a.tolist()
    assert tree.evict(1) == 2
    assert pool.free_slots[-2:].tolist() == c.tolist()
    assert_sizes(tree, 0, 0)
    assert pool.available_size() == pool.size


def test_eviction_cascades_to_parent_that_becomes_leaf(tree, pool):
    put(tree, pool, [1, 2, 3])
    put(tree, pool, [1, 2, 3, 4, 5])
    put(tree, pool, [1, 2, 3, 6, 7])
    assert_sizes(tree, 7, 0)
    assert tree.root.children[1].key == [1, 2, 3]

    # Asking for 1 token evicts exactly one whole leaf.
    assert tree.evict(1) == 2
    assert_sizes(tree, 5, 0)
    # The second leaf, then its parent that just became a leaf.
    assert tree.evict(5) == 5
    assert_sizes(tree, 0, 0)
    assert not tree.root.children
    assert pool.available_size() == pool.size


def test_parent_of_locked_leaf_is_not_evicted(tree, pool):
    put(tree, pool, [1, 2, 3, 4])
    put(tree, pool, [1, 2, 5])
    _, leaf = tree.match_prefix([1, 2, 5])
    tree.inc_lock_ref(leaf)
    assert_sizes(tree, 2, 3)
    assert tree.evict(100) == 2
    got, _ = tree.match_prefix([1, 2, 5])
    assert got.numel() == 3
    assert_sizes(tree, 0, 3)


def test_flush_refused_while_locked_then_frees_everything(tree, pool):
    put(tree, pool, [1, 2, 3])
    put(tree, pool, [4, 5])
    _, node = tree.match_prefix([1, 2, 3])
    tree.inc_lock_ref(node)
    before = pool.available_size()

    assert tree.flush() is False
    assert pool.available_size() == before
    assert_sizes(tree, 2, 3)

    tree.dec_lock_ref(node)
    assert tree.flush() is True
    assert pool.available_size() == pool.size
    assert_sizes(tree, 0, 0)
    assert tree.all_slots().numel() == 0
    assert tree.match_prefix([1, 2, 3])[0].numel() == 0


def test_reset_drops_tree_without_freeing(tree, pool):
    put(tree, pool, [1, 2, 3])
    before = pool.available_size()
    tree.reset()
    assert pool.available_size() == before == pool.size - 3
    assert_sizes(tree, 0, 0)
    assert tree.match_prefix([1, 2, 3])[0].numel() == 0


def test_all_slots_lists_every_owned_slot(tree, pool):
    a = put(tree, pool, [1, 2, 3])
    b = put(tree, pool, [1, 2, 4, 5])
    expected = set(a.tolist()) | set(b[2:].tolist())
    assert set(tree.all_slots().tolist()) == expected
    assert tree.all_slots().numel() == 5


def test_disabled_cache_caches_nothing(pool):
    tree = RadixCache(pool, disable=True)
    slots = alloc(pool, 4)
    # The tree takes ownership of nothing: the caller frees every slot it passed.
    assert tree.insert([1, 2, 3, 4], slots) == 4
    pool.free(slots)
    got, node = tree.match_prefix([1, 2, 3, 4])
    assert got.numel() == 0 and got.dtype == torch.int64
    assert node is tree.root
    assert tree.inc_lock_ref(node) == 0
    assert tree.dec_lock_ref(node) == 0
    assert tree.evict(10) == 0
    assert tree.flush() is True
    assert_sizes(tree, 0, 0)
    assert pool.available_size() == pool.size


def test_check_invariants_catches_corruption(tree, pool):
    put(tree, pool, [1, 2, 3])
    tree.check_invariants()
    tree._evictable_size += 1
    with pytest.raises(AssertionError):
        tree.check_invariants()
    tree._evictable_size -= 1

    node = tree.root.children[1]
    node.value = node.value[:2]
    with pytest.raises(AssertionError):
        tree.check_invariants()


def test_tree_node_defaults():
    node = TreeNode()
    assert node.children == {} and node.parent is None and node.key == []
    assert node.value.numel() == 0 and node.lock_ref == 0
    assert TreeNode().last_access_time > node.last_access_time
