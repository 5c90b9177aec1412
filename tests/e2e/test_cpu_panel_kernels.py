"""The C++ panel linears (AVX512-BF16 panels, AMX tiles, their 4-bit forms and the fp32 panels)
match the product, give a row the same bits whatever the batch, replace their layers' plain
weights, and reject bad input. Built for this CPU's level (cpu_caps)."""

from __future__ import annotations

import pytest
import torch

from srt_lite import cpu_kernels
from srt_lite.layers.cpu_linear.paths import amx_panels_built, panels_built
from srt_lite.layers.cpu_linear.packable import PackableLinear
from srt_lite.layers.cpu_linear.products import pack_panels, panel_linear


pytestmark = pytest.mark.cpu_caps


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.load()  # CI's machine has the C++ compiler inductor's wrapper uses


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
