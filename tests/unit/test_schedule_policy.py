"""Admission without a model: the prefill adder's budget rules, queue order, the decode reserve,
retraction order, and the PrefillManager driving them over a real KV manager."""

from __future__ import annotations

import torch

from srt_lite.managers.scheduler.prefill_manager import DRAFTS_BESIDE_PREFILL_MAX, PrefillManager
from srt_lite.managers.scheduler.running_batch import RunningBatch
from srt_lite.managers.scheduler.schedule_policy import (
    IN_BATCH_PREFIX_MIN,
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    RESERVE_CLIP,
    DecodeReserve,
    PrefillAdder,
    order_waiting_queue,
    retraction_order,
    waits_for_in_batch_prefix,
)
from srt_lite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from srt_lite.mem_cache.req_kv import ReqKVManager
from srt_lite.req import Req
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo
from srt_lite.sampling.sampling_params import SamplingParams
from srt_lite.server_args import ServerArgs


def make_req(rid: str, prompt: list[int], max_new: int = 16, output: list[int] | None = None) -> Req:
    req = Req(rid, list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0))
    req.output_ids = list(output or [])
    return req


def make_kv(slots: int = 256, rows: int = 8, disable_radix_cache: bool = False) -> ReqKVManager:
    r2t = ReqToTokenPool(rows, 512, "cpu")
    pool = TokenToKVPool(size=slots, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu")
    return ReqKVManager(r2t, pool, disable_radix_cache)


# ---- PrefillAdder ------------------------------------------------------------------------


def test_adder_takes_whole_prompts_and_reserves_their_decode():
    adder = PrefillAdder(decode_reserve=0, max_prefill_tokens=1000, chunk_size=1000, num_running=0)
    a, b = make_req("a", range(10)), make_req("b", range(20))
    assert adder.try_add(a, available=200, decode_reserve=5)
    assert adder.try_add(b, available=200, decode_reserve=7)
    assert (a.extend_len, b.extend_len) == (10, 20)
    assert adder.new_tokens == 30 and adder.reserved == 12
    assert adder.chunked_req is None and adder.budget_left()


def test_adder_refuses_when_kv_minus_reserve_is_short():
    adder = PrefillAdder(decode_reserve=50, max_prefill_tokens=1000, chunk_size=1000, num_running=1)
    req = make_req("a", range(10))
    # 50 reserved for the running requests + 10 prompt + 5 own reserve = 65 > 64.
    assert not adder.try_add(req, available=64, decode_reserve=5)
    assert adder.try_add(req, available=65, decode_reserve=5)


def test_lone_request_runs_even_if_its_reserve_does_not_fit():
    # An idle server: the reserve is only an estimate; a prompt that fits must not wait forever.
    adder = PrefillAdder(decode_reserve=0, max_prefill_tokens=1000, chunk_size=1000, num_running=0)
    req = make_req("a", range(10), max_new=4000)
    assert adder.try_add(req, available=10, decode_reserve=3000)
    # Not when something is already running, nor when the prompt itself does not fit.
    busy = PrefillAdder(decode_reserve=0, max_prefill_tokens=1000, chunk_size=1000, num_running=1)
    assert not busy.try_add(make_req("b", range(10)), available=10, decode_reserve=3000)
    idle = PrefillAdder(decode_reserve=0, max_prefill_tokens=1000, chunk_size=1000, num_running=0)
    assert not idle.try_add(make_req("c", range(10)), available=9, decode_reserve=0)


def test_adder_chunks_a_long_prompt_and_stops_after_it():
    adder = PrefillAdder(decode_reserve=0, max_prefill_tokens=1000, chunk_size=64, num_running=0)
    req = make_req("a", range(100))
    assert adder.try_add(req, available=1000, decode_reserve=10)
    assert req.extend_len == 64 and adder.chunked_req is req
    assert adder.reserved == 0  # a chunk does not finish the prompt: no decode reserve yet
    assert not adder.budget_left()  # one chunked request per batch


def test_adder_respects_max_prefill_tokens():
    adder = PrefillAdder(decode_reserve=0, max_prefill_tokens=100, chunk_size=1000, num_running=0)
    assert adder.try_add(make_req("a", range(20)), available=1000, decode_reserve=0)
    b = make_req("b", range(200))
    assert adder.try_add(b, available=1000, decode_reserve=0)
    assert b.extend_len == 80 and adder.chunked_req is b and not adder.budget_left()


def test_adder_skips_a_sliver_of_a_prompt_after_others():
    adder = PrefillAdder(decode_reserve=0, max_prefill_tokens=1000, chunk_size=100, num_running=0)
    assert adder.try_add(make_req("a", range(60)), available=1000, decode_reserve=0)
    sliver = make_req("b", range(200))  # only 40 tokens of budget left: less than 64
    assert not adder.try_add(sliver, available=1000, decode_reserve=0)
    assert adder.can_run and len(adder.can_run) == 1


# ---- ordering, in-batch prefix, reserve, retraction ---------------------------------------


def test_lpm_orders_by_cached_prefix_and_fcfs_keeps_arrival_order():
    reqs = [make_req(str(i), [i] * 8) for i in range(4)]
    cached = {"0": 0, "1": 5, "2": 7, "3": 5}
    queue = list(reqs)
    order_waiting_queue(queue, "fcfs", lambda r: cached[r.rid])
    assert [r.rid for r in queue] == ["0", "1", "2", "3"]
    order_waiting_queue(queue, "lpm", lambda r: cached[r.rid])
    assert [r.rid for r in queue] == ["2", "1", "3", "0"]  # ties keep arrival order


def test_in_batch_prefix_defers_a_request_sharing_uncached_tokens():
    shared = list(range(IN_BATCH_PREFIX_MIN))
    first = make_req("a", shared + [1000, 1001])
    same_start = make_req("b", shared + [2000])
    other = make_req("c", [7] * (IN_BATCH_PREFIX_MIN + 1))
    assert waits_for_in_batch_prefix(same_start, [first])
    assert not waits_for_in_batch_prefix(other, [first])
    short = make_req("d", shared[:4])  # too short to share IN_BATCH_PREFIX_MIN tokens
    assert not waits_for_in_batch_prefix(short, [first])


def test_decode_reserve_decays_to_a_floor_resets_and_jumps_after_retraction():
    reserve = DecodeReserve()
    req = make_req("a", range(4), max_new=100, output=[1] * 20)
    assert reserve.of(req) == int(80 * INIT_NEW_TOKEN_RATIO)
    for _ in range(10_000):
        reserve.decay()
    assert reserve.ratio == MIN_NEW_TOKEN_RATIO
    huge = make_req("b", range(4), max_new=10 * RESERVE_CLIP)
    assert reserve.of(huge) == int(RESERVE_CLIP * MIN_NEW_TOKEN_RATIO)  # clipped
    reserve.after_retraction(used_slots=40, running=[req])  # 40 used of 80 still to come
    assert abs(reserve.ratio - 0.6) < 1e-9
    reserve.reset()
    assert reserve.ratio == INIT_NEW_TOKEN_RATIO


def test_retraction_order_fewest_outputs_then_longest_prompt():
    a = make_req("a", range(5), output=[1, 2, 3])
    b = make_req("b", range(5), output=[1])
    c = make_req("c", range(50), output=[1])
    d = make_req("d", range(5), output=[])
    assert [r.rid for r in retraction_order([a, b, c, d])] == ["d", "c", "b", "a"]


# ---- PrefillManager over a real ReqKVManager ----------------------------------------------


def make_manager(kv: ReqKVManager, drafts: list | None = None, **flags) -> PrefillManager:
    args = ServerArgs(**flags)

    def plan_drafts(reqs: list[Req], reserved: int) -> int:
        if drafts is not None and reqs:
            drafts.append((len(reqs), reserved))
        for r in reqs:
            r.draft_ids, r.extend_len = [], 1
        return 0

    return PrefillManager(kv, args, max_running=8, chunk_size=args.chunked_prefill_size or 512, plan_drafts=plan_drafts)


def finish_prefill(kv: ReqKVManager, reqs: list[Req], running: RunningBatch) -> None:
    """What a prefill step does to its requests' KV: computed, cached, then running."""
    for r in reqs:
        r.kv_len += r.extend_len
        kv.cache_unfinished(r)
    done = [r for r in reqs if r.kv_len == r.seq_len]
    for r in done:
        r.output_ids.append(1)
    if done:
        running.add(done, SamplingBatchInfo.from_reqs(done, 4096, "cpu", set()))


def test_manager_chunks_a_long_prompt_over_steps_then_it_runs():
    kv = make_kv()
    mgr = make_manager(kv, chunked_prefill_size=32)
    running = RunningBatch()
    req = make_req("long", range(1, 81))
    mgr.add(req)
    extends = []
    while not running:
        step = mgr.schedule(running)
        assert step is not None
        batch, out_cache_loc = step
        assert batch.reqs == [req] and out_cache_loc.numel() == req.extend_len
        extends.append(req.extend_len)
        finish_prefill(kv, batch.reqs, running)
    assert extends == [32, 32, 16] and not mgr.waiting and mgr.chunked_req is None
    assert req.queue_time is not None and req.cached_tokens == 0
    assert kv.check([req])


def test_manager_reuses_cached_prefix_and_counts_cached_tokens():
    kv = make_kv()
    mgr = make_manager(kv)
    running = RunningBatch()
    first = make_req("a", range(1, 41))
    mgr.add(first)
    batch, _ = mgr.schedule(running)
    finish_prefill(kv, batch.reqs, running)
    second = make_req("b", list(range(1, 41)) + [99, 98])
    mgr.add(second)
    batch, _ = mgr.schedule(running)
    assert second in batch.reqs
    assert second.cached_tokens == 40 and second.extend_len == 2
    # Mixed step: the running request decodes one token in the same forward.
    assert batch.num_decode == 1 and batch.reqs[0] is first


def test_manager_mixed_step_drafts_only_beside_short_prefills():
    kv = make_kv(slots=512)
    planned: list = []
    mgr = make_manager(kv, drafts=planned)
    running = RunningBatch()
    mgr.add(make_req("a", range(1, 11)))
    batch, _ = mgr.schedule(running)
    finish_prefill(kv, batch.reqs, running)
    mgr.add(make_req("b", range(100, 100 + DRAFTS_BESIDE_PREFILL_MAX + 1)))
    mgr.schedule(running)
    assert planned == []  # beside a long prefill the running rows take one token each
    mgr.add(make_req("c", range(300, 305)))
    mgr.schedule(running)
    assert planned == [(1, 5)]  # beside a short one they may draft, leaving its 5 slots


def test_manager_defers_a_request_that_shares_an_uncached_prefix_with_the_batch():
    kv = make_kv(slots=512)
    mgr = make_manager(kv)
    running = RunningBatch()
    shared = list(range(1, IN_BATCH_PREFIX_MIN + 11))
    a, b = make_req("a", shared + [500]), make_req("b", shared + [600])
    mgr.add(a)
    mgr.add(b)
    batch, _ = mgr.schedule(running)
    assert batch.reqs == [a] and mgr.waiting == [b]
    finish_prefill(kv, batch.reqs, running)
    batch, _ = mgr.schedule(running)
    assert b in batch.reqs and b.cached_tokens == len(shared)  # now a cache hit


def test_manager_retracts_until_the_rest_fits_and_requeues_oldest_first():
    kv = make_kv(slots=64, rows=8)
    mgr = make_manager(kv)
    running = RunningBatch()
    reqs = [make_req(str(i), range(10 * i + 1, 10 * i + 11), max_new=4) for i in range(4)]
    for r in reqs:
        mgr.add(r)
    while mgr.waiting:
        batch, _ = mgr.schedule(running)
        finish_prefill(kv, batch.reqs[batch.num_decode :], running)
    reqs[0].output_ids += [2, 3]  # the oldest has generated the most
    # Fill the free list so that decoding 4 rows does not fit.
    hog = kv.alloc(kv.available() - 2)
    assert hog is not None
    mgr.retract(running)
    # One retraction frees the 10 slots of "1" (fewest outputs, oldest among the ties): enough.
    assert mgr.num_retractions == 1 and [r.rid for r in running] == ["0", "2", "3"]
    assert mgr.waiting == [reqs[1]] and reqs[1].retracted == 1 and reqs[1].req_pool_idx is None
    assert kv.available() >= len(running)
    assert mgr.reserve.ratio > MIN_NEW_TOKEN_RATIO
    kv.token_to_kv_pool.free(hog)
    assert kv.check(running.reqs)  # the retracted request left its KV to the cache, none leaked


def test_manager_retracts_the_chunked_prompt_before_the_last_request_runs_short():
    """A lone running request whose next token does not fit because a half-computed prompt
    holds the memory: the chunked prompt goes back to the queue (its chunks to the cache), so
    the running request is not ended early."""
    kv = make_kv(slots=64, rows=8)
    mgr = make_manager(kv, chunked_prefill_size=16)
    running = RunningBatch()
    first = make_req("a", range(1, 11), max_new=40)
    mgr.add(first)
    batch, _ = mgr.schedule(running)
    finish_prefill(kv, batch.reqs, running)
    long = make_req("b", range(100, 140), max_new=4)
    mgr.add(long)
    batch, _ = mgr.schedule(running)
    assert batch.reqs[: batch.num_decode] == [first]  # a mixed step: "a" decodes a token beside
    first.kv_len += 1
    first.output_ids.append(2)
    finish_prefill(kv, batch.reqs[batch.num_decode :], running)
    assert mgr.chunked_req is long and long.kv_len > 0
    hog = kv.alloc(kv.token_to_kv_pool.available_size())  # the rest of the pool is taken
    assert hog is not None and kv.available() < len(running)
    mgr.retract(running)
    assert list(running) == [first] and mgr.chunked_req is None
    assert mgr.waiting == [long] and long.retracted == 1 and long.req_pool_idx is None
    assert kv.available() >= len(running)  # the chunk's slots are evictable cache now
    kv.token_to_kv_pool.free(hog)
    assert kv.check(running.reqs)


def test_manager_abort_waiting_removes_by_rid_or_all():
    kv = make_kv()
    mgr = make_manager(kv)
    for rid in ("a", "b", "c"):
        mgr.add(make_req(rid, range(1, 6)))
    assert [r.rid for r in mgr.abort_waiting("b")] == ["b"]
    assert [r.rid for r in mgr.waiting] == ["a", "c"]
    assert len(mgr.abort_waiting("")) == 2 and not mgr.waiting
