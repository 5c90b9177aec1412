"""Which waiting requests join the next prefill batch, and how much of each.

Order: `fcfs` keeps arrival order; `lpm` (longest prefix match) puts requests that share the
most cached tokens first, so a shared prefix is reused while it is still in the cache.
Budget: new tokens are capped per batch (max_prefill_tokens) and per step (chunked prefill:
a prompt longer than the budget is split, one chunked request at a time), and a request is
admitted only if the KV it needs now plus a reserve for future decode tokens is available.
Retraction, admission's inverse, sends running requests back to the queue when decoding runs
out of KV: those with the fewest generated tokens first.

Everything here is pure bookkeeping over requests and numbers, testable without a model.
"""

from __future__ import annotations

from typing import Callable

from srt_lite.req import Req

# Decode-token reserve for admission: each running request is expected to need
# ratio * (its remaining max_new_tokens, clipped) more slots. The ratio decays while memory is
# fine and jumps back after a retraction (SGLang's scheme).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP = 4096
# Requests beyond this queue length are not prefix-matched for ordering (too costly).
LPM_MAX_QUEUE = 128
# Uncached tokens a waiting request must share with one already in the batch to be deferred.
IN_BATCH_PREFIX_MIN = 32


def order_waiting_queue(queue: list[Req], policy: str, match_len: Callable[[Req], int]) -> None:
    if policy == "lpm" and 1 < len(queue) <= LPM_MAX_QUEUE:
        lens = {id(r): match_len(r) for r in queue}
        queue.sort(key=lambda r: -lens[id(r)])  # stable: ties keep arrival order
    # fcfs (and retracted requests, which are put back at the front) keep queue order.


def waits_for_in_batch_prefix(req: Req, batch: list[Req]) -> bool:
    """True when req's next IN_BATCH_PREFIX_MIN uncached tokens (with everything before them)
    are also the tokens of a request already in this prefill batch. Deferring req one step
    turns that shared part into a radix-cache hit instead of computing it twice: a burst of
    requests with one long system prompt costs one prefill of it, not one per request
    (SGLang's in-batch prefix caching check)."""
    end = req.prefix_len + IN_BATCH_PREFIX_MIN
    ids = req.origin_input_ids
    if len(ids) < end:
        return False
    head = ids[:end]
    return any(other.origin_input_ids[:end] == head for other in batch)


class PrefillAdder:
    """Collects one prefill batch. KV availability is read fresh at every step because
    admitting a request locks its cached prefix, which is then no longer evictable."""

    def __init__(self, decode_reserve: int, max_prefill_tokens: int, chunk_size: int, num_running: int):
        self.reserved = decode_reserve  # future decode tokens of running requests
        self.num_running = num_running
        self.rem_input = max_prefill_tokens
        self.rem_chunk = chunk_size
        self.can_run: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_tokens = 0

    def budget_left(self) -> bool:
        return self.rem_input > 0 and self.rem_chunk > 0 and self.chunked_req is None

    def try_add(self, req: Req, available: int, decode_reserve: int) -> bool:
        """req is admitted (kv_len = its cached prefix); decides its extend_len.
        `available`: KV slots obtainable now; `decode_reserve`: what req will need later."""
        remaining = req.seq_len - req.kv_len
        take = min(remaining, self.rem_chunk, self.rem_input)
        full = take == remaining
        need = take + (decode_reserve if full else 0)
        if available - self.reserved - self.new_tokens < need:
            # The reserve is an estimate; a lone request whose prompt fits always runs
            # (retraction covers a wrong guess), otherwise a long max_new_tokens could
            # keep it waiting forever on an idle server.
            alone = self.num_running == 0 and not self.can_run
            if not (alone and available >= take):
                return False
        if not full and self.can_run and take < 64:
            # A sliver of a prompt is not worth a chunk; it starts the next batch instead.
            return False
        req.extend_len = take
        self.can_run.append(req)
        self.reserved += decode_reserve if full else 0
        self.rem_input -= take
        self.rem_chunk -= take
        self.new_tokens += take
        if not full:
            self.chunked_req = req
        return True


class DecodeReserve:
    """The KV slots running requests are expected to still need, as a learned ratio of what
    they could need at most: admission leaves that much free."""

    def __init__(self) -> None:
        self.ratio = INIT_NEW_TOKEN_RATIO

    def of(self, req: Req) -> int:
        left = req.tokens_left
        return int(min(max(left, 0), RESERVE_CLIP) * self.ratio)

    def reset(self) -> None:
        """An idle server starts over from the initial estimate."""
        self.ratio = INIT_NEW_TOKEN_RATIO

    def decay(self) -> None:
        """A decode step that found enough KV: expect a little less next time."""
        self.ratio = max(self.ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)

    def after_retraction(self, used_slots: int, running: list[Req]) -> None:
        """After a retraction, the ratio that the slots in use are of what the remaining
        requests may still generate (plus a margin): admission becomes cautious."""
        total = sum(r.tokens_left for r in running) or 1
        self.ratio = min(1.0, (used_slots + 0.0) / total + 0.1)


def retraction_order(running: list[Req]) -> list[Req]:
    """Who goes back to the queue first when KV runs out: the requests that have generated
    the fewest tokens (least work lost), and among those the longest prompts (most KV freed)."""
    return sorted(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
