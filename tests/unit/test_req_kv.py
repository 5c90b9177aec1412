"""ReqKVManager without a model: every slot is owned by the free list, the tree or a request,
through admission, prefill, decode, rejected drafts, release and a disabled cache."""

from __future__ import annotations

import pytest
import torch

from srt_lite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from srt_lite.mem_cache.req_kv import ReqKVManager
from srt_lite.req import Req
from srt_lite.sampling.sampling_params import SamplingParams

SLOTS = 128


def make_kv(disable_radix_cache: bool = False, rows: int = 4) -> ReqKVManager:
    r2t = ReqToTokenPool(rows, 256, "cpu")
    pool = TokenToKVPool(size=SLOTS, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu")
    return ReqKVManager(r2t, pool, disable_radix_cache)


def make_req(prompt: list[int]) -> Req:
    return Req("r", list(prompt), SamplingParams(max_new_tokens=8))


def prefill(kv: ReqKVManager, req: Req) -> None:
    """One prefill step over the rest of req's prompt, then its first token."""
    req.extend_len = req.seq_len - req.kv_len
    kv.alloc_extend([req])
    req.kv_len += req.extend_len
    kv.cache_unfinished(req)
    req.output_ids.append(7)


def cached_prompt(kv: ReqKVManager, prompt: list[int]) -> None:
    """A request over `prompt` that ran and finished: its KV is left in the cache."""
    req = make_req(prompt)
    kv.admit(req)
    prefill(kv, req)
    kv.release(req)


def decode(kv: ReqKVManager, req: Req, drafts: int = 0, accepted: int = 0) -> None:
    """One decode step: the last token plus `drafts` draft tokens, `accepted` of them kept."""
    req.extend_len = 1 + drafts
    kv.alloc_extend([req])
    written = req.kv_len + req.extend_len
    for _ in range(1 + accepted):
        req.kv_len += 1
        req.output_ids.append(8)
    if req.kv_len < written:
        kv.free_tail(req, written)


def test_admit_prefill_decode_release_keeps_every_slot_accounted():
    kv = make_kv()
    req = make_req(list(range(1, 21)))
    assert kv.admit(req) and req.prefix_len == req.kv_len == 0
    prefill(kv, req)
    assert kv.check([req])
    # The prompt's KV went to the tree and is locked: not evictable while req runs.
    assert req.prefix_len == 20 and kv.cached_slots() == 0
    assert kv.free_slots() == SLOTS - 20
    decode(kv, req)
    decode(kv, req, drafts=3, accepted=1)  # two rejected draft slots go straight back
    assert req.kv_len == 23 and kv.free_slots() == SLOTS - 23
    assert kv.check([req])
    kv.release(req)
    assert req.req_pool_idx is None and req.kv_len == req.prefix_len == 0
    # Everything it computed is now evictable cache; nothing leaked.
    assert kv.free_slots() + kv.cached_slots() == SLOTS and kv.cached_slots() == 23
    assert kv.check([])


def test_second_request_gets_the_cached_prefix_and_duplicates_are_freed():
    kv = make_kv()
    a, b = make_req(list(range(1, 31))), make_req(list(range(1, 31)) + [50, 51])
    assert kv.match_len(b) == 0
    kv.admit(a)
    prefill(kv, a)
    assert kv.match_len(b) == 30
    kv.admit(b)
    assert b.prefix_len == b.kv_len == 30  # locked cached prefix, nothing to recompute
    prefill(kv, b)
    assert kv.check([a, b])
    # Both computed the same prompt twice only if admitted together: then the tree keeps one copy.
    c, d = make_req(list(range(60, 80))), make_req(list(range(60, 80)))
    kv.admit(c)
    kv.admit(d)
    used = kv.free_slots()
    prefill(kv, c)
    prefill(kv, d)
    assert kv.free_slots() == used - 20  # d's duplicate slots returned to the free list
    assert kv.check([a, b, c, d])
    for r in (a, b, c, d):
        kv.release(r)
    assert kv.check([]) and kv.free_slots() + kv.cached_slots() == SLOTS


def test_match_leaves_a_token_to_compute_and_respects_prompt_logprobs():
    kv = make_kv()
    cached_prompt(kv, list(range(1, 11)))
    same = make_req(list(range(1, 11)))
    assert kv.match_len(same) == 9  # the last prompt token is computed again for its logits
    wants = make_req(list(range(1, 11)))
    wants.return_logprob, wants.logprob_start_len = True, 4
    assert kv.match_len(wants) == 3  # logits from position 3 on are needed


def test_eviction_makes_room_and_is_counted():
    kv = make_kv()
    cached_prompt(kv, list(range(1, 101)))
    assert kv.available() == SLOTS and kv.free_slots() == SLOTS - 100
    slots = kv.alloc(SLOTS - 10)
    # 28 slots were free: at least 90 cached ones had to be evicted.
    assert slots is not None and kv.evicted_tokens >= (SLOTS - 10) - (SLOTS - 100)
    assert kv.free_slots() + slots.numel() + kv.cached_slots() == SLOTS


def test_disabled_cache_returns_slots_to_the_free_list():
    kv = make_kv(disable_radix_cache=True)
    a = make_req(list(range(1, 21)))
    kv.admit(a)
    prefill(kv, a)
    assert a.prefix_len == 0 and kv.cached_slots() == 0
    assert kv.check([a])
    kv.release(a)
    assert kv.free_slots() == SLOTS and kv.check([])
    b = make_req(list(range(1, 21)))
    assert kv.match_len(b) == 0


def test_admit_fails_without_a_free_row():
    kv = make_kv(rows=1)
    assert kv.admit(make_req([1, 2, 3]))
    assert not kv.admit(make_req([4, 5, 6]))


def test_flush_refused_while_a_request_holds_cache():
    kv = make_kv()
    a = make_req(list(range(1, 11)))
    kv.admit(a)
    prefill(kv, a)
    assert not kv.flush()
    kv.release(a)
    assert kv.flush() and kv.free_slots() == SLOTS


@pytest.mark.parametrize("disable", [False, True])
def test_check_catches_a_leak(disable):
    kv = make_kv(disable_radix_cache=disable)
    a = make_req(list(range(1, 11)))
    kv.admit(a)
    prefill(kv, a)
    kv.alloc(3)  # slots taken by nobody
    assert not kv.check([a])
