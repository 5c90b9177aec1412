"""The torch_native backend's attention plans: which plan each step gets (pinned on
representative shapes, so a refactor keeps today's cost rule) and what each plan computes
(against plain per-request attention)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from srt_lite import cpu_kernels
from srt_lite.layers.attention.base import AttentionConfig
from srt_lite.layers.attention.torch_native import backend as tnb
from srt_lite.layers.attention.torch_native.choose import (
    CASCADE_MIN_PREFIX,
    FLASH_ROW_MIN_Q,
    PlanKind,
    choose_group,
    choose_plan,
    prompt_rows_in_flash,
)
from srt_lite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from srt_lite.model_executor.forward_batch import ForwardBatch

HKV, HEAD_DIM = 2, 16


def make_batch(rows: list[tuple[int, int]], shared: int, dtype: torch.dtype = torch.float32) -> ForwardBatch:
    """A step of rows (prefix length, new tokens) whose first `shared` KV slots (at most
    their prefix) are the same slots, as a radix-cache hit lays them out; the rest are each
    row's own."""
    r2t = ReqToTokenPool(len(rows) + 1, 1024, "cpu")
    kv = TokenToKVPool(16384, 1, HKV, HEAD_DIM, dtype, "cpu")
    common = torch.arange(1, shared + 1)  # [shared]
    nxt, pool_rows, locs = shared + 1, [], []
    for p, e in rows:
        row = r2t.alloc()
        own = torch.arange(nxt, nxt + p + e - min(shared, p))
        nxt += own.numel()
        r2t.req_to_token[row, : p + e] = torch.cat([common[: min(shared, p)], own]).int()
        pool_rows.append(row)
        locs.append(r2t.req_to_token[row, p : p + e].long())
    fb = ForwardBatch.create(
        [1] * sum(e for _, e in rows), pool_rows, [p for p, _ in rows], [e for _, e in rows], torch.cat(locs), "cpu"
    )
    fb.req_to_token_pool, fb.token_to_kv_pool = r2t, kv
    return fb


def describe(backend, fb: ForwardBatch) -> list[tuple[str, list[int] | None, int]]:
    """Each group of the step's plan: (kind, its tokens or None for all, shared prefix)."""
    backend.init_forward_metadata(fb)
    return [
        (g.plan.kind.value, None if g.tokens is None else g.tokens.tolist(), g.plan.shared_prefix_len)
        for g in fb.attn_metadata.groups
    ]


def _r(a: int, b: int) -> list[int]:
    return list(range(a, b))


# name: (rows as (prefix, new tokens), shared slots, plan without the C++ op, with it (bf16 /
# fp32 KV), with it but a KV dtype it does not compute (fp16)); None = as without.
PINNED = {
    "decode": ([(30, 1), (50, 1), (7, 1), (90, 1)], 0, [("decode", None, 0)], [("cpp_cascade", None, 0)], None),
    "decode_short_shared_prefix": ([(40, 1)] * 4, 32, [("decode", None, 0)], [("cpp_cascade", None, 0)], None),
    "decode_one_row": ([(30, 1)], 0, [("decode", None, 0)], [("cpp_cascade", None, 0)], None),
    "decode_rows_many_pairs": ([(450, 1)] * 20, 0, [("decode", None, 0)], [("cpp_cascade", None, 0)], None),
    "fresh_prompt": ([(0, 40)], 0, [("prefill", None, 0)], [("cpp_prompt", None, 0)], None),
    "two_prompts": ([(0, 20), (0, 40)], 0, [("extend", None, 0)], [("cpp_prompt", None, 0)], None),
    "long_prompts": ([(0, 300), (0, 33), (0, 170)], 0, [("extend", None, 0)], [("cpp_prompt", None, 0)], None),
    "chunk_after_a_cached_prefix": ([(200, 120)], 0, [("extend", None, 0)], [("cpp_prompt", None, 0)], None),
    "two_short_prompts": ([(0, 5), (0, 9)], 0, [("folded", None, 0)], [("cpp_cascade", None, 0)], None),
    "verify_rows": ([(50, 4), (60, 6)], 0, [("folded", None, 0)], [("cpp_cascade", None, 0)], None),
    "verify_rows_many_pairs": ([(1000, 8)] * 4, 0, [("folded", None, 0)], [("cpp_cascade", None, 0)], None),
    "cached_prefix_extend": ([(40, 30)], 0, [("extend", None, 0)], [("cpp_cascade", None, 0)], None),
    "chunk_and_decode_rows": (
        [(0, 100), (30, 1), (40, 1), (50, 1)], 0, [("decode", _r(100, 103), 0), ("prefill", _r(0, 100), 0)],
        [("cpp_own_keys", _r(100, 103), 0), ("cpp_prompt", _r(0, 100), 0)], None,
    ),
    "chunk_verify_and_decode_rows": (
        [(0, 100), (30, 1), (40, 5), (50, 1)], 0,
        [("decode", [100, 106], 0), ("folded", _r(101, 106), 0), ("prefill", _r(0, 100), 0)],
        [("cpp_own_keys", _r(100, 107), 0), ("cpp_prompt", _r(0, 100), 0)], None,
    ),
    "decode_on_shared_prefix_few_own": (
        [(86, 1)] * 8, 80, [("cascade", None, 80)], [("cpp_cascade", None, 80)], [("cascade", None, 80)],
    ),
    "decode_on_shared_prefix_no_own": (
        [(80, 1)] * 6, 80, [("cascade", None, 80)], [("cpp_cascade", None, 80)], [("cascade", None, 80)],
    ),
    "decode_on_shared_prefix_long_own": (
        [(80 + o, 1) for o in (300, 10, 250, 5)], 80, [("token_cascade", None, 80)], [("cpp_cascade", None, 80)], None,
    ),
    "verify16_on_shared_prefix_long_own": (
        [(80 + o, 16) for o in (140, 130, 120, 150)], 80, [("token_cascade", None, 80)], [("cpp_cascade", None, 80)], None,
    ),
    "decode_and_verify_on_shared_prefix": (
        [(80, 1), (80, 5), (80, 3), (80, 1)], 80, [("token_cascade", None, 80)], [("cpp_cascade", None, 80)], None,
    ),
    "short_rows_of_every_kind_on_shared_prefix": (
        [(80, 1), (80, 4), (80, 9), (80, 24)], 80, [("token_cascade", None, 80)], [("cpp_cascade", None, 80)], None,
    ),
    "short_extends_on_shared_prefix": (
        [(80, 20), (80, 30)], 80, [("token_cascade", None, 80)], [("cpp_cascade", None, 80)], None,
    ),
    "shared_prefix_rows_beside_a_prompt": (
        [(80, 1), (80, 4), (80, 9), (0, 100)], 80,
        [("token_cascade", _r(0, 14), 80), ("prefill", _r(14, 114), 0)],
        [("token_cascade", _r(0, 14), 80), ("cpp_prompt", _r(14, 114), 0)], None,
    ),
    "short_rows_of_every_kind_on_a_short_shared_prefix": (
        [(40, 1), (40, 4), (40, 9)], 40, [("decode", [0], 0), ("folded", _r(1, 14), 0)], [("cpp_cascade", None, 0)],
        None,
    ),
}


# With AMX, bf16 chunks after a cached prefix and prompts of FLASH_ROW_MIN_Q tokens or more
# take the flash kernel, one group per row (with or without the C++ ops); shorter prompts,
# fp32 and the steps without prompts stay as in PINNED.
PINNED_AMX_BF16 = {
    "long_prompts": [("cpp_prompt", _r(300, 333), 0), ("prefill", _r(0, 300), 0), ("prefill", _r(333, 503), 0)],
    "chunk_after_a_cached_prefix": [("extend", None, 0)],
    "chunk_and_decode_rows": [("cpp_own_keys", _r(100, 103), 0), ("prefill", _r(0, 100), 0)],
    "chunk_verify_and_decode_rows": [("cpp_own_keys", _r(100, 107), 0), ("prefill", _r(0, 100), 0)],
    "shared_prefix_rows_beside_a_prompt": [("token_cascade", _r(0, 14), 80), ("prefill", _r(14, 114), 0)],
}


@pytest.mark.parametrize("name", list(PINNED))
def test_plan_choices_are_pinned(name):
    rows, shared, plain, cpp, cpp_fp16 = PINNED[name]
    backend = tnb.TorchNativeAttnBackend(AttentionConfig("cpu", torch.float32, num_heads=4), use_cpu_kernels=False)
    for use_cpp, amx, dtype, want in (
        (False, False, torch.float32, plain),
        (True, False, torch.float32, cpp or plain),
        (True, False, torch.bfloat16, cpp or plain),
        (True, False, torch.float16, cpp_fp16 or plain),
        (True, True, torch.float32, cpp or plain),
        (True, True, torch.bfloat16, PINNED_AMX_BF16.get(name, cpp or plain)),
    ):
        backend.cpu_kernels, backend.amx = use_cpp, amx
        assert describe(backend, make_batch(rows, shared, dtype)) == want, (use_cpp, amx, dtype)


# ---- the cost rule alone ------------------------------------------------------------------


def _choose(ext, prefix, shared=0, cpp=False, asked=None, flash_rows=False, invariant=False):
    def shared_prefix(rows):
        if asked is not None:
            asked.append(rows)
        return min(shared, *(prefix[b] for b in rows))

    return [(c.rows, c.kind, c.shared) for c in choose_plan(ext, prefix, shared_prefix, cpp, flash_rows, invariant)]


def test_batch_invariant_steps_are_one_own_keys_group_whatever_their_rows():
    """With the flag every row of every step, decode, verify or prompt, shared prefix or not,
    goes to the cascade op with no prefix (one exact loop per query); without the C++ ops the
    rule is the default's (determinism.gaps reports it)."""
    for ext, prefix, shared in (([1, 1, 1], [300, 300, 300], 300), ([40], [0], 0), ([1, 4, 200], [80, 80, 0], 80),
                                ([1000], [0], 0), ([2, 2], [500, 500], 500)):
        assert _choose(ext, prefix, shared, cpp=True, invariant=True) == [(list(range(len(ext))), PlanKind.CPP_CASCADE, 0)]
        assert _choose(ext, prefix, shared, cpp=False, invariant=True) == _choose(ext, prefix, shared)


def test_rule_without_a_shared_prefix_splits_decode_verify_and_extend_rows():
    assert _choose([1, 1, 1], [30, 50, 7]) == [([0, 1, 2], PlanKind.DECODE, 0)]
    assert _choose([40], [0]) == [([0], PlanKind.PREFILL, 0)]
    assert _choose([20, 40], [0, 0]) == [([0, 1], PlanKind.EXTEND, 0)]
    assert _choose([30], [40]) == [([0], PlanKind.EXTEND, 0)]  # cached prefix, long extend
    # With the C++ ops, prompts and chunks go to the prompt op; rows of up to CASCADE_MAX_Q
    # tokens to the cascade op on their own keys.
    assert _choose([40], [0], cpp=True) == [([0], PlanKind.CPP_PROMPT, 0)]
    assert _choose([20, 40], [0, 0], cpp=True) == [([0, 1], PlanKind.CPP_PROMPT, 0)]
    assert _choose([33], [400], cpp=True) == [([0], PlanKind.CPP_PROMPT, 0)]
    assert _choose([30], [40], cpp=True) == [([0], PlanKind.CPP_CASCADE, 0)]
    # Rows of a few tokens are folded, fresh prompts or verify rows alike.
    assert _choose([5, 9], [0, 0]) == [([0, 1], PlanKind.FOLDED, 0)]
    assert _choose([4, 6], [50, 60]) == [([0, 1], PlanKind.FOLDED, 0)]
    # A mixed step: decode rows, then verify rows, then the prompt chunk (its group order).
    assert _choose([100, 1, 5, 1], [0, 30, 40, 50]) == [
        ([1, 3], PlanKind.DECODE, 0), ([2], PlanKind.FOLDED, 0), ([0], PlanKind.PREFILL, 0),
    ]


def test_rule_with_flash_rows_gives_each_prompt_its_own_flash_call():
    assert prompt_rows_in_flash(torch.bfloat16, amx=True)
    assert not prompt_rows_in_flash(torch.float32, amx=True) and not prompt_rows_in_flash(torch.bfloat16, amx=False)
    for cpp, short in ((False, PlanKind.EXTEND), (True, PlanKind.CPP_PROMPT)):
        # Long fresh prompts are causal from their first key; a chunk after its cached part
        # keeps a mask; the short prompts stay one group.
        got = _choose([40, 300, 33, 50, FLASH_ROW_MIN_Q], [0, 0, 200, 0, 0], cpp=cpp, flash_rows=True)
        assert got == [
            ([0, 3], short, 0), ([1], PlanKind.PREFILL, 0), ([2], PlanKind.EXTEND, 0), ([4], PlanKind.PREFILL, 0),
        ]
        alone = PlanKind.PREFILL if not cpp else PlanKind.CPP_PROMPT
        assert _choose([40, 300], [0, 0], cpp=cpp, flash_rows=True) == [([0], alone, 0), ([1], PlanKind.PREFILL, 0)]
        # Rows of a few tokens and decode rows beside a prompt: as without flash_rows.
        assert _choose([5, 9], [0, 0], cpp=cpp, flash_rows=True) == _choose([5, 9], [0, 0], cpp=cpp)
    got = _choose([100, 1, 1], [0, 30, 40], cpp=True, flash_rows=True)
    assert got == [([1, 2], PlanKind.CPP_OWN_KEYS, 0), ([0], PlanKind.PREFILL, 0)]
    got = _choose([100, 1, 1], [0, 30, 40], flash_rows=True)
    assert got == [([1, 2], PlanKind.DECODE, 0), ([0], PlanKind.PREFILL, 0)]


def test_rule_looks_up_shared_slots_only_for_groups_that_could_cascade():
    asked = []
    _choose([1], [80], shared=80, asked=asked)  # one row
    _choose([40, 33], [80, 80], shared=80, asked=asked)  # rows longer than CASCADE_MAX_Q
    assert asked == []
    _choose([1, 1], [80, 80], shared=80, asked=asked)
    assert asked == [[0, 1]]


def test_rule_cascades_over_a_long_shared_prefix_only():
    short = _choose([1] * 4, [40] * 4, shared=CASCADE_MIN_PREFIX - 1)
    assert short == [([0, 1, 2, 3], PlanKind.DECODE, 0)]
    # With the C++ op, rows that share too little each attend their own keys there.
    short = _choose([1] * 4, [40] * 4, shared=CASCADE_MIN_PREFIX - 1, cpp=True)
    assert short == [([0, 1, 2, 3], PlanKind.CPP_CASCADE, 0)]
    # Equal decode rows: padding costs nothing, so the padded cascade (or the C++ op).
    assert _choose([1] * 6, [80] * 6, shared=80) == [(list(range(6)), PlanKind.CASCADE, 80)]
    assert _choose([1] * 6, [80] * 6, shared=80, cpp=True) == [(list(range(6)), PlanKind.CPP_CASCADE, 80)]
    # Suffixes of very different lengths: one masked sequence beats padding each row.
    ext, prefix = [1] * 4, [380, 90, 330, 85]
    assert _choose(ext, prefix, shared=80) == [(list(range(4)), PlanKind.TOKEN_CASCADE, 80)]


def test_rule_uses_the_cpp_op_only_for_a_steps_only_group():
    ext, prefix = [1, 5, 3, 1], [80] * 4  # decode and verify rows: one cascade group
    assert _choose(ext, prefix, shared=80, cpp=True) == [([0, 1, 2, 3], PlanKind.CPP_CASCADE, 80)]
    assert _choose(ext, prefix, shared=80, cpp=False) == [([0, 1, 2, 3], PlanKind.TOKEN_CASCADE, 80)]
    # Beside a fresh prompt the cascade group is one of two: the Python token cascade.
    got = _choose([1, 4, 9, 100], [80, 80, 80, 0], shared=80, cpp=True)
    assert got == [([0, 1, 2], PlanKind.TOKEN_CASCADE, 80), ([3], PlanKind.CPP_PROMPT, 0)]


def test_rule_mixed_short_rows_without_a_worthwhile_prefix_go_by_kind():
    got = _choose([1, 4, 9], [40] * 3, shared=40)
    assert got == [([0], PlanKind.DECODE, 0), ([1, 2], PlanKind.FOLDED, 0)]
    # With the C++ op they are one group there, each row on its own keys...
    assert _choose([1, 4, 9], [40] * 3, shared=40, cpp=True) == [([0, 1, 2], PlanKind.CPP_CASCADE, 0)]
    # ...however many their pairs; beside a prompt, the short rows are one group of their own.
    assert _choose([1, 16, 16], [40, 900, 900], shared=40, cpp=True) == [([0, 1, 2], PlanKind.CPP_CASCADE, 0)]
    got = _choose([1, 100], [40, 0], cpp=True)
    assert got == [([0], PlanKind.CPP_OWN_KEYS, 0), ([1], PlanKind.CPP_PROMPT, 0)]


def test_rule_cpp_token_cascade_whatever_its_suffixes():
    """Two rows of 4 tokens over a 100-slot shared prefix, one with many more own tokens:
    the C++ op attends each row's own keys, so it takes the token cascade at any suffix
    length, also for rows of several kinds (cascade_only); torch's path decides by its ratio."""
    for x in (10, 2000, 20000):
        assert choose_group([4, 4], [100 + x, 100], 100, cpp=True) == (PlanKind.CPP_CASCADE, 100)
        assert choose_group([4, 4], [100 + x, 100], 100, cpp=True, cascade_only=True) == (PlanKind.CPP_CASCADE, 100)
    assert choose_group([4, 4], [2100, 100], 100, cpp=False) == (PlanKind.TOKEN_CASCADE, 100)


def test_rule_cascade_only_declines_when_padding_wastes_more_than_it_saves():
    # Seven decode rows and a verify row of 2, each with 300 own tokens after an 80-slot
    # shared prefix: one masked suffix sequence has more than 4x the padded pairs, and
    # padding the decode rows to 2 queries costs more than the shared prefix saves.
    ext, prefix = [1] * 7 + [2], [380] * 8
    assert choose_group(ext, prefix, 80, cpp=False, cascade_only=True) is None
    # So the rows go by kind: the decode rows still cascade among themselves.
    assert _choose(ext, prefix, shared=80) == [(list(range(7)), PlanKind.CASCADE, 80), ([7], PlanKind.FOLDED, 0)]
    # Short suffixes: the cascade group of both kinds, as one masked suffix sequence.
    assert choose_group([1, 24], [80, 80], 80, cpp=False, cascade_only=True) == (PlanKind.TOKEN_CASCADE, 80)


# ---- each plan against plain attention ----------------------------------------------------

LAYER = SimpleNamespace(num_heads=4, num_kv_heads=HKV, head_dim=HEAD_DIM, scaling=0.25, layer_id=0)


def _reference(fb: ForwardBatch, q: torch.Tensor) -> torch.Tensor:
    """Per request SDPA over its KV from the pool, causal in absolute positions."""
    pool, r2t = fb.token_to_kv_pool, fb.req_to_token_pool.req_to_token
    H, D = LAYER.num_heads, LAYER.head_dim
    out, t = [], 0
    for row, p, e in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
        slots = r2t[row, : p + e].long()
        k, v = pool.k_buffer[0][slots].transpose(0, 1), pool.v_buffer[0][slots].transpose(0, 1)  # [Hkv, L, D]
        mask = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]  # [e, L]
        qb = q[t : t + e].view(e, H, D).transpose(0, 1)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=LAYER.scaling, enable_gqa=True)
        out.append(o.transpose(0, 1).reshape(e, H * D))
        t += e
    return torch.cat(out)


@pytest.mark.parametrize("cpp,amx", [(False, False), (True, False), (False, True), (True, True)])
def test_every_plan_attends_as_plain_attention(cpp, amx):
    """Every pinned step through the backend and each of its plans alone, against plain
    attention: fp32, or bf16 where AMX changes the prompts' plans."""
    if cpp and not cpu_kernels.load():
        pytest.skip("C++ CPU ops not built")
    backend = tnb.TorchNativeAttnBackend(AttentionConfig("cpu", torch.float32, num_heads=LAYER.num_heads), use_cpu_kernels=False)
    backend.cpu_kernels, backend.amx = cpp, amx
    dtype, tol = (torch.bfloat16, 3e-2) if amx else (torch.float32, 1e-5)
    g = torch.Generator().manual_seed(0)
    kinds = set()
    for name, (rows, shared, *_) in PINNED.items():
        fb = make_batch(rows, shared, dtype)
        pool = fb.token_to_kv_pool
        for buf in (pool.k_buffer[0], pool.v_buffer[0]):
            buf[1:].copy_(torch.randn(buf[1:].shape, generator=g))
        T, H, D = fb.num_tokens, LAYER.num_heads, LAYER.head_dim
        pad = 3  # rows past T pad the token axis: no KV, zero output
        q = torch.randn(T + pad, H * D, generator=g).to(dtype)
        k, v = (torch.randn(T + pad, HKV * D, generator=g).to(dtype) for _ in range(2))
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, LAYER, fb)  # stores k, v at the step's slots
        want = _reference(fb, q[:T])
        assert (out[:T] - want).abs().max().item() < tol, name
        assert not out[T:].any(), name
        k_buf, v_buf = pool.k_buffer[0], pool.v_buffer[0]
        for group in fb.attn_metadata.groups:
            kinds.add(group.plan.kind)
            if group.plan.kind is PlanKind.CPP_CASCADE:
                continue  # runs a whole step (above)
            tokens = torch.arange(T) if group.tokens is None else group.tokens
            got = group.plan.attend(q.index_select(0, tokens), k_buf, v_buf, LAYER)  # out=None: a new tensor
            assert (got - want[tokens]).abs().max().item() < tol, (name, group.plan.kind)
    plain = {PlanKind.DECODE, PlanKind.PREFILL, PlanKind.EXTEND, PlanKind.FOLDED, PlanKind.CASCADE, PlanKind.TOKEN_CASCADE}
    # With the C++ ops every decode and few-token group runs in the cascade op (alone or
    # beside a prompt chunk), and every prompt group in the prompt op.
    in_cpp = {PlanKind.DECODE, PlanKind.FOLDED, PlanKind.CASCADE, PlanKind.PREFILL, PlanKind.EXTEND}
    cpp_kinds = {PlanKind.CPP_CASCADE, PlanKind.CPP_OWN_KEYS, PlanKind.CPP_PROMPT}
    if amx:  # long bf16 prompts and chunks in the flash kernel instead of the prompt op
        in_cpp = in_cpp - {PlanKind.PREFILL, PlanKind.EXTEND}
    assert kinds == (plain - in_cpp | cpp_kinds if cpp else plain)
