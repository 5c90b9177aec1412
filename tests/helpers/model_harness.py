"""Drives a ModelRunner directly (no scheduler): prefill a batch, then decode step by step
through the paged KV pool, exactly as the scheduler lays out requests."""

from __future__ import annotations

import torch

from srt_lite.model_executor.forward_batch import ForwardBatch
from srt_lite.model_executor.model_runner import ModelRunner


class Harness:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.rows: list[int] = []
        self.lens: list[int] = []

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.runner.token_to_kv_pool.alloc(n)
        assert slots is not None, "KV pool exhausted in test"
        return slots

    def extend(
        self, rows: list[int], prefix_lens: list[int], new_ids: list[list[int]], all_logits: bool = True
    ):
        """Adds new_ids[b] after the first prefix_lens[b] tokens of request row rows[b]."""
        r2t = self.runner.req_to_token_pool.req_to_token
        locs = []
        for row, p, ids in zip(rows, prefix_lens, new_ids):
            slots = self._alloc(len(ids))
            r2t[row, p : p + len(ids)] = slots.to(torch.int32)
            locs.append(slots)
        fb = ForwardBatch.create(
            input_ids=[t for ids in new_ids for t in ids],
            req_pool_indices=rows,
            prefix_lens=prefix_lens,
            extend_lens=[len(ids) for ids in new_ids],
            out_cache_loc=torch.cat(locs),
            device=self.runner.device,
            return_all_logits=all_logits,
        )
        return self.runner.forward(fb)

    def prefill(self, prompts: list[list[int]]):
        self.rows = [self.runner.req_to_token_pool.alloc() for _ in prompts]
        self.lens = [len(p) for p in prompts]
        return self.extend(self.rows, [0] * len(prompts), prompts)

    def rows_sharing_prefix(self, n: int, length: int) -> list[int]:
        """n new request rows whose first `length` KV slots are this harness's first row's,
        as a radix-cache hit lays them out."""
        pool = self.runner.req_to_token_pool
        rows = [pool.alloc() for _ in range(n)]
        for row in rows:
            pool.req_to_token[row, :length] = pool.req_to_token[self.rows[0], :length]
        return rows

    def decode(self, next_ids: list[int]) -> torch.Tensor:
        out = self.extend(self.rows, self.lens, [[t] for t in next_ids], all_logits=False)
        self.lens = [n + 1 for n in self.lens]
        return out.next_token_logits


def fragment_free_list(runner: ModelRunner, seed: int) -> None:
    """Shuffles the KV pool's free slots, as a long-running server's are: a prompt's slots
    are then scattered instead of consecutive."""
    free = runner.token_to_kv_pool.free_slots
    runner.token_to_kv_pool.free_slots = free[torch.randperm(free.numel(), generator=torch.Generator().manual_seed(seed))]
