"""The C++ CPU ops (srt_lite/csrc/*.cpp): the token cascade and the prompt attention match
the torch ops' logits,
the compiled graph's packed linear gives their result bit for bit, the bf16-weight and
panel linears match the fp32 product (the fp32 panels batch-invariant), and bad input raises. Built for this CPU's level (cpu_caps);
`make test` runs this module again with the level capped at AVX2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from model_harness import Harness, fragment_free_list
from srt_lite import cpu_caps
from srt_lite import cpu_kernels
from srt_lite.layers.attention.torch_native.choose import PlanKind, cpp_cascade_ok
from srt_lite.layers.attention.torch_native.steps import CppCascadePlan
from srt_lite.layers.cpu_linear.paths import PATH_PACKED, amx_panels_built, bf16_gemv_available, panels_built
from srt_lite.layers.cpu_linear.packable import PackableLinear
from srt_lite.layers.cpu_linear.products import pack_panels, packed_linear, panel_linear
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.server_args import ServerArgs
from tiny_models import make_tiny_model


pytestmark = pytest.mark.cpu_caps

# oneDNN packs bf16 weights only where it computes bf16 (AVX-512, AVX-NE-CONVERT, ARM BF16);
# fp32 weights it packs everywhere, so the packed-op tests use those on other CPUs.
PACK_DTYPE = torch.bfloat16 if cpu_caps.get().onednn_bf16 else torch.float32


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.load()  # CI's machine has the C++ compiler inductor's wrapper uses


@pytest.mark.parametrize("consecutive,dtype", [(True, "bfloat16"), (False, "bfloat16"), (True, "float32")])
def test_token_cascade_op_matches_the_torch_ops_logits(tmp_path, consecutive, dtype):
    """Packed model (token axis padded to the row bucket): rows of 1, 4, 9 and 24 new tokens
    over a shared 80-token prefix, then decode steps, once through the C++ op and once through
    torch ops; the prefix is a view of the pool or gathered (scattered slots). The C++ op
    attends the suffixes in fp32 without a mask and rounds once, so bf16 agrees to bf16's
    rounding of the attention output and fp32 to float rounding."""
    path = make_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype=dtype, max_total_tokens=4096))
    backend = runner.attn_backend
    assert backend.cpu_kernels and runner.pad_rows == (runner.linear_path == PATH_PACKED)
    if not consecutive:
        fragment_free_list(runner, 1)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 320, (80,), generator=g).tolist()
    suffixes = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (1, 4, 9, 24)]
    h = Harness(runner)
    h.prefill([prefix])

    def run(cpp: bool) -> list[torch.Tensor]:
        backend.cpu_kernels = cpp
        rows = h.rows_sharing_prefix(len(suffixes), 80)
        hr = Harness(runner)
        out = [hr.extend(rows, [80] * 4, suffixes, all_logits=False).next_token_logits]
        hr.rows, hr.lens = rows, [80 + len(s) for s in suffixes]
        for _ in range(3):
            out.append(hr.decode(out[-1].argmax(-1).tolist()))
        return out

    torch_ops, cpp = run(False), run(True)
    for a, b in zip(torch_ops, cpp):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert err < (1e-2 if dtype == "bfloat16" else 1e-5), err
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rows_that_share_nothing_attend_their_own_keys_in_the_cpp_op(tmp_path, dtype):
    """Prompts of different lengths with no common prefix, then decode steps and a verify
    step: with the C++ op each step is one CPP_CASCADE without a prefix part, and its logits
    agree with the torch ops' (padded decode and folded plans)."""
    path = make_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype=dtype, max_total_tokens=4096))
    backend = runner.attn_backend
    seen = []
    original = backend.init_forward_metadata
    backend.init_forward_metadata = lambda fb: original(fb) or seen.append(fb.attn_metadata)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (30, 50, 7, 90)]
    drafts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (3, 5, 1, 2)]

    def run(cpp: bool) -> list[torch.Tensor]:
        backend.cpu_kernels = cpp
        h = Harness(runner)
        out = [h.prefill(prompts).next_token_logits]
        seen.clear()
        for _ in range(3):
            out.append(h.decode(out[-1].argmax(-1).tolist()))
        out.append(h.extend(h.rows, list(h.lens), drafts, all_logits=True).all_logits)
        kinds = {(grp.plan.kind, grp.plan.shared_prefix_len) for step in seen for grp in step.groups}
        assert kinds == ({(PlanKind.CPP_CASCADE, 0)} if cpp else {(PlanKind.DECODE, 0), (PlanKind.FOLDED, 0)})
        return out

    torch_ops, cpp = run(False), run(True)
    for a, b in zip(torch_ops, cpp):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert err < (1e-2 if dtype == "bfloat16" else 1e-5), err
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_packed_linear_op_equals_the_python_product():
    torch.manual_seed(0)
    layer = PackableLinear()
    layer.weight = torch.nn.Parameter(torch.randn(96, 64, dtype=PACK_DTYPE), requires_grad=False)
    layer.pack_for_cpu()
    bias = torch.randn(96, dtype=PACK_DTYPE)
    for n in (1, 5, 16, 48):
        x = torch.randn(n, 64, dtype=PACK_DTYPE)
        for b in (None, bias):
            got = torch.ops.srt_lite_cpu.packed_linear(x, b, layer.cpp_key)
            assert got.shape == (n, 96)
            assert torch.equal(got, packed_linear(x, layer.packed_weight, b))


def test_a_freed_weight_or_unknown_key_raises_instead_of_crashing():
    layer = PackableLinear()
    layer.weight = torch.nn.Parameter(torch.randn(8, 8, dtype=PACK_DTYPE), requires_grad=False)
    layer.pack_for_cpu()
    key = layer.cpp_key
    x = torch.randn(2, 8, dtype=PACK_DTYPE)
    del layer  # the op holds the packed weight weakly
    with pytest.raises(RuntimeError, match="freed"):
        torch.ops.srt_lite_cpu.packed_linear(x, None, key)
    with pytest.raises(RuntimeError, match="no packed weight"):
        torch.ops.srt_lite_cpu.packed_linear(x, None, 10**6)


def test_cascade_step_is_set_once_per_forward_and_belongs_to_its_thread():
    """The compiled graph's attention op finds its step where set_cascade_step left it. A step
    set over one not cleared is refused (it would attend the wrong rows), and another
    thread's forward does not see it."""
    import threading

    ids = torch.zeros(1, dtype=torch.int64)
    offsets = torch.tensor([0, 1], dtype=torch.int64)
    step = (ids, ids, offsets, offsets, 0, 0, ids, 1, 1.0, [], [])
    torch.ops.srt_lite_cpu.set_cascade_step(*step)
    try:
        with pytest.raises(RuntimeError, match="not cleared"):
            torch.ops.srt_lite_cpu.set_cascade_step(*step)
        elsewhere = []  # another thread sets its own step while this one is set

        def other_forward():
            torch.ops.srt_lite_cpu.set_cascade_step(*step)
            torch.ops.srt_lite_cpu.clear_cascade_step()
            elsewhere.append(True)

        thread = threading.Thread(target=other_forward)
        thread.start()
        thread.join()
        assert elsewhere == [True]
    finally:
        torch.ops.srt_lite_cpu.clear_cascade_step()
    torch.ops.srt_lite_cpu.set_cascade_step(*step)
    torch.ops.srt_lite_cpu.clear_cascade_step()


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_bf16_linear_matches_the_fp32_product(x_dtype):
    """Both of its strategies (weight-streaming kernel up to `rows` rows, widened fp32 matmul
    above), at row counts on and off its tiles, output counts that are not a multiple of its
    4-row blocks and an input size with a tail past the vector width, with and without
    bias: fp32 accumulation, so it agrees with the fp32 product of the same bf16 values to
    float rounding (and, for bf16 output, to one bf16 rounding)."""
    g = torch.Generator().manual_seed(3)
    N, K = 203, 83
    w = torch.randn(N, K, generator=g).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16()
    for M in (1, 2, 3, 5, 16, 17, 40):
        x = torch.randn(M, K, generator=g).to(x_dtype)
        for b in (None, bias):
            want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            for rows in (0, 16, 64):  # 0: every M takes the widened matmul
                got = torch.ops.srt_lite_cpu.bf16_linear(x, w, b, rows)
                assert got.dtype == x_dtype and got.shape == (M, N) and got.is_contiguous()
                tol = 1e-2 if x_dtype == torch.bfloat16 else 1e-4
                torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_bf16_linear_rejects_bad_shapes_and_dtypes():
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.srt_lite_cpu.bf16_linear(torch.randn(2, 15), w, None, 16)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.srt_lite_cpu.bf16_linear(torch.randn(2, 16), w.float(), None, 16)
    with pytest.raises(RuntimeError, match="bias must be"):
        torch.ops.srt_lite_cpu.bf16_linear(torch.randn(2, 16), w, torch.randn(7), 16)


GEMV = pytest.mark.skipif(not bf16_gemv_available(), reason="bf16_gemv needs AVX512-BF16, uncapped")


def test_bf16_gemv_only_where_the_cpu_has_avx512_bf16():
    """The capped leg of make test (SRT_LITE_CPU_CAPS=avx2) runs this with the cap: there
    the GEMV must be off, and the LM head keeps its other paths."""
    caps = cpu_caps.get()
    assert bf16_gemv_available() == (caps.avx512_bf16 and torch.ops.srt_lite_cpu.bf16_gemv_supported())
    if caps.forced is not None:
        assert not bf16_gemv_available()


@GEMV
@pytest.mark.parametrize("N,K", [(203, 83), (64, 576), (40, 4096), (19, 4160), (9, 8192), (1, 31)])
def test_bf16_gemv_matches_the_fp32_product(N, K):
    """Row-at-a-time (K up to 4096) and 8-row blocks (beyond), output counts off the blocks,
    K with tails past the 32-wide vectors and within one: fp32 sums of the exact bf16
    products, so within a bf16 rounding of the fp32 product."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(1, K, generator=g).bfloat16()
    got = torch.ops.srt_lite_cpu.bf16_gemv(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (1, N)
    want = x.float() @ w.float().t()
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-3 * K**0.5)


@GEMV
def test_bf16_gemv_rejects_bad_shapes_and_dtypes():
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.srt_lite_cpu.bf16_gemv(torch.randn(2, 16).bfloat16(), w)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.srt_lite_cpu.bf16_gemv(torch.randn(1, 16), w)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.srt_lite_cpu.bf16_gemv(torch.randn(1, 16).bfloat16(), w.float())


@GEMV
def test_tied_lm_head_computes_one_tokens_logits_in_the_gemv(monkeypatch):
    """A tied embedding keeps its plain weight for the lookup beside the packed copy: one
    token's logits come from the GEMV over the plain weight, more tokens' from the packed
    copy, and both agree with the fp32 product."""
    from srt_lite.layers import embedding

    g = torch.Generator().manual_seed(6)
    head = embedding.VocabParallelEmbedding(1000, 64)
    head.weight.data = torch.randn(1000, 64, generator=g).bfloat16()
    head.pack_for_cpu()
    assert head.gemv
    hidden = torch.randn(2, 64, generator=g).bfloat16()
    one = head.compute_logits(hidden[:1])
    assert torch.equal(one, torch.ops.srt_lite_cpu.bf16_gemv(hidden[:1], head.weight).float())
    two = head.compute_logits(hidden)
    assert torch.equal(two, packed_linear(hidden, head.packed_weight, None).float())
    want = hidden.float() @ head.weight.float().t()
    torch.testing.assert_close(one, want[:1], rtol=8e-3, atol=1e-2)
    monkeypatch.setattr(embedding.cpu_kernels, "eager_cpu", lambda x: False)  # as in a traced graph
    assert torch.equal(head.compute_logits(hidden[:1]), packed_linear(hidden[:1], head.packed_weight, None).float())
    untied = embedding.ParallelLMHead(1000, 64)
    untied.weight.data = head.weight.data.clone()
    untied.pack_for_cpu()
    assert not untied.gemv  # its plain weight is freed once packed


PANELS = pytest.mark.skipif(not panels_built(), reason="panel_linear needs AVX512-BF16")


@PANELS
@pytest.mark.parametrize(
    "M,N,K",
    [
        (1, 203, 82),  # one row; outputs off the 16-wide vectors and the 64-row panels
        (3, 64, 576),  # a tail of rows; one panel, so half panels are the work units
        (5, 1000, 2048),  # one tile of 5 rows; whole panels
        (15, 1000, 2048),  # two 6-row tiles and a tail of 3
        (12, 500, 96),  # half panels in 8-row tiles, and a tail of 4
        (17, 130, 4098),  # k pairs in three ranges (partial sums kept between them)
        (130, 1100, 64),  # two chunks of rows
        (2, 2048, 2),  # one k pair
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_the_fp32_product(M, N, K, bias):
    """fp32 sums of the exact bf16 products, rounded once: within a bf16 rounding of the
    fp32 product; the padding of the last panel is never written out."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    panels = pack_panels(w)
    assert panels.shape == (-(-N // 64), K // 2, 64, 2)
    avx512 = torch.ops.srt_lite_cpu.panel_linear  # the AVX-512 op, also where panel_linear() takes AMX
    got = avx512(x, panels, b, N)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    want = x.float() @ w.float().t() + (b.float() if bias else 0)
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-3 * K**0.5)
    # A row's result does not depend on its neighbours (no padding rows, no mixing).
    torch.testing.assert_close(avx512(x[-1:], panels, b, N).float(), got[-1:].float(), rtol=8e-3, atol=1e-3 * K**0.5)


AMX = pytest.mark.skipif(not amx_panels_built(), reason="amx_panel_linear needs AMX-BF16")


@AMX
@pytest.mark.parametrize(
    "M,N,K",
    [
        (1, 203, 96),  # one row; outputs off the 16-wide tiles and the 64-row panels
        (5, 1000, 2048),  # one tile of 5 rows over the whole k range
        (16, 64, 576),  # one full tile, one panel
        (17, 130, 4096),  # a full tile and one of a row; k in 16 ranges of 128 pairs
        (130, 1100, 64),  # two chunks of rows, the second a tile of 2
        (300, 70, 2080),  # three chunks, k ranges with a short last one
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_amx_panel_linear_matches_the_product_and_ignores_the_batch(M, N, K, bias):
    """AMX tiles over the same panels: within a bf16 rounding of the fp32 product, and a
    row's result is the same bit for bit alone, in any slice of the batch, or in the whole
    (one fp32 accumulator row an output, in k order, whatever the tile or the k ranges)."""
    g = torch.Generator().manual_seed(17)
    w = torch.randn(N, K, generator=g).bfloat16()
    x = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    panels = pack_panels(w)
    amx = torch.ops.srt_lite_cpu.amx_panel_linear
    got = amx(x, panels, b, N)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    want = x.float() @ w.float().t() + (b.float() if bias else 0)
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-3 * K**0.5)
    assert torch.equal(amx(x[-1:], panels, b, N), got[-1:])
    assert torch.equal(amx(x[M // 3:], panels, b, N), got[M // 3:])
    assert torch.equal(panel_linear(x, panels, b, N), got)  # the dispatcher takes AMX for whole tiles of K


# The two 4-bit panel products: AMX tiles, and AVX512-BF16 dot products.
INT4_PANEL_OPS = [pytest.param("amx_int4_panel_linear", marks=AMX), pytest.param("int4_panel_linear", marks=PANELS)]


@pytest.mark.parametrize("name", INT4_PANEL_OPS)
@pytest.mark.parametrize(
    "M,N,K",
    [
        (1, 203, 96),  # one row; outputs off the 16-wide tiles and the 64-row panels
        (8, 1000, 2048),  # one tile of rows, 64 groups
        (17, 130, 576),  # a full tile and one of a row
        (40, 70, 64),  # three tiles of rows, two groups
        (130, 64, 160),  # two chunks of rows
        (129, 70, 96),  # a last chunk of one row (the lone row's path), three groups
        (21, 1536, 576),  # enough panels for whole ones a thread (and a row tile of 3 left)
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_int4_panel_linear_matches_the_4bit_product_and_ignores_the_batch(name, M, N, K, bias):
    """4-bit panels (a GGUF's codes, scale and zero per group of 32): within fp32 and one bf16
    rounding of the exact product of the 4-bit weights (float64), and a row's result is the
    same bit for bit alone, in a slice of the batch, or in the whole."""
    from srt_lite.layers.cpu_linear.products import pack_int4_panels

    g = torch.Generator().manual_seed(19)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scale = torch.rand(N, K // 32, generator=g) * 0.02
    zero = torch.randn(N, K // 32, generator=g) * 0.05
    x = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    packed, sz = pack_int4_panels(codes, scale, zero)
    assert packed.shape == (-(-N // 64), K // 4, 4, 32) and sz.shape == (-(-N // 64), K // 32, 2, 64)
    op = getattr(torch.ops.srt_lite_cpu, name)
    got = op(x, packed, sz, b, N)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    w = ((codes.double().view(N, K // 32, 32) - 8) * scale.double()[..., None] + zero.double()[..., None]).view(N, K)
    want = x.double() @ w.t() + (b.double() if bias else 0)
    torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=2e-3 * want.abs().max().item())
    assert torch.equal(op(x[-1:], packed, sz, b, N), got[-1:])
    assert torch.equal(op(x[M // 3:], packed, sz, b, N), got[M // 3:])


@pytest.mark.parametrize("name", INT4_PANEL_OPS)
def test_int4_panel_linear_rejects_bad_shapes(name):
    from srt_lite.layers.cpu_linear.products import pack_int4_panels

    packed, sz = pack_int4_panels(torch.randint(0, 16, (70, 64), dtype=torch.uint8), torch.rand(70, 2), torch.rand(70, 2))
    x = torch.randn(2, 64).bfloat16()
    op = getattr(torch.ops.srt_lite_cpu, name)
    with pytest.raises(RuntimeError, match="x must be"):
        op(torch.randn(2, 32).bfloat16(), packed, sz, None, 70)
    with pytest.raises(RuntimeError, match="does not fit"):
        op(x, packed, sz, None, 129)
    with pytest.raises(RuntimeError, match="sz must be"):
        op(x, packed, sz[:, :1].contiguous(), None, 70)
    with pytest.raises(RuntimeError, match="codes must be"):
        op(x, packed.view(2, 16, 128), sz, None, 70)
    with pytest.raises(RuntimeError, match="bias must be"):
        op(x, packed, sz, torch.randn(69).bfloat16(), 70)
    assert op(x[:0], packed, sz, None, 70).shape == (0, 70)


@AMX
def test_amx_panel_linear_rejects_bad_shapes_and_other_k():
    """K off whole tiles is refused by the AMX op and goes to the AVX-512 op instead."""
    panels = pack_panels(torch.randn(70, 48).bfloat16())  # K = 48: one and a half tiles
    x = torch.randn(2, 48).bfloat16()
    amx = torch.ops.srt_lite_cpu.amx_panel_linear
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        amx(x, panels, None, 70)
    assert torch.equal(panel_linear(x, panels, None, 70), torch.ops.srt_lite_cpu.panel_linear(x, panels, None, 70))
    panels = pack_panels(torch.randn(70, 64).bfloat16())
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="x must be"):
        amx(torch.randn(2, 32).bfloat16(), panels, None, 70)
    with pytest.raises(RuntimeError, match="x must be"):
        amx(x.float(), panels, None, 70)
    with pytest.raises(RuntimeError, match="does not fit"):
        amx(x, panels, None, 129)
    with pytest.raises(RuntimeError, match="bias must be"):
        amx(x, panels, torch.randn(69).bfloat16(), 70)
    with pytest.raises(RuntimeError, match="weight must be"):
        amx(x, panels.float(), None, 70)
    assert amx(x[:0], panels, None, 70).shape == (0, 70)


@PANELS
def test_panel_linear_rejects_bad_shapes_and_dtypes():
    panels = pack_panels(torch.randn(70, 16).bfloat16())  # two panels
    x = torch.randn(2, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x must be"):
        panel_linear(torch.randn(2, 18).bfloat16(), panels, None, 70)
    with pytest.raises(RuntimeError, match="x must be"):
        panel_linear(x.float(), panels, None, 70)
    with pytest.raises(RuntimeError, match="does not fit"):
        panel_linear(x, panels, None, 129)
    with pytest.raises(RuntimeError, match="does not fit"):
        panel_linear(x, panels, None, 64)
    with pytest.raises(RuntimeError, match="bias must be"):
        panel_linear(x, panels, torch.randn(69).bfloat16(), 70)
    with pytest.raises(RuntimeError, match="weight must be"):
        panel_linear(x, panels.float(), None, 70)
    assert panel_linear(x[:0], panels, None, 70).shape == (0, 70)


@PANELS
def test_panel_layers_replace_their_plain_weights():
    """A linear in the panel layout holds no plain weight, nor does an LM head, tied or not:
    a tied one looks its rows up in the panels, exactly. An embedding that is only looked up
    keeps its plain weight and packs nothing. An odd K keeps F.linear."""
    from srt_lite.layers import embedding

    g = torch.Generator().manual_seed(8)
    layer = PackableLinear()
    layer.weight = torch.nn.Parameter(torch.randn(100, 48, generator=g).bfloat16(), requires_grad=False)
    want = torch.nn.functional.linear(x := torch.randn(3, 48, generator=g).bfloat16(), layer.weight)
    layer.use_panels()
    assert layer.weight.numel() == 0 and layer.panels is not None
    assert not layer.panels_amx  # K = 48 is not whole AMX tiles
    torch.testing.assert_close(layer.matmul(x, None).float(), want.float(), rtol=8e-3, atol=2e-2)
    odd = PackableLinear()
    odd.weight = torch.nn.Parameter(torch.randn(10, 7, generator=g).bfloat16(), requires_grad=False)
    odd.use_panels()
    assert odd.panels is None and odd.weight.numel() == 70
    tied, untied = embedding.VocabParallelEmbedding(300, 64), embedding.ParallelLMHead(300, 64)
    lookup = embedding.VocabParallelEmbedding(300, 64)
    lookup.lookup_only = True
    for head in (tied, untied, lookup):
        head.weight.data = torch.randn(300, 64, generator=g).bfloat16()
    hidden = torch.randn(2, 64, generator=g).bfloat16()
    want = hidden.float() @ tied.weight.float().t()
    ids = torch.tensor([0, 63, 64, 299, 5, 5])
    rows = tied(ids)
    for head in (tied, untied, lookup):
        head.use_panels()
    assert tied.weight.numel() == 0 and untied.weight.numel() == 0 and not tied.gemv
    assert tied.panels_amx == untied.panels_amx == amx_panels_built()  # K = 64: two tiles
    assert lookup.panels is None and lookup.weight.numel() == 300 * 64
    assert torch.equal(tied(ids), rows)
    torch.testing.assert_close(tied.compute_logits(hidden), want, rtol=8e-3, atol=2e-2)
    torch.testing.assert_close(tied.compute_logits(hidden[:1]), want[:1], rtol=8e-3, atol=2e-2)


@pytest.mark.parametrize(
    "M,N,K",
    [
        (1, 203, 82),  # one row; outputs off the vectors and the 32-row panels
        (13, 100, 576),  # a 12-row tile and a tail of one (AVX-512); 3-row tiles (AVX2)
        (100, 70, 1100),  # k in three ranges, and two chunks of rows (bf16 widened into a copy)
        (40, 70, 600),  # bf16: widened into a copy in the AVX2 build, in registers in AVX-512's
        (4, 32, 1),  # one k
        (7, 96, 7),  # an odd K, which bf16's layout would pair
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_f32_panel_linear_matches_the_product_and_ignores_the_batch(M, N, K, bias, wdtype):
    """fp32 panels, of fp32 weights or of bf16 ones widened as they are read (up to 4 tiles
    of rows) or into an fp32 copy (more): within fp32 rounding of the float64 product, and
    each row's result is the same bit for bit whether computed alone or in the batch (one
    multiply-add chain an output, in k order, for every tile and either way of widening)."""
    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(N, K, generator=g).to(wdtype).float(), torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    panels = pack_panels(w.to(wdtype), wide=True)
    assert panels.shape == (-(-N // 32), K, 32, 1) and panels.dtype == wdtype
    got = torch.ops.srt_lite_cpu.f32_panel_linear(x, panels, b, N)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * K**0.5)
    one = torch.ops.srt_lite_cpu.f32_panel_linear
    for m in {0, M // 2, M - 1}:
        assert torch.equal(one(x[m : m + 1], panels, b, N), got[m : m + 1])
    assert torch.equal(one(x[M // 2 :], panels, b, N), got[M // 2 :])
    if wdtype == torch.bfloat16:  # a bf16 model's linear: x and the output in bf16
        y = panel_linear(x.bfloat16(), panels, b, N)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), one(x.bfloat16().float(), panels, b, N).bfloat16().float())


def test_f32_panel_linear_rejects_bad_shapes_and_dtypes():
    panels = pack_panels(torch.randn(40, 16))  # two panels
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="x must be"):
        panel_linear(torch.randn(2, 18), panels, None, 40)
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.srt_lite_cpu.f32_panel_linear(x.bfloat16(), panels, None, 40)
    with pytest.raises(RuntimeError, match="does not fit"):
        panel_linear(x, panels, None, 65)
    with pytest.raises(RuntimeError, match="does not fit"):
        panel_linear(x, panels, None, 32)
    with pytest.raises(RuntimeError, match="bias must be"):
        panel_linear(x, panels, torch.randn(39), 40)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.srt_lite_cpu.f32_panel_linear(x, panels.reshape(2, 8, 64, 1).contiguous(), None, 40)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.srt_lite_cpu.f32_panel_linear(x, panels.half(), None, 40)
    assert panel_linear(x[:0], panels, None, 40).shape == (0, 40)


def test_f32_panel_layers_replace_their_plain_weights():
    """In fp32 a linear's panels replace its weight, odd K included, and a tied embedding
    looks its rows up in the panels exactly."""
    from srt_lite.layers import embedding

    g = torch.Generator().manual_seed(10)
    layer = PackableLinear()
    layer.weight = torch.nn.Parameter(torch.randn(100, 7, generator=g), requires_grad=False)
    want = torch.nn.functional.linear(x := torch.randn(3, 7, generator=g), layer.weight)
    layer.use_panels()
    assert layer.weight.numel() == 0 and layer.panels is not None
    assert not layer.panels_amx  # K = 48 is not whole AMX tiles
    torch.testing.assert_close(layer.matmul(x, None), want, rtol=1e-5, atol=1e-5)
    tied = embedding.VocabParallelEmbedding(300, 64)
    tied.weight.data = torch.randn(300, 64, generator=g)
    hidden = torch.randn(2, 64, generator=g)
    want = hidden @ tied.weight.t()
    ids = torch.tensor([0, 31, 32, 299, 5, 5])
    rows = tied(ids)
    tied.use_panels()
    assert tied.weight.numel() == 0
    assert torch.equal(tied(ids), rows)
    torch.testing.assert_close(tied.compute_logits(hidden), want, rtol=1e-5, atol=1e-4)


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prompts_and_chunks_take_the_prompt_op_with_the_torch_ops_logits(tmp_path, dtype):
    """Prompts of several lengths in one step, then a chunk of each after its cached part:
    with the C++ ops every such step is one CPP_PROMPT group, and its logits (every
    position's) agree with the torch ops' (padded SDPA under a mask)."""
    path = make_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype=dtype, max_total_tokens=4096))
    fragment_free_list(runner, seed=3)
    backend = runner.attn_backend
    seen = []
    original = backend.init_forward_metadata
    backend.init_forward_metadata = lambda fb: original(fb) or seen.append(fb.attn_metadata)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (130, 50, 33, 90)]
    chunks = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (40, 70, 33, 100)]

    backend.amx = False  # with AMX bf16 prompts take the flash kernel (test_attention_plans)

    def run(cpp: bool) -> list[torch.Tensor]:
        backend.cpu_kernels = cpp
        seen.clear()
        h = Harness(runner)
        out = [h.prefill(prompts).all_logits]
        out.append(h.extend(h.rows, list(h.lens), chunks, all_logits=True).all_logits)
        kinds = {grp.plan.kind for step in seen for grp in step.groups}
        assert kinds == ({PlanKind.CPP_PROMPT} if cpp else {PlanKind.EXTEND})
        return out

    torch_ops, cpp = run(False), run(True)
    for a, b in zip(torch_ops, cpp):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert err < (2e-2 if dtype == "bfloat16" else 1e-5), err
        if dtype == "float32":
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_disabled_by_environment():
    env = dict(os.environ, SRT_LITE_DISABLE_CPU_KERNELS="1")
    code = "from srt_lite import cpu_kernels; print(cpu_kernels.load())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "own,new_tokens,torch_kind",
    [
        # 8 decode rows with 6 own tokens each: one masked suffix sequence has ~8x the pairs
        # of padding each row, so torch's path pads row by row.
        ((6,) * 8, 1, PlanKind.CASCADE),
        # 4 rows of 16 new tokens over 120-150 own tokens each: the masked sequence (~38.6K
        # pairs) is under 4x the padded ones, so torch's path takes it.
        ((140, 130, 120, 150), 16, PlanKind.TOKEN_CASCADE),
    ],
)
def test_token_cascade_choice_with_and_without_the_cpp_op(tmp_path, own, new_tokens, torch_kind):
    """Rows over an 80-token shared prefix: the step's single group is the C++ token cascade
    with the op, and as torch's rule says without it; the logits agree either way (fp32)."""
    path = make_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(ModelConfig.load(path), ServerArgs(dtype="float32", max_total_tokens=4096))
    backend = runner.attn_backend
    seen = []
    original = backend.init_forward_metadata
    backend.init_forward_metadata = lambda fb: original(fb) or seen.append(fb.attn_metadata)
    g = torch.Generator().manual_seed(6)
    prefix = torch.randint(3, 320, (80,), generator=g).tolist()
    h = Harness(runner)
    h.prefill([prefix])
    rows = h.rows_sharing_prefix(len(own), 80)
    own_ids = [torch.randint(3, 320, (n,), generator=g).tolist() for n in own]
    hr = Harness(runner)
    hr.extend(rows, [80] * len(own), own_ids, all_logits=False)
    new = [torch.randint(3, 320, (new_tokens,), generator=g).tolist() for _ in rows]
    logits = {}
    for cpp in (False, True):
        backend.cpu_kernels = cpp
        seen.clear()
        logits[cpp] = hr.extend(rows, [80 + n for n in own], new, all_logits=True).all_logits
        (group,) = seen[0].groups
        want = PlanKind.CPP_CASCADE if cpp else torch_kind
        assert group.plan.shared_prefix_len == 80 and group.plan.kind is want
    assert torch.allclose(logits[False], logits[True], atol=1e-5)


@pytest.mark.slow
def test_compiled_graph_runs_a_token_cascade_step_in_cpp_and_other_steps_in_python(tmp_path, monkeypatch):
    """--enable-torch-compile: a step that is one token cascade runs its attention inside the
    graph's C++ op (no Python call per layer); the steps around it (prefill, plain decode) go
    through the Python op. Logits agree with the eager runner's."""
    python_calls = []
    original = CppCascadePlan.run
    monkeypatch.setattr(CppCascadePlan, "run", lambda *a: python_calls.append(1) or original(*a))
    monkeypatch.setenv("SRT_LITE_DISABLE_CPP_DECODER", "1")  # eager: the Python layers, counted
    path = make_tiny_model("llama", tmp_path / "llama")

    def run(compile_: bool) -> list[torch.Tensor]:
        args = ServerArgs(dtype="bfloat16", max_total_tokens=4096, enable_torch_compile=compile_)
        runner = ModelRunner(ModelConfig.load(path), args)
        if compile_:
            runner.warmup(max_decode_batch=2, num_draft_tokens=2, prefill_chunk=0)
        g = torch.Generator().manual_seed(8)
        prefix = torch.randint(3, 320, (80,), generator=g).tolist()
        h = Harness(runner)
        outs = [h.prefill([prefix]).next_token_logits]
        rows = h.rows_sharing_prefix(3, 80)
        hr = Harness(runner)
        suffixes = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (2, 5, 7)]
        python_calls.clear()
        outs.append(hr.extend(rows, [80] * 3, suffixes, all_logits=False).next_token_logits)  # a token cascade
        cascade_python_calls = len(python_calls)
        outs.append(Harness(runner).prefill([suffixes[2]]).next_token_logits)  # no shared prefix
        return outs, cascade_python_calls

    (eager, eager_calls), (compiled, compiled_calls) = run(False), run(True)
    assert eager_calls == 2 and compiled_calls == 0  # 2 layers through Python, or none
    for a, b in zip(eager, compiled):
        assert (a.float() - b.float()).abs().max().item() < 0.1
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_cascade_op_only_for_the_dtypes_and_head_sizes_it_computes():
    """Other models keep the torch-ops cascade instead of failing the C++ op's checks."""
    assert cpp_cascade_ok(True, torch.bfloat16, 64) and cpp_cascade_ok(True, torch.float32, 128)
    assert not cpp_cascade_ok(True, torch.float16, 64)
    assert not cpp_cascade_ok(True, torch.bfloat16, 72) and not cpp_cascade_ok(True, torch.bfloat16, 512)
    assert not cpp_cascade_ok(False, torch.bfloat16, 64)  # not built (or turned off)


def test_compiled_graphs_are_cached_per_build_of_the_ops(monkeypatch, tmp_path):
    """A graph compiled against another build of the ops is never loaded: inductor's cache
    folder is named by this build (torch, CPU level, sources); a folder the user chose wins."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("SRT_LITE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    cpu_kernels.use_private_inductor_cache()
    tag = cpu_kernels.build_tag()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor" / tag)
    assert tag.startswith(f"torch{torch.__version__}-{cpu_caps.get().level}-")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    cpu_kernels.use_private_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
def test_a_finished_build_loads_without_cpp_extension(monkeypatch):
    """A build folder that holds this build's library is loaded as it is (cpp_extension, with
    its setuptools import and ninja run, is not needed), and other compiler flags name
    another folder, so that a change of flags never loads the old library."""
    code = "import sys; sys.modules['torch.utils.cpp_extension'] = None\nfrom srt_lite import cpu_kernels\nprint(cpu_kernels.load())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "True", r.stderr[-2000:]
    tag = cpu_kernels.build_tag()
    level = cpu_caps.get().level
    monkeypatch.setitem(cpu_kernels.VEC_FLAGS, level, [*cpu_kernels.VEC_FLAGS.get(level, []), "-DSRT_LITE_TEST_FLAG"])
    assert cpu_kernels.build_tag() != tag


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_elementwise_ops_round_as_the_torch_ops(dtype, rows):
    """RMSNorm (with and without the residual add), RoPE and SiLU-and-mul in C++ against the
    torch ops they replace in RMSNorm, RotaryEmbedding and SiluAndMul. RoPE and SiLU round
    each step as torch does and agree bit for bit; the residual sum too; the norm sums its
    squares in another order, so its output may differ in the last places (in bf16 and
    fp16 rarely, where its rounding hides the factor's last bits)."""
    from srt_lite.layers.activation import SiluAndMul
    from srt_lite.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(rows)
    n = 200  # not a multiple of any vector width
    norm = RMSNorm(n, 1e-5).to(dtype)
    norm.weight.data = (torch.randn(n, generator=g) * 0.3 + 1).to(dtype)
    x, r = (torch.randn(rows, n, generator=g) * 3).to(dtype), torch.randn(rows, n, generator=g).to(dtype)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 2**-23}[dtype]
    want_h = x + r
    got, got_h = torch.ops.srt_lite_cpu.add_rms_norm(x, r, norm.weight, 1e-5)
    assert torch.equal(got_h, want_h)
    for want, got in ((norm._norm(want_h), got), (norm._norm(x), torch.ops.srt_lite_cpu.rms_norm(x, norm.weight, 1e-5))):
        # within a few units of the last place of the row's largest value (the factor's
        # last bits move with the sum order, which differs with the vector width)
        row_max = want.float().abs().amax(-1, keepdim=True)
        assert ((want.float() - got.float()).abs() <= 4 * ulp * row_max).all()
        if dtype != torch.float32:  # in fp32 a factor one ulp apart moves most elements
            assert (want != got).float().mean() < 0.02
    heads, D = 5, 48
    qk = torch.randn(rows, heads + 2, D, generator=g).to(dtype)[:, :heads]  # heads of a wider row
    cos, sin = (torch.randn(rows, 1, D, generator=g).to(dtype) for _ in range(2))
    want = qk * cos + torch.cat((qk[..., D // 2:], qk[..., : D // 2]), dim=-1) * sin
    assert torch.equal(torch.ops.srt_lite_cpu.rope(qk, cos, sin), want)
    gate_up = (torch.randn(rows, 2 * 100, generator=g) * 4).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :100]) * gate_up[:, 100:]
    assert torch.equal(torch.ops.srt_lite_cpu.silu_and_mul(gate_up), want)
    assert torch.equal(SiluAndMul()(gate_up), want)  # the layer takes the C++ op on CPU


def test_elementwise_ops_reject_bad_shapes():
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.srt_lite_cpu.rms_norm(torch.randn(2, 9), w, 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.srt_lite_cpu.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), w, 1e-6)
    with pytest.raises(RuntimeError, match="cos / sin"):
        torch.ops.srt_lite_cpu.rope(torch.randn(2, 3, 8), torch.randn(2, 1, 4), torch.randn(2, 1, 8))
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.srt_lite_cpu.silu_and_mul(torch.randn(2, 7))
