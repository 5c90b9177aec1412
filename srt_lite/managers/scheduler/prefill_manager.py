"""Admission: the waiting queue, and which of it the next prefill step computes.

Requests wait here until a prefill step admits them: ordered by policy, given their cached
prefix, and budgeted by `PrefillAdder` (KV now plus a decode reserve, tokens per step). A
prompt longer than a step's budget stays here as the one chunked request and continues in the
following steps. When decoding runs out of KV, `retract` sends running requests back here.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from srt_lite.managers.scheduler.running_batch import RunningBatch
from srt_lite.managers.scheduler.schedule_batch import ScheduleBatch
from srt_lite.managers.scheduler.schedule_policy import (
    DecodeReserve,
    PrefillAdder,
    order_waiting_queue,
    retraction_order,
    waits_for_in_batch_prefix,
)
from srt_lite.mem_cache.req_kv import ReqKVManager
from srt_lite.req import Req
from srt_lite.server_args import ServerArgs
from srt_lite.speculative.ngram import no_drafts

logger = logging.getLogger(__name__)

# Decoding rows draft in a mixed step only when its prompt tokens are at most this many: a
# new request whose prompt is mostly a cached prefix leaves the step decode-like, while
# beside a longer prefill a draft token is no longer nearly free and costs more than it gives.
DRAFTS_BESIDE_PREFILL_MAX = 64

# A planner of decoding rows' draft tokens: (requests, KV slots reserved for the step's
# prompt tokens) -> number of draft tokens it gave them.
PlanDrafts = Callable[[list[Req], int], int]


class PrefillManager:
    def __init__(self, kv: ReqKVManager, args: ServerArgs, max_running: int, chunk_size: int, plan_drafts: PlanDrafts):
        self.kv = kv
        self.policy = args.schedule_policy
        self.max_prefill_tokens = args.max_prefill_tokens
        self.mixed_chunk = not args.disable_mixed_chunk
        self.in_batch_prefix = not args.disable_radix_cache
        self.max_running = max_running
        self.chunk_size = chunk_size if chunk_size > 0 else 1 << 62
        self.plan_drafts = plan_drafts
        self.waiting: list[Req] = []
        self.chunked_req: Req | None = None  # admitted, its prompt not yet fully computed
        self.reserve = DecodeReserve()
        self.num_retractions = 0

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort_waiting(self, rid: str) -> list[Req]:
        """Removes the waiting requests `rid` names ("" names all) and returns them."""
        gone = [r for r in self.waiting if rid in ("", r.rid)]
        for req in gone:
            self.waiting.remove(req)
            self.kv.release(req)  # a retracted request may still hold nothing; no-op then
        return gone

    def take_aborted_chunk(self) -> Req | None:
        """The chunked request if an abort marked it; it is no longer scheduled."""
        req = self.chunked_req
        if req is None or not req.to_abort:
            return None
        self.chunked_req = None
        return req

    def schedule(self, running: RunningBatch) -> tuple[ScheduleBatch, torch.Tensor] | None:
        """A batch of prompt (chunks) to extend, and its KV slots. With mixed chunks the
        running requests decode their next token in the same forward, so new prompts neither
        wait for the running batch nor stall it."""
        if not self.waiting and self.chunked_req is None:
            return None
        if len(running) >= self.max_running and self.chunked_req is None:
            return None
        mixed = bool(running) and self.mixed_chunk
        if mixed and self.kv.available() < len(running):
            return None  # decode alone first: it retracts to make room
        num_decode = len(running) if mixed else 0
        adder = PrefillAdder(
            sum(self.reserve.of(r) for r in running) + num_decode,
            self.max_prefill_tokens,
            max(self.chunk_size - num_decode, 1),
            len(running),
        )
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            if not adder.try_add(req, self.kv.available(), self.reserve.of(req)):
                self.chunked_req = req  # no room for the next chunk yet; decode first
                return None
        self._admit_waiting(adder, len(running))
        if not adder.can_run:
            return None
        self.chunked_req = adder.chunked_req
        decoding = list(running) if mixed else []
        if adder.new_tokens <= DRAFTS_BESIDE_PREFILL_MAX:
            self.plan_drafts(decoding, adder.new_tokens)
        else:
            no_drafts(decoding)
        batch = ScheduleBatch(decoding + adder.can_run, is_prefill=True, num_decode=num_decode)
        return batch, self.kv.alloc_extend(batch.reqs)

    def _admit_waiting(self, adder: PrefillAdder, num_running: int) -> None:
        """Moves waiting requests into the adder, in policy order, while budget and KV last."""
        order_waiting_queue(self.waiting, self.policy, self.kv.match_len)
        for req in list(self.waiting):
            if num_running + len(adder.can_run) >= self.max_running or not adder.budget_left():
                break
            if not self.kv.admit(req):
                break
            if self.in_batch_prefix and waits_for_in_batch_prefix(req, adder.can_run):
                self.kv.release(req)  # next step its prefix is a cache hit instead of a recompute
                continue
            if not adder.try_add(req, self.kv.available(), self.reserve.of(req)):
                self.kv.release(req)
                break
            if req.retracted == 0 and not req.output_ids:
                req.cached_tokens = req.prefix_len
            if req.queue_time is None:
                req.queue_time = time.monotonic() - req.arrival_time
            self.waiting.remove(req)

    def retract(self, running: RunningBatch) -> None:
        """Frees KV for the running batch's next decode step by sending requests back to the
        queue (`retraction_order`); they keep their output and resume from (mostly cached)
        prefill later. At least one request stays; when that one alone still does not fit,
        the chunked prompt goes back too."""
        order = retraction_order(running.reqs)
        retracted = []
        while self.kv.available() < len(running) and len(running) > 1:
            req = order.pop(0)
            running.remove([req])
            self.kv.release(req)
            req.retracted += 1
            self.num_retractions += 1
            retracted.append(req)
        chunk = self.chunked_req
        if self.kv.available() < len(running) and chunk is not None:
            # The prompt being chunked holds KV as well. Its computed chunks go to the cache and
            # it starts over from there, rather than the last running request ending short of
            # its max_new_tokens while memory it could use sits in a half-done prompt.
            self.chunked_req = None
            self.kv.release(chunk)
            chunk.hidden_sum = None  # a mean-pooled prompt is computed again from its start
            chunk.retracted += 1
            self.num_retractions += 1
            retracted.append(chunk)
        # Retracted requests go first when memory allows again, oldest first.
        self.waiting[:0] = sorted(retracted, key=lambda r: r.arrival_time)
        self.reserve.after_retraction(self.kv.capacity - self.kv.available(), running.reqs)
        logger.info("KV cache full: retracted %d request(s), #running-req: %d", len(retracted), len(running))
