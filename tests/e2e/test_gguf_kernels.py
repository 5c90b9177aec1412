"""GGUF blocks and the products over them (model_loader/gguf_types.py, layers/cpu_linear/gguf.py,
csrc/cpu_gguf_linear.cpp), on tensors of random blocks, with gguf's numpy dequantization as the
reference: the blocks dequantize bit for bit as gguf's; the integer products equal an exact
emulation (float64) of their int8 activations (per 32 values, per 256 for the K-quants, as
llama.cpp quantizes) within 1e-5, bf16 outputs are those sums rounded; the packed groups keep
every bit and their products equal the unpacked ones'. Models built from such blocks:
test_gguf_native.py."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from srt_lite import cpu_caps, cpu_kernels
from srt_lite.layers.cpu_linear import gguf as gguf_linear
from srt_lite.layers.cpu_linear.gguf import DOT_ROWS, PACK_ROWS, PACKED_ID, PACKED_TYPES, GGUFWeight
from srt_lite.model_loader import gguf_types

pytestmark = pytest.mark.cpu_caps


def _packs(name: str) -> bool:
    """Whether this CPU has a packed kernel for the type (the C++ ops' own answer)."""
    return cpu_kernels.load() and torch.ops.srt_lite_cpu.gguf_packs(gguf_types.BY_NAME[name].id)


def _packed_types(reason: str, also_skip: bool = False) -> list:
    return [pytest.param(n, marks=pytest.mark.skipif(also_skip or not _packs(n), reason=reason)) for n in PACKED_TYPES]


def _int8_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [rows, k] rounded as the products quantize it, in float64: int8 with one scale
    (max |x| / 127) per `block` values."""
    rows, k = x.shape
    xb = x.view(rows, k // block, block).double()
    d = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))) * d).view(rows, k)


@pytest.mark.parametrize("name", gguf_types.QUANTIZED)
def test_blocks_dequantize_as_gguf_does(name):
    t = gguf_types.BY_NAME[name]
    raw = gguf_types.random_blocks(t, 24, 512, torch.Generator().manual_seed(1))
    want = torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType(t.id))).view(24, 512)
    assert torch.equal(gguf_types.dequantize(raw, t, 512), want.float())


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
@pytest.mark.parametrize("name", gguf_types.QUANTIZED)
def test_gguf_linear_against_the_dequantized_product(name):
    """Dot products (up to DOT_ROWS rows) within int8 activation error; dequantized slabs
    (more rows) exact in fp32; a part split, a bias, and each row's result independent of
    the batch around it (bit for bit)."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(2)
    raw = gguf_types.random_blocks(t, 72, 512, g)
    w = gguf_types.dequantize(raw, t, 512).double()
    bias = torch.randn(72, generator=g)
    weight = GGUFWeight([(t, raw[:40]), (t, raw[40:])], 512)
    x = torch.randn(DOT_ROWS + 8, 512, generator=g)
    want = x.double() @ w.t() + bias.double()

    def rel(y: torch.Tensor, rows: int) -> float:
        return ((y.double() - want[:rows]).norm() / want[:rows].norm()).item()

    for rows in (1, 5, DOT_ROWS):
        assert rel(weight.forward(x[:rows], bias), rows) < 0.02
        assert rel(weight.forward(x[:rows].bfloat16(), bias), rows) < 0.03
    assert rel(weight.forward(x, bias), x.shape[0]) < 1e-6
    assert rel(weight.forward(x.bfloat16(), bias), x.shape[0]) < 0.02
    batch = weight.forward(x[:DOT_ROWS], bias)
    for r in (0, 3, DOT_ROWS - 1):
        assert torch.equal(weight.forward(x[r : r + 1], bias)[0], batch[r])


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
@pytest.mark.parametrize("name", gguf_types.QUANTIZED)
def test_dot_products_equal_int8_activations_exactly(name):
    """The dot products are x rounded to int8 with one scale per 32 values (per 256 for the
    K-quants' super-blocks, on every CPU level), times the dequantized weight: an exact
    float64 emulation agrees within float32 rounding, at K with a tail of 64 weights."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(5)
    k = 576 if t.unit == 32 else 512
    raw = gguf_types.random_blocks(t, 48, k, g)
    x = torch.randn(3, k, generator=g)
    xq = _int8_activations(x, 256 if t.unit == 256 else 32)
    want = xq @ gguf_types.dequantize(raw, t, k).double().t()
    got = torch.ops.srt_lite_cpu.gguf_linear(x, [raw], [t.id], None, DOT_ROWS, False).double()
    assert ((got - want).norm() / want.norm()).item() < 1e-5


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
@pytest.mark.parametrize("name", gguf_types.QUANTIZED)
def test_bf16_products_are_the_fp32_sums_rounded(name):
    """The dot products write bf16 outputs themselves (bias added, then rounded): bit for bit
    the fp32 product of the same x plus the bias, rounded as a tensor's .to(bfloat16) rounds,
    for packed and unpacked parts and a part whose last task has fewer than 16 rows."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(6)
    k = 512
    raw = gguf_types.random_blocks(t, 56, k, g)
    weight = GGUFWeight([(t, raw[:32]), (t, raw[32:56])], k)  # 24 rows: a task of 16, one of 8
    bias = torch.randn(56, generator=g).bfloat16()
    for rows in (1, 5, DOT_ROWS):
        x = torch.randn(rows, k, generator=g).bfloat16()
        for b in (None, bias):
            fp32 = weight.forward(x.float(), None if b is None else b.float())
            got = weight.forward(x, b)
            assert got.dtype == torch.bfloat16 and torch.equal(got, fp32.bfloat16()), (rows, b is None)
            # The logits (fp32_out): the same sums before that rounding.
            assert torch.equal(weight.forward(x, b, fp32_out=True), fp32), (rows, b is None)
    x = torch.randn(DOT_ROWS + 1, k, generator=g).bfloat16()  # a prompt's rows on the slabs, where not packed
    got = weight.forward(x, fp32_out=True)
    assert got.dtype == torch.float32 and torch.allclose(got, weight.forward(x).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
@pytest.mark.parametrize("name", PACKED_TYPES)
def test_packed_groups_keep_every_bit(name):
    """A repacked weight (16 rows interleaved) unpacks to the file's blocks exactly: its
    dequantization equals the blocks' bit for bit (the slab path reads it that way)."""
    t = gguf_types.BY_NAME[name]
    k = 512
    raw = gguf_types.random_blocks(t, 48, k, torch.Generator().manual_seed(7))
    packed = torch.ops.srt_lite_cpu.gguf_repack(raw, t.id, k)
    assert packed.shape[0] == 48 // PACK_ROWS
    assert torch.equal(torch.ops.srt_lite_cpu.gguf_dequantize(packed, t.id + PACKED_ID, k),
                       torch.ops.srt_lite_cpu.gguf_dequantize(raw, t.id, k))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.srt_lite_cpu.gguf_repack(raw[:40], t.id, k)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
@pytest.mark.parametrize("name", PACKED_TYPES)
def test_a_tied_embedding_looks_up_rows_in_its_packed_copy(name):
    """An embedding tied to the head reads its rows from the packed copy (the file's pages of
    it stay unmapped), with the same values as the file's blocks; a row outside the table is
    an error, not a read past it."""
    t = gguf_types.BY_NAME[name]
    k = 512
    raw = gguf_types.random_blocks(t, 48, k, torch.Generator().manual_seed(11))
    table = GGUFWeight([(t, raw)], k, pack=True)
    ids = torch.tensor([47, 0, 16, 5, 5, 31])
    want = torch.ops.srt_lite_cpu.gguf_dequantize(raw, t.id, k)[ids]
    assert torch.equal(torch.ops.srt_lite_cpu.gguf_rows(raw, t.id, k, ids), want)
    if _packs(name):
        assert table.kernel_ids[0] == t.id + PACKED_ID
        raw.zero_()  # the lookup must not read the file's blocks any more
    assert torch.equal(table.lookup(ids, torch.float32), want)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.srt_lite_cpu.gguf_rows(table.kernel_parts[0], table.kernel_ids[0], k, torch.tensor([48]))


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
def test_packed_copies_lie_back_to_back_on_2mib_arenas():
    """Packed copies share 2 MiB-aligned arenas, each starting on the cache line after the
    last (a copy of its own would start just past a 2 MiB boundary, its head and tail on small
    pages); one larger than an arena gets its own, aligned."""
    huge = 2 << 20
    t = gguf_types.BY_NAME["Q4_K"]
    gen = torch.Generator().manual_seed(3)
    small = [torch.ops.srt_lite_cpu.gguf_repack(gguf_types.random_blocks(t, 16 * n, 512, gen), t.id, 512)
             for n in (1, 3, 2)]
    for a, b in zip(small, small[1:]):
        follows = b.data_ptr() == a.data_ptr() + (a.numel() + 63) // 64 * 64
        assert follows or b.data_ptr() % huge == 0  # the next one, or a fresh arena
    assert all(p.data_ptr() % 64 == 0 for p in small)
    big_raw = gguf_types.random_blocks(t, 16 * 3700, 2048, gen)  # packs to 65 MiB
    big = torch.ops.srt_lite_cpu.gguf_repack(big_raw, t.id, 2048)
    assert big.numel() > 64 * 2**20 and big.data_ptr() % huge == 0
    assert torch.equal(torch.ops.srt_lite_cpu.gguf_dequantize(big[-1:], t.id + PACKED_ID, 2048),
                       torch.ops.srt_lite_cpu.gguf_dequantize(big_raw[-16:], t.id, 2048))


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
def test_packed_kernels_by_cpu_level():
    """The AVX2 and AVX-512 builds pack every type they read (vpdpbusd with VNNI, vpmaddubsw
    without); the portable build none."""
    want = set(PACKED_TYPES) if cpu_caps.get().level in ("avx2", "avx512") else set()
    assert {n for n in PACKED_TYPES if _packs(n)} == want


@pytest.mark.parametrize("name", _packed_types("no packed kernel for this type on this CPU"))
def test_packed_products_equal_int8_activations(name):
    """The packed products compute what the file's blocks do: an exact float64 emulation of
    the int8 activations within float32 rounding, every row count up to DOT_ROWS, each row's
    result the same alone as in its batch (bit for bit), beside an unpacked part."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(8)
    k = 512
    raw = gguf_types.random_blocks(t, 48, k, g)
    weight = GGUFWeight([(t, raw[:32]), (t, raw[32:40])], k)
    assert weight.kernel_ids == [t.id + PACKED_ID, t.id]  # 8 rows are not a packed group
    block = 256 if t.unit == 256 else 32
    for rows in (1, 3, 4, 5, 8, 11, DOT_ROWS):  # the row tiles (4; 8 for Q6_K on AVX2) and their tails
        x = torch.randn(rows, k, generator=g)
        xq = _int8_activations(x, block)
        want = xq @ gguf_types.dequantize(raw[:40], t, k).double().t()
        got = weight.forward(x).double()
        assert ((got - want).norm() / want.norm()).item() < 1e-5, rows
        for r in range(rows):
            assert torch.equal(weight.forward(x[r : r + 1])[0], weight.forward(x)[r])


@pytest.mark.parametrize("name", _packed_types("prompts take the packed products where the CPU packs the type and has no AMX",
                                                 also_skip=cpu_caps.get().amx_bf16))
def test_packed_weights_take_int8_products_for_prompts(name):
    """A weight whose parts are all packed runs prompts (more than DOT_ROWS rows) through the
    same int8 products as decode: the float64 emulation within float32 rounding, and each
    row the same as alone (bit for bit), where a mixed weight still takes the slabs."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(9)
    k, rows = 512, DOT_ROWS + 24
    raw = gguf_types.random_blocks(t, 48, k, g)
    weight = GGUFWeight([(t, raw[:32]), (t, raw[32:48])], k)
    assert weight.all_packed and gguf_linear.dot_rows(True) > rows
    assert not GGUFWeight([(t, raw[:32]), (t, raw[32:40])], k).all_packed
    block = 256 if t.unit == 256 else 32
    x = torch.randn(rows, k, generator=g)
    xq = _int8_activations(x, block)
    want = xq @ gguf_types.dequantize(raw, t, k).double().t()
    got = weight.forward(x)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
    for r in (0, DOT_ROWS, rows - 1):
        assert torch.equal(weight.forward(x[r : r + 1])[0], got[r])


def test_without_the_cpp_ops_slabs_go_through_f_linear(monkeypatch):
    """Without a C++ compiler, a GGUFWeight dequantizes with gguf's numpy reference and
    multiplies in float: the exact product of the dequantized weight."""
    monkeypatch.setattr(gguf_linear.cpu_kernels, "load", lambda: False)
    monkeypatch.setattr(gguf_types, "_kernels_built", lambda: False)
    g = torch.Generator().manual_seed(6)
    parts = [(gguf_types.BY_NAME[n], gguf_types.random_blocks(gguf_types.BY_NAME[n], 8, 256, g)) for n in ("Q4_K", "Q5_0")]
    weight = GGUFWeight(parts, 256)
    want = torch.cat([torch.from_numpy(gguf_dequantize(raw.numpy(), GGMLQuantizationType(t.id))).view(8, 256)
                      for t, raw in parts])
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(weight.dequantized(), want.float())
    assert torch.allclose(weight.forward(x), x @ want.float().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
def test_gguf_linear_refuses_bad_parts():
    t = gguf_types.BY_NAME["Q4_K"]
    raw = gguf_types.random_blocks(t, 8, 512, torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        torch.ops.srt_lite_cpu.gguf_linear(torch.randn(1, 320), [raw[:, :180]], [t.id], None, 16, False)
    with pytest.raises(RuntimeError, match="must be uint8"):
        torch.ops.srt_lite_cpu.gguf_linear(torch.randn(1, 512), [raw[:, :100]], [t.id], None, 16, False)
    with pytest.raises(RuntimeError, match="has no kernel"):
        torch.ops.srt_lite_cpu.gguf_linear(torch.randn(1, 512), [raw], [10], None, 16, False)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_a_registered_weight_computes_what_its_forward_does(name):
    """The C++ decoder stack's products (a weight registered once, its parts checked then and
    its K worked out from them) equal GGUFWeight.forward bit for bit, with the packed part
    first or the unpacked one, at decode and prompt row counts; an x of another width is
    refused, not read past its end."""
    t = gguf_types.BY_NAME[name]
    g = torch.Generator().manual_seed(10)
    k = 512
    raw = gguf_types.random_blocks(t, 40, k, g)
    for parts in ([(t, raw[:32]), (t, raw[32:])], [(t, raw[32:]), (t, raw[:32])]):
        weight = GGUFWeight(parts, k)
        key = weight.cpp_key()
        for rows in (1, 5, DOT_ROWS + 3):
            x = torch.randn(rows, k, generator=g).bfloat16()
            assert torch.equal(torch.ops.srt_lite_cpu.gguf_linear_registered(x, key, None), weight.forward(x)), rows
        with pytest.raises(RuntimeError, match=f"x must be \\[M, {k}\\]"):
            torch.ops.srt_lite_cpu.gguf_linear_registered(torch.randn(1, k - 32), key, None)


@pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ ops do not build here")
def test_every_thread_count_computes_every_output_once():
    """The products' threads each stream a share of the outputs and take halves of what the
    others have left: with more threads than cores (so that some lose theirs midway and
    their shares are taken), with shares of a few tasks and more threads than tasks, every
    output is the one-thread result bit for bit."""
    t = gguf_types.BY_NAME["Q4_K"]
    g = torch.Generator().manual_seed(11)
    k = 256
    raw = gguf_types.random_blocks(t, 16 * 37 + 5, k, g)  # 37 packed groups and 5 rows unpacked
    weight = GGUFWeight([(t, raw[: 16 * 37]), (t, raw[16 * 37 :])], k)
    small = GGUFWeight([(t, raw[:16])], k)  # one task
    before = torch.get_num_threads()
    try:
        for w in (weight, small):
            for rows in (1, 5):
                x = torch.randn(rows, k, generator=g)
                torch.set_num_threads(1)
                want = w.forward(x)
                for threads in (2, 3, 8):
                    torch.set_num_threads(threads)
                    for _ in range(20):
                        assert torch.equal(w.forward(x), want), (w.rows, rows, threads)
    finally:
        torch.set_num_threads(before)
