"""The C++ bf16-weight linear and bf16 GEMV match the fp32 product, the tied LM head takes the
GEMV for one token's logits, and bad input raises. Built for this CPU's level (cpu_caps)."""

from __future__ import annotations

import pytest
import torch

from srt_lite import cpu_caps
from srt_lite import cpu_kernels
from srt_lite.layers.cpu_linear.paths import bf16_gemv_available
from srt_lite.layers.cpu_linear.products import packed_linear


pytestmark = pytest.mark.cpu_caps


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_kernels.load()  # CI's machine has the C++ compiler inductor's wrapper uses


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
