"""Req: one request's scheduling state, the vocabulary every layer shares.

It sits at the bottom of the package (it imports only sampling parameters), so the KV cache,
the sampler and speculative decoding can all work on requests without importing the
managers that own them.

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
from typing import Any

import torch

from srt_lite.sampling.sampling_params import SamplingParams


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
    last_node: Any = None  # the locked mem_cache.radix_cache.TreeNode covering the cached part
    # this step's extend
    extend_len: int = 0
    # Speculative decoding: tokens guessed after the last output token, checked this step
    # (a decode row then computes 1 + len(draft_ids) tokens).
    draft_ids: list[int] = field(default_factory=list)
    ngram_index: Any = None  # speculative.ngram.NgramIndex over fill_ids, built on first use
    # Structured output: the matcher of the request's grammar (constrained.base.GrammarMatcher),
    # which has accepted every output token; None without a grammar.
    grammar: Any = None
    reasoning: str | None = None  # TokenizedGenerateReqInput.reasoning
    # Embedding requests: the pooling ("last" or "mean"), the running sum of the prompt's
    # hidden states over chunks (mean), and the result once the prompt is computed.
    pooling: str | None = None
    hidden_sum: Any = None  # [hidden] float32
    embedding: list[float] | None = None
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
    def stops_mid_prompt(self) -> bool:
        """This step computes a chunk of the prompt that ends before the prompt does: the
        token sampled after it is not kept."""
        return 0 < self.extend_len and self.kv_len + self.extend_len < self.seq_len

    @property
    def tokens_left(self) -> int:
        """Output tokens this request may still generate (max_new_tokens minus its output)."""
        return self.sampling_params.max_new_tokens - len(self.output_ids)

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
