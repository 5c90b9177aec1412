"""KV memory: a request -> token-slot table and a pool of KV slots with a free-slot allocator.

Page size is 1: a slot holds the K and V of one token in every layer. Slot 0 is reserved as
a padding slot (never handed out), so padded gathers can point at it harmlessly.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Row r maps position i of request r to its KV slot: req_to_token[r, i]."""

    def __init__(self, size: int, max_context_len: int, device: str):
        self.size = size
        self.max_context_len = max_context_len
        # [size, max_context_len]
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int32, device=device)
        self.free_rows: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_rows)

    def alloc(self) -> int | None:
        return self.free_rows.pop() if self.free_rows else None

    def free(self, row: int) -> None:
        self.free_rows.append(row)


class TokenToKVPool:
    """Per layer K and V buffers [num_slots + 1, num_kv_heads, head_dim], plus the allocator."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
    ):
        self.size = size
        self.dtype = dtype
        self.device = device
        shape = (size + 1, num_kv_heads, head_dim)
        # [size + 1, kv_heads, head_dim] per layer; row 0 is the padding slot.
        self.k_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # torch.empty leaves untouched pages uncommitted (the pool can be large on CPU); only
        # the padding slot must hold finite values, because masked reads still multiply it.
        for buf in self.k_buffer + self.v_buffer:
            buf[0].zero_()
        self.clear()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        # Freed slots wait here and join the free list when alloc needs them: appending to
        # the list tensor on every free copied all of it (the whole pool when mostly free),
        # and a step with drafts frees every row's rejected slots.
        self._released: list[torch.Tensor] = []
        self._num_released = 0

    @property
    def free_slots(self) -> torch.Tensor:
        """Free slot ids [n] int64, in the order alloc hands them out (freed ones last)."""
        self._merge_released()
        return self._free

    @free_slots.setter
    def free_slots(self, slots: torch.Tensor) -> None:
        self._free, self._released, self._num_released = slots, [], 0

    def _merge_released(self) -> None:
        if self._released:
            self._free = torch.cat((self._free, *self._released))
            self._released, self._num_released = [], 0

    def available_size(self) -> int:
        return int(self._free.numel()) + self._num_released

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slot ids, or None when fewer than n are free (nothing is taken then)."""
        if n > self._free.numel():
            if n > self.available_size():
                return None
            self._merge_released()
        out = self._free[:n]
        self._free = self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._released.append(slots.to(torch.int64, copy=True))  # the caller may reuse its tensor
            self._num_released += int(slots.numel())

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] written at slots loc [T]."""
        self.k_buffer[layer_id].index_copy_(0, loc, k.to(self.dtype))
        self.v_buffer[layer_id].index_copy_(0, loc, v.to(self.dtype))
