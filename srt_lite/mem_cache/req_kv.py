"""KV ownership of requests: who holds which KV slots, from admission to finish.

Slots are owned by exactly one of: the free list, the radix tree, or a request. A request's
row req_to_token[row, :kv_len] has two parts:
    [0, prefix_len)       tree-owned, locked by the request (last_node) so it cannot be evicted
    [prefix_len, kv_len)  owned by the request itself
Caching a request (after a prefill step, at finish, abort or retraction) moves its own part
into the tree and frees any duplicates the tree already had. With the radix cache disabled
the tree stays empty and a request's slots go straight back to the free list.
"""

from __future__ import annotations

import torch

from srt_lite.req import Req
from srt_lite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from srt_lite.mem_cache.radix_cache import RadixCache


class ReqKVManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool, disable_radix_cache: bool):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.disabled = disable_radix_cache
        self.tree = RadixCache(token_to_kv_pool, disable=disable_radix_cache)
        self.evicted_tokens = 0

    # ---- capacity --------------------------------------------------------------------

    def available(self) -> int:
        """Slots a new allocation can get: free now, or freed by evicting unlocked cache."""
        return self.token_to_kv_pool.available_size() + self.tree.evictable_size()

    @property
    def capacity(self) -> int:
        return self.token_to_kv_pool.size

    def free_slots(self) -> int:
        """Slots on the free list now (not counting evictable cache)."""
        return self.token_to_kv_pool.available_size()

    def cached_slots(self) -> int:
        """Slots only the radix cache holds: evictable when KV runs short."""
        return self.tree.evictable_size()

    def alloc(self, n: int) -> torch.Tensor | None:
        pool = self.token_to_kv_pool
        short = n - pool.available_size()
        if short > 0:
            self.evicted_tokens += self.tree.evict(short)
        return pool.alloc(n)

    def alloc_extend(self, reqs: list[Req]) -> torch.Tensor:
        """Slots for one step: each request's next extend_len tokens, written into its row
        after its kv_len. Returns them in request order (the step's out_cache_loc). The
        caller has checked that they are available."""
        out_cache_loc = self.alloc(sum(r.extend_len for r in reqs))  # [sum of extend_len]
        assert out_cache_loc is not None, "admission checked KV availability"
        off = 0
        for r in reqs:
            self.write(r, r.kv_len, out_cache_loc[off : off + r.extend_len])
            off += r.extend_len
        return out_cache_loc

    # ---- request lifecycle -----------------------------------------------------------

    def match_len(self, req: Req) -> int:
        """Length of the cached prefix of req (for scheduling order; takes no lock)."""
        if self.disabled:
            return 0
        slots, _ = self.tree.match_prefix(self._match_key(req))
        return int(slots.numel())

    def admit(self, req: Req) -> bool:
        """Gives req a req_to_token row and its cached prefix (locked). False if no row."""
        row = self.req_to_token_pool.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        slots, node = self.tree.match_prefix(self._match_key(req))
        n = int(slots.numel())
        self.tree.inc_lock_ref(node)
        req.last_node = node
        req.prefix_len = req.kv_len = n
        if n:
            self.req_to_token_pool.req_to_token[row, :n] = slots.to(torch.int32)
        return True

    def write(self, req: Req, start: int, slots: torch.Tensor) -> None:
        self.req_to_token_pool.req_to_token[req.req_pool_idx, start : start + slots.numel()] = slots.to(torch.int32)

    def free_tail(self, req: Req, end: int) -> None:
        """Returns the slots req wrote past its sequence, [kv_len, end), to the free list:
        draft tokens the model rejected (speculative decoding)."""
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        self.token_to_kv_pool.free(row[req.kv_len : end].to(torch.int64))

    def cache_unfinished(self, req: Req) -> None:
        """Moves req's computed tokens into the tree and re-locks the longer path, so that
        concurrent requests (n > 1, shared system prompts) can reuse them at once."""
        if self.disabled:
            return
        key = req.fill_ids[: req.kv_len]
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        self._insert_and_free_duplicates(req, key, row[: req.kv_len].to(torch.int64))
        slots, node = self.tree.match_prefix(key)
        n = int(slots.numel())
        row[:n] = slots.to(torch.int32)
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node = node
        req.prefix_len = n

    def release(self, req: Req) -> None:
        """At finish, abort or retraction: req gives up its row and every slot it holds
        (its own part goes to the tree, where it stays until evicted)."""
        if req.req_pool_idx is None:
            return
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        slots = row[: req.kv_len].to(torch.int64)
        if self.disabled:
            self.token_to_kv_pool.free(slots[req.prefix_len :])
        else:
            self._insert_and_free_duplicates(req, req.fill_ids[: req.kv_len], slots)
            self.tree.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_len = req.prefix_len = 0

    def _insert_and_free_duplicates(self, req: Req, key: list[int], slots: torch.Tensor) -> None:
        dup = self.tree.insert(key, slots)
        if dup > req.prefix_len:
            # The tree already had [prefix_len, dup) from another request: our copies go.
            self.token_to_kv_pool.free(slots[req.prefix_len : dup])

    @staticmethod
    def _match_key(req: Req) -> list[int]:
        # Leave at least one token to compute: its logits give the next token.
        key = req.fill_ids[:-1]
        if req.pooling == "mean":
            return []  # a mean needs every token's hidden state, so every token is computed
        if req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids:
            # Prompt logprobs need logits from position logprob_start_len - 1 on, so the
            # cached part may not reach past it.
            key = key[: max(req.logprob_start_len - 1, 0)]
        return key

    # ---- accounting ------------------------------------------------------------------

    def flush(self) -> bool:
        return self.tree.flush() if not self.disabled else True

    def check(self, reqs_holding_kv: list[Req]) -> bool:
        """free + tree + requests' own slots == capacity, and the tree is consistent."""
        own = sum(r.kv_len - r.prefix_len for r in reqs_holding_kv if r.req_pool_idx is not None)
        total = self.token_to_kv_pool.available_size() + self.tree.total_size() + own
        try:
            self.tree.check_invariants()
        except AssertionError:
            return False
        return total == self.token_to_kv_pool.size
