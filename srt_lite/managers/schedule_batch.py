"""Req (one request's scheduling state) and ScheduleBatch (the requests of one forward step).

Token bookkeeping of a request:
    fill_ids = origin_input_ids + output_ids       every token it has, prompt first
    kv_len   = tokens of fill_ids whose KV is in the pool (prefix hit + computed so far)
    req_to_token[req_pool_idx, :kv_len]  their KV slots
A prefill step computes fill_ids[kv_len : kv_len + extend_len]; a decode step computes the
last output token (and with speculative decoding its draft tokens after it). Only a step that
reaches the end of fill_ids produces new tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from srt_lite.model_executor.forward_batch import ForwardBatch
from srt_lite.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from srt_lite.mem_cache.radix_cache import TreeNode


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    # Seeded requests draw their sampling noise from their own generator.
    generator: torch.Generator | None = None
    # logprobs (SGLang request fields)
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position with a logprob; -1: none
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    # accumulated logprob results; output ones are sent incrementally like output_ids
    input_logprobs: dict[str, list] = field(default_factory=dict)
    output_logprobs: dict[str, list] = field(default_factory=dict)
    logprobs_sent: int = 0
    # KV state
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_len: int = 0  # tokens matched in the radix cache at (re)admission
    cached_tokens: int = 0  # radix hits counted for the client (first admission only)
    last_node: "TreeNode | None" = None  # locked radix node covering the cached part
    # this step's extend
    extend_len: int = 0
    # Speculative decoding: tokens guessed after the last output token, checked this step
    # (a decode row then computes 1 + len(draft_ids) tokens).
    draft_ids: list[int] = field(default_factory=list)
    ngram_index: Any = None  # speculative.ngram.NgramIndex over fill_ids, built on first use
    # lifecycle
    finished_reason: dict[str, Any] | None = None
    to_abort: bool = False
    sent_len: int = 0  # output ids already sent to the detokenizer
    arrival_time: float = field(default_factory=time.monotonic)
    queue_time: float | None = None  # arrival to first admission, seconds
    first_token_time: float | None = None  # wall clock (time.time()), for TTFT metrics
    retracted: int = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def finish(self, kind: str, matched: Any = None, message: str | None = None, length: int | None = None) -> None:
        """SGLang's finish_reason dicts: {"type": "stop", "matched": token id or stop string},
        {"type": "length", "matched": None, "length": n}, {"type": "abort", ..., "message"}."""
        if self.finished_reason is None:
            self.finished_reason = {"type": kind, "matched": matched}
            if length is not None:
                self.finished_reason["length"] = length
            if message:
                self.finished_reason["message"] = message


@dataclass
class ScheduleBatch:
    """is_prefill: some rows extend a prompt. The first `num_decode` rows are running requests
    that decode one token in the same step (a mixed batch), or all rows when not is_prefill."""

    reqs: list[Req]
    is_prefill: bool
    num_decode: int = 0

    def to_forward_batch(self, out_cache_loc: torch.Tensor, device: str, return_all_logits: bool = False) -> ForwardBatch:
        """Tokens to compute: each request's extend_len tokens after its kv_len."""
        nd = self.num_decode if self.is_prefill else len(self.reqs)
        input_ids: list[int] = []
        for r in self.reqs[:nd]:
            input_ids.append(r.output_ids[-1])
            input_ids.extend(r.draft_ids)
        for r in self.reqs[nd:]:
            input_ids.extend(r.fill_ids[r.kv_len : r.kv_len + r.extend_len])
        return ForwardBatch.create(
            input_ids=input_ids,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            prefix_lens=[r.kv_len for r in self.reqs],
            extend_lens=[r.extend_len for r in self.reqs],
            num_logits=[1 + len(r.draft_ids) for r in self.reqs[:nd]] + [1] * (len(self.reqs) - nd),
            out_cache_loc=out_cache_loc,
            device=device,
            return_all_logits=return_all_logits,
        )
