"""ForwardBatch: everything one forward pass needs, as tensors on the model's device.

A batch is a list of requests; request b contributes `extend_seq_lens[b]` new tokens (1 in
decode) on top of `extend_prefix_lens[b]` tokens whose KV is already in the pool. Tokens of
all requests are concatenated (ragged, no padding) in `input_ids`/`positions`/`out_cache_loc`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from srt_lite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


class ForwardMode(Enum):
    EXTEND = auto()  # prefill, chunked prefill, or a mix of prefill and decode rows
    DECODE = auto()  # exactly one new token per request

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot of each new token
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64, prefix + new tokens
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]  # new tokens per request (all 1 in decode)
    extend_prefix_lens_cpu: list[int]
    req_to_token_pool: "ReqToTokenPool | None" = None
    token_to_kv_pool: "TokenToKVPool | None" = None
    # The AttentionBackend (layers/attention/base.py) that plans and runs this step; typed
    # loosely because the backends are built on this module, not the other way round.
    attn_backend: Any = None
    # Logits for every new token (prompt logprobs, tests) instead of the last one per request.
    return_all_logits: bool = False
    # Tokens whose logits the sampler needs, when some request wants more than its last one
    # (speculative decoding verifies every draft position); None = each request's last token.
    logit_index: torch.Tensor | None = None  # [R] int64 token indices
    # Embedding requests in the batch: how the logits processor also pools each request's
    # final hidden states ("last": its last new token; "mean": the sum over its new tokens).
    pool: str | None = None
    # Filled by the attention backend's init_forward_metadata.
    attn_metadata: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def create(
        cls,
        input_ids: list[int],
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        device: str,
        return_all_logits: bool = False,
        num_logits: list[int] | None = None,
        pool: str | None = None,
    ) -> "ForwardBatch":
        """Builds the tensors from host lists; positions continue each request's prefix.
        num_logits[b]: how many of request b's last new tokens need logits (default 1)."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        logit_index = None
        if num_logits is not None and any(n != 1 for n in num_logits):
            ends = list(itertools.accumulate(extend_lens))
            logit_index = torch.tensor(
                [t for end, n in zip(ends, num_logits) for t in range(end - n, end)], dtype=torch.int64, device=device
            )
        decode = all(e == 1 for e in extend_lens) and not return_all_logits and pool is None
        positions = torch.cat(
            [torch.arange(p, p + e, dtype=torch.int64) for p, e in zip(prefix_lens, extend_lens)]
        ) if not decode else torch.tensor(prefix_lens, dtype=torch.int64)
        return cls(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(seq_lens),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=positions.to(device),
            out_cache_loc=out_cache_loc.to(device),
            req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=list(extend_lens),
            extend_prefix_lens_cpu=list(prefix_lens),
            return_all_logits=return_all_logits,
            logit_index=logit_index,
            pool=pool,
        )
