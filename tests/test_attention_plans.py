"""The torch_native backend's attention plans: which plan each step gets (pinned on
representative shapes, so a refactor keeps today's cost rule) and what each plan computes
(against plain per-request attention)."""

from __future__ import annotations

import pytest
import torch

from srt_lite.layers.attention import torch_native_backend as tnb
from srt_lite.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from srt_lite.model_executor.forward_batch import ForwardBatch

HKV, HEAD_DIM = 2, 16


def make_batch(rows: list[tuple[int, int]], shared: int, dtype: torch.dtype = torch.float32) -> ForwardBatch:
    """A step of rows (prefix length, new tokens) whose first `shared` KV slots (at most
    their prefix) are the same slots, as a radix-cache hit lays them out; the rest are each
    row's own."""
    r2t = ReqToTokenPool(len(rows) + 1, 512, "cpu")
    kv = TokenToKVPool(4096, 1, HKV, HEAD_DIM, dtype, "cpu")
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
    "decode": ([(30, 1), (50, 1), (7, 1), (90, 1)], 0, [("decode", None, 0)], None, None),
    "decode_short_shared_prefix": ([(40, 1)] * 4, 32, [("decode", None, 0)], None, None),
    "decode_one_row": ([(30, 1)], 0, [("decode", None, 0)], None, None),
    "fresh_prompt": ([(0, 40)], 0, [("prefill", None, 0)], None, None),
    "two_prompts": ([(0, 20), (0, 40)], 0, [("extend", None, 0)], None, None),
    "two_short_prompts": ([(0, 5), (0, 9)], 0, [("folded", None, 0)], None, None),
    "verify_rows": ([(50, 4), (60, 6)], 0, [("folded", None, 0)], None, None),
    "cached_prefix_extend": ([(40, 30)], 0, [("extend", None, 0)], None, None),
    "chunk_and_decode_rows": (
        [(0, 100), (30, 1), (40, 1), (50, 1)], 0, [("decode", _r(100, 103), 0), ("prefill", _r(0, 100), 0)], None, None,
    ),
    "chunk_verify_and_decode_rows": (
        [(0, 100), (30, 1), (40, 5), (50, 1)], 0,
        [("decode", [100, 106], 0), ("folded", _r(101, 106), 0), ("prefill", _r(0, 100), 0)], None, None,
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
        [(80 + o, 16) for o in (140, 130, 120, 150)], 80, [("token_cascade", None, 80)], [("cascade", None, 80)], None,
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
        [("token_cascade", _r(0, 14), 80), ("prefill", _r(14, 114), 0)], None, None,
    ),
    "short_rows_of_every_kind_on_a_short_shared_prefix": (
        [(40, 1), (40, 4), (40, 9)], 40, [("decode", [0], 0), ("folded", _r(1, 14), 0)], None, None,
    ),
}


@pytest.mark.parametrize("name", list(PINNED))
def test_plan_choices_are_pinned(name):
    rows, shared, plain, cpp, cpp_fp16 = PINNED[name]
    backend = tnb.TorchNativeAttnBackend("cpu", num_heads=4, use_cpu_kernels=False)
    for use_cpp, dtype, want in (
        (False, torch.float32, plain),
        (True, torch.float32, cpp or plain),
        (True, torch.bfloat16, cpp or plain),
        (True, torch.float16, cpp_fp16 or plain),
    ):
        backend.cpu_kernels = use_cpp
        assert describe(backend, make_batch(rows, shared, dtype)) == want, (use_cpp, dtype)
