"""Radix tree over token ids that shares KV slots between requests with a common prefix.

Page size is 1: every token of an edge owns exactly one KV slot of the TokenToKVPool. The tree
owns the slots it stores; a request that reuses a cached prefix locks the path (inc_lock_ref)
so eviction cannot free slots it is still reading, and unlocks it when done.

Ownership contract of insert(): for a key of length L with slots value[0:L], insert returns n,
the number of leading tokens that were already cached. value[:n] stays with the caller (the
tree keeps its own older slots for those tokens) and value[n:] now belongs to the tree.
"""

from __future__ import annotations

import heapq
import itertools
import logging

import torch

from srt_lite.mem_cache.memory_pool import TokenToKVPool

logger = logging.getLogger(__name__)

# A counter instead of wall-clock time: two accesses within one clock tick would otherwise tie,
# and LRU order has to be strict for eviction to be predictable.
_access_clock = itertools.count()
_node_ids = itertools.count()


def _now() -> float:
    return float(next(_access_clock))


class TreeNode:
    """One edge of the radix tree: the tokens `key` and the KV slots `value` that hold them."""

    def __init__(self, key: list[int] | None = None, value: torch.Tensor | None = None):
        # Keyed by the first token of the child's edge; siblings never share a first token.
        self.children: dict[int, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: list[int] = key if key is not None else []
        self.value: torch.Tensor = value if value is not None else torch.empty(0, dtype=torch.int64)
        # Number of running requests that use this node (directly or through a descendant).
        self.lock_ref: int = 0
        self.last_access_time: float = _now()
        # Breaks heap ties between nodes with the same access time (a split copies the time).
        self.id: int = next(_node_ids)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def _common_prefix_len(edge: list[int], key: list[int], start: int) -> int:
    """How many tokens of `edge` match key[start:], without slicing key (keeps matching linear)."""
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, token_to_kv_pool: TokenToKVPool, disable: bool = False):
        self.token_to_kv_pool = token_to_kv_pool
        self.disable = disable
        self.device = token_to_kv_pool.device
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Drops the whole tree without freeing its slots: the caller clears the pool itself."""
        self.root = TreeNode()
        self.root.value = self._empty()
        # The root holds no tokens; a permanent lock is a guard so it can never look evictable.
        self.root.lock_ref = 1
        self._evictable_size = 0
        self._protected_size = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def total_size(self) -> int:
        # Every non-root node is either locked or not, so the two counters partition the tree.
        return self._evictable_size + self._protected_size

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    # ------------------------------------------------------------------ lookup / insert

    def match_prefix(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Slots of the longest cached prefix of `key`, and the node whose path is that prefix."""
        if self.disable or not key:
            return self._empty(), self.root
        now = _now()
        node = self.root
        node.last_access_time = now
        values: list[torch.Tensor] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            matched = _common_prefix_len(child.key, key, pos)
            if matched < len(child.key):
                # The match ends inside this edge: split so the returned node covers exactly
                # the matched prefix, which is what a caller locks.
                child = self._split_node(child, matched)
            child.last_access_time = now
            values.append(child.value)
            node = child
            # After a split the next token differs from the remaining child, so the loop ends.
            pos += matched
        if not values:
            return self._empty(), node
        return torch.cat(values), node

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Caches key -> value and returns how many leading tokens were already cached.

        value[:returned] are the caller's duplicates (the tree keeps its own slots for them);
        the tree takes ownership of value[returned:].
        """
        if len(key) != value.numel():
            raise ValueError(f"key has {len(key)} tokens but value has {value.numel()} slots")
        if self.disable:
            # Nothing is cached, so the tree must not take ownership of anything: reporting the
            # whole key as "already present" makes the caller free every slot it passed in.
            return len(key)
        now = _now()
        node = self.root
        node.last_access_time = now
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                # Clone so the tree does not pin the caller's (possibly much larger) buffer.
                leaf = TreeNode(list(key[pos:]), value[pos:].to(torch.int64).clone())
                leaf.parent = node
                leaf.last_access_time = now
                node.children[key[pos]] = leaf
                self._evictable_size += len(leaf.key)
                return pos
            matched = _common_prefix_len(child.key, key, pos)
            if matched < len(child.key):
                child = self._split_node(child, matched)
            child.last_access_time = now
            node = child
            pos += matched
        return pos

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cuts child's edge after split_len tokens; returns the new upper node (the prefix).

        The lower part keeps the original node object, so a caller holding it (and its locks)
        still refers to the same full path. Counters do not change: the tokens and their lock
        state are only redistributed between two nodes.
        """
        assert 0 < split_len < len(child.key)
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:split_len], child.value[:split_len].clone())
        upper.parent = parent
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        child.key = child.key[split_len:]
        child.value = child.value[split_len:].clone()
        child.parent = upper
        upper.children[child.key[0]] = child
        parent.children[upper.key[0]] = upper
        return upper

    # ------------------------------------------------------------------ locking

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Locks node and its ancestors; returns the change in evictable size (<= 0)."""
        if self.disable:
            return 0
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            assert node.parent is not None, "locking a node that is no longer in the tree"
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlocks node and its ancestors; returns the change in evictable size (>= 0)."""
        if self.disable:
            return 0
        delta = 0
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            assert node.parent is not None, "unlocking a node that is no longer in the tree"
            node = node.parent
        return delta

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """Frees LRU unlocked leaves until num_tokens slots are freed or nothing is evictable."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._collect_leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            self.token_to_kv_pool.free(node.value)
            freed += len(node.key)
            self._evictable_size -= len(node.key)
            del parent.children[node.key[0]]
            node.parent = None
            # The parent may have just become a leaf; it competes on its own access time.
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if freed:
            logger.debug("radix cache evicted %d tokens (asked %d)", freed, num_tokens)
        return freed

    def _collect_leaves(self) -> list[TreeNode]:
        leaves = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.is_leaf:
                leaves.append(node)
            else:
                stack.extend(node.children.values())
        return leaves

    def _iter_nodes(self) -> list[TreeNode]:
        """Every non-root node, parents before children."""
        out = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def flush(self) -> bool:
        """Frees every cached slot and empties the tree; refused (False) while anything is locked."""
        if any(n.lock_ref > 0 for n in self._iter_nodes()):
            logger.warning("radix cache flush refused: %d tokens are locked", self._protected_size)
            return False
        self.token_to_kv_pool.free(self.all_slots())
        self.reset()
        return True

    # ------------------------------------------------------------------ introspection

    def all_slots(self) -> torch.Tensor:
        values = [n.value for n in self._iter_nodes()]
        return torch.cat(values) if values else self._empty()

    def check_invariants(self) -> None:
        root = self.root
        assert root.parent is None and not root.key and root.value.numel() == 0
        evictable = protected = 0
        for node in self._iter_nodes():
            parent = node.parent
            assert parent is not None, f"{node!r} has no parent"
            assert len(node.key) > 0, f"{node!r} has an empty edge"
            assert node.value.dim() == 1 and node.value.dtype == torch.int64, f"{node!r} bad value"
            assert node.value.numel() == len(node.key), f"{node!r} key/value lengths differ"
            assert parent.children.get(node.key[0]) is node, f"{node!r} misfiled in its parent"
            assert node.lock_ref >= 0, f"{node!r} has negative lock_ref"
            if parent is not root:
                assert node.lock_ref <= parent.lock_ref, f"{node!r} locked more than its parent"
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self._evictable_size, (evictable, self._evictable_size)
        assert protected == self._protected_size, (protected, self._protected_size)
        slots = self.all_slots()
        assert slots.unique().numel() == slots.numel(), "a slot is held twice by the tree"
        assert not bool((slots == 0).any()), "the padding slot 0 is in the tree"
