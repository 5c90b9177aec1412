"""The C++ attention ops against masked softmax attention: the cascade op, the own-keys op,
the prefix kernels and the prompt op, each giving a row the same bits alone or in a batch,
and rejecting bad slots or offsets. Built for this CPU's level (cpu_caps)."""

from __future__ import annotations

import pytest
import torch

from srt_lite import cpu_caps
from srt_lite import cpu_kernels
from srt_lite.layers.cpu_linear.paths import amx_panels_built


pytestmark = pytest.mark.cpu_caps


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.load()  # CI's machine has the C++ compiler inductor's wrapper uses


def _masked_reference(q, k_buf, v_buf, rows, prefix, num_heads, scale):
    """Each row's queries over the prefix and its own keys up to their positions, by SDPA."""
    Hkv, D = k_buf.shape[1], k_buf.shape[2]
    G, out, t0 = num_heads // Hkv, [], 0
    for nq, slots in rows:
        keys = prefix + slots
        K = k_buf[keys].float().transpose(0, 1).repeat_interleave(G, 0)  # [H, L, D]
        V = v_buf[keys].float().transpose(0, 1).repeat_interleave(G, 0)
        Q = q[t0:t0 + nq].float().view(nq, num_heads, D).transpose(0, 1)  # [H, nq, D]
        mask = torch.ones(nq, len(keys), dtype=torch.bool).tril(len(keys) - nq)
        o = torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=scale)
        out.append(o.transpose(0, 1).reshape(nq, num_heads * D))
        t0 += nq
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 64), (14, 2, 64), (4, 4, 128), (8, 2, 80), (2, 1, 256)])
@pytest.mark.parametrize("prefix_len", [0, 37, 700])
def test_cascade_op_matches_masked_attention(dtype, heads, kv_heads, head_dim, prefix_len):
    """The op against SDPA over scattered slots: query groups of 1-4 heads per pass (GQA
    groups of 1, 3, 4, 7), head sizes that are and are not a multiple of the value chunk,
    decode rows and rows of several queries, with and without a shared prefix."""
    g = torch.Generator().manual_seed(heads * head_dim + prefix_len)
    lens, nqs = [1, 5, 300, 17], [1, 3, 1, 9]
    k_buf = torch.randn(1024, kv_heads, head_dim, generator=g).to(dtype)
    v_buf = torch.randn(1024, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(1024, generator=g).tolist()
    prefix, pos, rows = perm[:prefix_len], prefix_len, []
    for n, nq in zip(lens, nqs):
        rows.append((nq, perm[pos:pos + n]))
        pos += n
    q = torch.randn(sum(nqs), heads * head_dim, generator=g).to(dtype)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    out = torch.zeros(sum(nqs), heads * head_dim, dtype=dtype)
    no_rows = torch.empty(0, kv_heads * head_dim, dtype=dtype)  # the KV is already stored
    scale = head_dim ** -0.5
    torch.ops.srt_lite_cpu.cascade_attention(
        q, no_rows, no_rows, k_buf, v_buf, t([s for nq, sl in rows for s in sl[-nq:]]), t([s for _, sl in rows for s in sl]),
        t([0, *torch.tensor(nqs).cumsum(0).tolist()]), t([0, *torch.tensor(lens).cumsum(0).tolist()]),
        -1 if prefix_len else 0, prefix_len, t(prefix), heads, scale, out,
    )
    ref = _masked_reference(q, k_buf, v_buf, rows, prefix, heads, scale)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), err


def _own_keys_op(q, k_buf, v_buf, rows, heads, scale):
    """The cascade op with no shared prefix (batch-invariant inference's attention) over rows
    of (queries, key slots); the KV is already stored."""
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    nqs, nks = [nq for nq, _ in rows], [len(sl) for _, sl in rows]
    out = torch.zeros(sum(nqs), heads * k_buf.shape[2], dtype=q.dtype)
    no_rows = torch.empty(0, k_buf.shape[1] * k_buf.shape[2], dtype=q.dtype)
    torch.ops.srt_lite_cpu.cascade_attention(
        q, no_rows, no_rows, k_buf, v_buf, t([s for nq, sl in rows for s in sl[-nq:]]), t([s for _, sl in rows for s in sl]),
        t([0, *torch.tensor(nqs).cumsum(0).tolist()]), t([0, *torch.tensor(nks).cumsum(0).tolist()]), 0, 0, t([]),
        heads, scale, out,
    )
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_own_keys_op_gives_a_position_the_same_bits_as_prompt_chunk_or_decode_row(dtype):
    """Prompts of more queries than one task takes are split into blocks between the threads;
    a query's output is still its own: the same position computed in a whole prompt, in a
    chunk after the prompt's first part, or as a decode row beside other rows gives the same
    bits, and matches SDPA."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, D = 9, 3, 64
    k_buf, v_buf, rows = _prompt_rows(g, [(150, 150), (3, 40)], kv_heads, D, dtype)
    prompt = rows[0][1]
    q = torch.randn(150, heads * D, generator=g).to(dtype)
    scale = D ** -0.5
    whole = _own_keys_op(q, k_buf, v_buf, rows[:1], heads, scale)
    ref = _masked_reference(q, k_buf, v_buf, rows[:1], [], heads, scale)
    assert ((whole.float() - ref).abs().max() / ref.abs().max()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    # Queries 100..149 as a chunk after 100 cached keys, beside another row's verify tokens.
    q_other = torch.randn(3, heads * D, generator=g).to(dtype)
    chunk = _own_keys_op(torch.cat([q_other, q[100:]]), k_buf, v_buf, [rows[1], (50, prompt)], heads, scale)
    assert torch.equal(chunk[3:], whole[100:])
    # Positions 0, 31, 32, 149 as decode rows of one step.
    picks = [0, 31, 32, 149]
    decode = _own_keys_op(q[picks], k_buf, v_buf, [(1, prompt[:p + 1]) for p in picks], heads, scale)
    assert torch.equal(decode, whole[picks])


@pytest.mark.parametrize(
    "loc,suffix,q_off,k_off,error",
    [
        ([3, 16], [3, 4], [0, 1, 2], [0, 1, 2], "out of range"),  # 16 is past the end
        ([3, 4], [3, 99], [0, 1, 2], [0, 1, 2], "out of range"),
        ([3, 4], [3, 4], [0, 2, 2], [0, 1, 2], "queries over"),  # a row with more queries than keys
        ([3, 4], [3, 4], [0, 1, 2], [0, 1, 3], "span"),  # offsets past the suffix keys
    ],
)
def test_bad_slots_or_offsets_raise_and_write_nothing(loc, suffix, q_off, k_off, error):
    Hkv, D, H = 2, 16, 4
    k_buf, v_buf = torch.zeros(16, Hkv, D), torch.zeros(16, Hkv, D)
    q, k, v = torch.randn(2, H * D), torch.randn(2, Hkv * D), torch.randn(2, Hkv * D)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    with pytest.raises(RuntimeError, match=error):
        torch.ops.srt_lite_cpu.cascade_attention(
            q, k, v, k_buf, v_buf, t(loc), t(suffix), t(q_off), t(k_off), 0, 2, t([0, 1]), H, 0.3,
            torch.empty(2, H * D),
        )
    assert not k_buf.any() and not v_buf.any()


def _prefix_reference(q, T, G, k_buf, v_buf, slots, scale):
    """Every query over the prefix slots in float64: (o [Hkv, T * G, D], lse [Hkv, T * G])."""
    Hkv, D = k_buf.shape[1], k_buf.shape[2]
    K, V = k_buf[slots].double().transpose(0, 1), v_buf[slots].double().transpose(0, 1)  # [Hkv, L, D]
    Q = q[:T].double().view(T, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, T * G, D)
    s = Q @ K.transpose(1, 2) * scale
    return torch.softmax(s, -1) @ V, torch.logsumexp(s, -1)


AMX = pytest.mark.skipif(not amx_panels_built(), reason="the AMX tiles need AMX-BF16")

# The shared-prefix kernel's two ways: AMX tiles, AVX512-BF16 vectors.
PREFIX_KERNELS = [
    pytest.param(True, id="tiles", marks=AMX),
    pytest.param(False, id="vectors", marks=pytest.mark.skipif(
        not cpu_kernels.bf16_dots_available(), reason="bf16 dot products need AVX512-BF16, uncapped")),
]


@pytest.mark.parametrize("tiles", PREFIX_KERNELS)
@pytest.mark.parametrize("kv_heads,group,head_dim", [(3, 3, 64), (8, 4, 64), (2, 7, 128), (1, 2, 256), (4, 1, 32)])
@pytest.mark.parametrize("prefix_len", [1, 100, 1100])
@pytest.mark.parametrize("contiguous", [True, False])
def test_prefix_attention_matches_softmax_and_ignores_the_batch(tiles, kv_heads, group, head_dim, prefix_len,
                                                                contiguous):
    """The shared-prefix kernel against float64 attention: one key, a ragged key block,
    several key chunks; slots in a run or scattered; 1 to 77 queries per KV head (one tile,
    two, a ragged third; rows of 8 and 4 in vectors). Each query's result is the same alone
    as in a batch."""
    g = torch.Generator().manual_seed(kv_heads * head_dim + prefix_len + contiguous)
    k_buf = torch.randn(2048, kv_heads, head_dim, generator=g).bfloat16()
    v_buf = torch.randn(2048, kv_heads, head_dim, generator=g).bfloat16()
    q = torch.randn(12, kv_heads * group * head_dim, generator=g).bfloat16()
    index = torch.randperm(2048, generator=g)[:prefix_len]
    start = 300 if contiguous else -1
    slots = torch.arange(start, start + prefix_len) if contiguous else index
    scale = head_dim ** -0.5
    op = torch.ops.srt_lite_cpu.prefix_attention
    outs = {}
    for T in (1, 11):
        o, lse = op(q, T, group, k_buf, v_buf, start, prefix_len, index, scale, tiles)
        assert o.dtype == lse.dtype == torch.float32 and o.shape == (1, kv_heads, T * group, head_dim)
        ro, rl = _prefix_reference(q, T, group, k_buf, v_buf, slots, scale)
        err = ((o[0].double() - ro).abs().max() / ro.abs().max()).item()
        assert err < 1e-2, err  # the probabilities are bf16 in P . V
        assert (lse[0].double() - rl).abs().max().item() < 1e-4
        outs[T] = o[0], lse[0]
    assert torch.equal(outs[1][0], outs[11][0][:, :group]) and torch.equal(outs[1][1], outs[11][1][:, :group])


@pytest.mark.parametrize("tiles", PREFIX_KERNELS)
def test_prefix_attention_rejects_what_it_cannot_take(tiles):
    k_buf = torch.randn(64, 2, 64).bfloat16()
    q = torch.randn(2, 4 * 64).bfloat16()
    op = torch.ops.srt_lite_cpu.prefix_attention
    none = torch.empty(0, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="bf16, head_dim"):
        op(q.float(), 2, 2, k_buf.float(), k_buf.float(), 0, 10, none, 0.1, tiles)
    with pytest.raises(RuntimeError, match="bf16, head_dim"):  # head_dim 48 is not whole tiles
        op(torch.randn(2, 4 * 48).bfloat16(), 2, 2, torch.randn(64, 2, 48).bfloat16(), torch.randn(64, 2, 48).bfloat16(),
           0, 10, none, 0.1, tiles)
    with pytest.raises(RuntimeError, match="past the buffer"):
        op(q, 2, 2, k_buf, k_buf, 60, 10, none, 0.1, tiles)
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, 2, 2, k_buf, k_buf, -1, 2, torch.tensor([3, 64]), 0.1, tiles)
    with pytest.raises(RuntimeError, match="prefix_index must be"):
        op(q, 2, 2, k_buf, k_buf, -1, 3, torch.tensor([3, 4]), 0.1, tiles)


@pytest.mark.parametrize("tiles", PREFIX_KERNELS)
def test_prefix_kernels_follow_the_allowed_caps(tiles):
    """A kernel SRT_LITE_CPU_CAPS takes away (allow_prefix_kernels, set at load) is refused,
    and the cascade op then attends its prefix with flash attention, to the same result."""
    Hkv, G, D, Lp = 2, 3, 64, 300
    g = torch.Generator().manual_seed(5)
    k_buf = torch.randn(512, Hkv, D, generator=g).bfloat16()
    v_buf = torch.randn(512, Hkv, D, generator=g).bfloat16()
    q = torch.randn(4, Hkv * G * D, generator=g).bfloat16()
    none = torch.empty(0, dtype=torch.int64)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    empty = torch.empty(0, Hkv * D).bfloat16()  # KV stored already

    def cascade():
        out = torch.empty(4, Hkv * G * D).bfloat16()
        torch.ops.srt_lite_cpu.cascade_attention(
            q, empty, empty, k_buf, v_buf, t([400, 401, 402, 403]), t([400, 401, 402, 403]), t([0, 1, 2, 3, 4]),
            t([0, 1, 2, 3, 4]), 0, Lp, none, Hkv * G, D ** -0.5, out)
        return out

    ours = cascade()
    caps = cpu_caps.get()
    try:
        torch.ops.srt_lite_cpu.allow_prefix_kernels(False, False)
        with pytest.raises(RuntimeError, match="allowed by SRT_LITE_CPU_CAPS"):
            torch.ops.srt_lite_cpu.prefix_attention(q, 4, G, k_buf, v_buf, 0, Lp, none, 0.1, tiles)
        flash = cascade()
    finally:
        torch.ops.srt_lite_cpu.allow_prefix_kernels(caps.amx_bf16, caps.avx512_bf16)
    assert not torch.equal(ours, flash)  # another kernel ran
    torch.testing.assert_close(ours.float(), flash.float(), rtol=2e-2, atol=2e-2)


# The three ways the prompt op computes: fp32, bf16 widened to fp32, bf16 dot products.
PROMPT_MODES = [
    (torch.float32, False),
    (torch.bfloat16, False),
    pytest.param(torch.bfloat16, True, marks=pytest.mark.skipif(
        not cpu_kernels.bf16_dots_available(), reason="bf16 dot products need AVX512-BF16, uncapped")),
]


def _prompt_rows(g, lens, kv_heads, head_dim, dtype, slots=1024):
    """Rows (new tokens, their key slots) of the given (queries, keys) over a scattered pool."""
    k_buf = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
    v_buf = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
    perm, pos, rows = torch.randperm(slots, generator=g).tolist(), 0, []
    for nq, nk in lens:
        rows.append((nq, perm[pos:pos + nk]))
        pos += nk
    return k_buf, v_buf, rows


def _prompt_op(q, k_buf, v_buf, rows, heads, scale, dots, out=None):
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    nqs, nks = [nq for nq, _ in rows], [len(sl) for _, sl in rows]
    out = torch.zeros(sum(nqs), heads * k_buf.shape[2], dtype=q.dtype) if out is None else out
    torch.ops.srt_lite_cpu.prompt_attention(
        q, k_buf, v_buf, t([s for _, sl in rows for s in sl]), t([0, *torch.tensor(nqs).cumsum(0).tolist()]),
        t([0, *torch.tensor(nks).cumsum(0).tolist()]), heads, scale, dots, out,
    )
    return out


@pytest.mark.parametrize("dtype,dots", PROMPT_MODES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 64), (4, 4, 128), (8, 2, 80), (4, 2, 16), (2, 1, 256)])
def test_prompt_op_matches_masked_attention(dtype, dots, heads, kv_heads, head_dim):
    """The prompt op against SDPA over scattered slots: fresh prompts (queries = keys) of odd
    and even lengths, chunks after a cached prefix, a one-token row; GQA groups of 1-4 and
    head sizes that are and are not a multiple of the kernels' four vectors. bf16 computes
    in fp32 from bf16 inputs (dots=False) or in bf16 dot products (dots=True)."""
    g = torch.Generator().manual_seed(heads * head_dim)
    k_buf, v_buf, rows = _prompt_rows(g, [(37, 37), (5, 70), (1, 1), (130, 200), (64, 64)], kv_heads, head_dim, dtype)
    q = torch.randn(sum(nq for nq, _ in rows) + 2, heads * head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full((q.shape[0], heads * head_dim), 7.0, dtype=dtype)  # two rows past T pad the token axis
    _prompt_op(q, k_buf, v_buf, rows, heads, scale, dots, out)
    T = q.shape[0] - 2
    ref = _masked_reference(q[:T], k_buf, v_buf, rows, [], heads, scale)
    err = ((out[:T].float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), err
    assert (out[T:] == 7).all()  # rows past the queries are left as they are


@pytest.mark.parametrize("dtype,dots", PROMPT_MODES)
def test_prompt_op_gives_a_row_the_same_result_alone_or_in_a_batch(dtype, dots):
    """A row's tiles depend only on the row: its output is the same bit for bit whatever
    else the step holds, so batching prompts cannot change a greedy answer."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, D = 9, 3, 64
    k_buf, v_buf, rows = _prompt_rows(g, [(90, 90), (40, 300), (7, 7), (33, 33)], kv_heads, D, dtype)
    q = torch.randn(sum(nq for nq, _ in rows), heads * D, generator=g).to(dtype)
    together = _prompt_op(q, k_buf, v_buf, rows, heads, 0.125, dots)
    t0 = 0
    for nq, sl in rows:
        alone = _prompt_op(q[t0:t0 + nq], k_buf, v_buf, [(nq, sl)], heads, 0.125, dots)
        assert torch.equal(alone, together[t0:t0 + nq])
        t0 += nq


@pytest.mark.parametrize(
    "slots,q_off,k_off,error",
    [
        ([3, 16], [0, 1, 2], [0, 1, 2], "out of range"),  # 16 is past the pool's end
        ([3, 4], [0, 2, 2], [0, 1, 2], "queries over"),  # a row with more queries than keys
        ([3, 4], [0, 1, 2], [0, 1, 3], "span"),  # offsets past the slots
        ([3, 4, 5, 6], [0, 1, 4], [0, 1, 4], "q and out"),  # more queries than q holds
    ],
)
def test_prompt_op_rejects_bad_slots_or_offsets(slots, q_off, k_off, error):
    Hkv, D, H = 2, 16, 4
    k_buf, v_buf = torch.zeros(16, Hkv, D), torch.zeros(16, Hkv, D)
    out = torch.zeros(2, H * D)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    with pytest.raises(RuntimeError, match=error):
        torch.ops.srt_lite_cpu.prompt_attention(torch.randn(2, H * D), k_buf, v_buf, t(slots), t(q_off), t(k_off), H, 0.3, False, out)
    assert not out.any()
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        torch.ops.srt_lite_cpu.prompt_attention(
            torch.randn(2, H * D).half(), k_buf, v_buf, t([3, 4]), t([0, 1, 2]), t([0, 1, 2]), H, 0.3, False, out)
    if not cpu_kernels.bf16_dots_available() and not torch.ops.srt_lite_cpu.bf16_gemv_supported():
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            bf = k_buf.bfloat16()
            torch.ops.srt_lite_cpu.prompt_attention(
                torch.randn(2, H * D).bfloat16(), bf, bf, t([3, 4]), t([0, 1, 2]), t([0, 1, 2]), H, 0.3, True,
                out.bfloat16())
