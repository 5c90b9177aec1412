"""ScheduleBatch: the requests of one forward step, and how they become a ForwardBatch.

A request's token bookkeeping (fill_ids, kv_len, extend_len) is described in srt_lite/req.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from srt_lite.model_executor.forward_batch import ForwardBatch
from srt_lite.req import Req
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class ScheduleBatch:
    """is_prefill: some rows extend a prompt. The first `num_decode` rows are running requests
    that decode one token in the same step (a mixed batch), or all rows when not is_prefill."""

    reqs: list[Req]
    is_prefill: bool
    num_decode: int = 0
    # The sampling rows, in row order: the running batch's SamplingBatchInfo for the decode
    # rows (it lives across steps), then one built for this step's new requests.
    sampling: list[SamplingBatchInfo] = field(default_factory=list)

    def sampling_parts(self, rows_per_req: list[int] | None = None) -> list[tuple[int, int, SamplingBatchInfo]]:
        """(first row, end row, info) of each part of `sampling`; with rows_per_req (logits
        rows of each request, 1 + its draft tokens), each info repeated to those rows."""
        parts, start, req = [], 0, 0
        for info in self.sampling:
            if rows_per_req is not None:
                counts = rows_per_req[req : req + info.batch_size]
                req += info.batch_size
                if any(c != 1 for c in counts):
                    info = info.repeat_rows(counts)
            parts.append((start, start + info.batch_size, info))
            start += info.batch_size
        return parts

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
            pool=next((r.pooling for r in self.reqs[nd:] if r.pooling), None),
        )
