"""The scheduler's counters and log lines: what it reports, never what it decides.

It reads the state of the KV cache, the running batch and the waiting queue to describe them
(SGLang's "Prefill batch." and "Decode batch." lines, the load report) and changes none of it.
"""

from __future__ import annotations

import logging
import time

from srt_lite.managers.io_struct import GetLoadReqOutput
from srt_lite.managers.scheduler.prefill_manager import PrefillManager
from srt_lite.managers.scheduler.running_batch import RunningBatch
from srt_lite.managers.scheduler.schedule_batch import ScheduleBatch
from srt_lite.mem_cache.req_kv import ReqKVManager
from srt_lite.req import Req

logger = logging.getLogger(__name__)


class SchedulerStats:
    def __init__(
        self,
        kv: ReqKVManager,
        running: RunningBatch,
        prefill: PrefillManager,
        log_interval: int,
        speculative: bool,
        logs: bool,
    ):
        self.kv = kv
        self.running = running
        self.prefill = prefill
        self.log_interval = log_interval
        self.speculative = speculative
        self.logs = logs  # every rank runs the same batches; one rank's log lines are enough
        self.forward_steps = 0
        self.aborted_reqs = 0
        self.decode_steps = 0
        self.decode_tokens_since_log = 0
        self.last_decode_log = time.monotonic()
        self.last_gen_throughput = 0.0
        # Speculative decoding since start: request-steps that verified drafts, the tokens
        # they produced; and both at the last decode log line.
        self.spec_rows_total = self.spec_tokens_total = 0
        self.spec_at_last_log = (0, 0)

    def num_waiting(self) -> int:
        return len(self.prefill.waiting)

    def token_usage(self) -> float:
        return (self.kv.capacity - self.kv.available()) / self.kv.capacity

    def count_verified(self, new_tokens: int) -> None:
        """A decode row verified its draft and produced `new_tokens` tokens."""
        self.spec_rows_total += 1
        self.spec_tokens_total += new_tokens

    def count_decode_step(self, new_tokens: int) -> None:
        self.decode_steps += 1
        self.decode_tokens_since_log += new_tokens
        if self.decode_steps % self.log_interval == 0:
            self.log_decode()

    def log_prefill(self, batch: ScheduleBatch) -> None:
        if not self.logs:
            return
        new_tokens = sum(r.extend_len for r in batch.reqs[batch.num_decode :])
        cached = sum(r.prefix_len for r in batch.reqs if r.kv_len == r.prefix_len)
        drafts = ""
        if self.speculative:  # draft tokens of the decoding rows in this (mixed) step
            drafts = f", #draft-token: {sum(len(r.draft_ids) for r in batch.reqs[: batch.num_decode])}"
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d%s",
            len(batch.reqs), new_tokens, cached, self.token_usage(), len(self.running), self.num_waiting(), drafts,
        )

    def log_decode(self) -> None:
        if not self.logs:
            return
        now = time.monotonic()
        tput = self.decode_tokens_since_log / max(now - self.last_decode_log, 1e-6)
        self.last_gen_throughput = tput
        self.decode_tokens_since_log, self.last_decode_log = 0, now
        spec = ""
        if self.speculative:
            # Tokens per verified row and step (1 + accepted drafts), SGLang's "accept len".
            rows = self.spec_rows_total - self.spec_at_last_log[0]
            tokens = self.spec_tokens_total - self.spec_at_last_log[1]
            spec = f"accept len: {tokens / max(rows, 1):.2f}, "
            self.spec_at_last_log = (self.spec_rows_total, self.spec_tokens_total)
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %sgen throughput (token/s): %.2f, "
            "#queue-req: %d",
            len(self.running), self.kv.capacity - self.kv.available(), self.token_usage(), spec, tput,
            self.num_waiting(),
        )

    def load(self, holders: list[Req]) -> GetLoadReqOutput:
        """The load report; `holders` are the requests that hold KV of their own."""
        free, cached = self.kv.free_slots(), self.kv.cached_slots()
        return GetLoadReqOutput(
            num_running_reqs=len(self.running),
            num_waiting_reqs=self.num_waiting(),
            kv_used_tokens=self.kv.capacity - free - cached,
            kv_cached_tokens=cached,
            kv_free_tokens=free,
            kv_capacity=self.kv.capacity,
            invariant_ok=self.kv.check(holders),
            num_retractions=self.prefill.num_retractions,
            num_aborted_reqs=self.aborted_reqs,
            evicted_tokens=self.kv.evicted_tokens,
            gen_throughput=self.last_gen_throughput,
            spec_verified_rows=self.spec_rows_total,
            spec_new_tokens=self.spec_tokens_total,
            num_waiting_tokens=sum(len(r.origin_input_ids) + len(r.output_ids) for r in self.prefill.waiting),
        )
