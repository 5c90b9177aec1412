"""The batched sampler against per-row reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from srt_lite import cpu_kernels
from srt_lite.req import Req
from srt_lite.sampling.penalties import apply_penalties
from srt_lite.sampling.sampler import (
    ARGMAX_BLOCK,
    LogprobRequest,
    Sampler,
    greedy_argmax,
    top_k_top_p_candidates,
    top_k_top_p_filter,
)
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo
from srt_lite.sampling.sampling_params import SamplingParams

V = 1000


def make_req(i: int, output_ids=(), prompt=(5, 6, 7), **params) -> Req:
    req = Req(f"r{i}", list(prompt), SamplingParams.from_dict(params))
    req.output_ids = list(output_ids)
    return req


def reference_top_k_top_p_row(p: torch.Tensor, k: int, top_p: float) -> torch.Tensor:
    """One row, written out step by step."""
    order = torch.argsort(p, descending=True, stable=True)
    out = torch.zeros_like(p)
    kept = []
    for rank, idx in enumerate(order.tolist()):
        if rank >= k:
            break
        kept.append(idx)
    total = sum(p[i].item() for i in kept)
    mass = 0.0
    final = []
    for idx in kept:
        if final and mass > top_p * total + 1e-12:
            break
        final.append(idx)
        mass += p[idx].item()
    out[final] = p[final]
    return out


def test_batched_top_k_top_p_equals_row_by_row():
    g = torch.Generator().manual_seed(0)
    B = 12
    probs = torch.softmax(torch.randn(B, V, generator=g) * 3, dim=-1)
    ks = torch.tensor([1, 5, 50, V, V, 20, 3, V, 7, 100, V, 2])
    ps = torch.tensor([1.0, 0.9, 0.5, 0.8, 1.0, 0.3, 0.99, 0.05, 1.0, 0.7, 0.95, 0.6])
    got = top_k_top_p_filter(probs, ks, ps)
    for b in range(B):
        ref = reference_top_k_top_p_row(probs[b], int(ks[b]), float(ps[b]))
        assert torch.equal(got[b] > 0, ref > 0), b
        assert torch.equal(got[b], ref), b


def test_candidate_path_equals_row_by_row_where_it_claims_exactness():
    g = torch.Generator().manual_seed(1)
    B = 10
    probs = torch.softmax(torch.randn(B, V, generator=g) * torch.tensor([[4.0]] * 5 + [[0.3]] * 5), dim=-1)
    ks = torch.tensor([5, V, 50, V, 999, V, 3, V, 600, V])
    ps = torch.tensor([0.9, 0.8, 1.0, 0.5, 0.95, 0.9, 1.0, 0.99, 0.4, 0.2])
    vals, idx, ok = top_k_top_p_candidates(probs, ks, ps, k=200)
    for b in range(B):
        ref = reference_top_k_top_p_row(probs[b], int(ks[b]), float(ps[b]))
        if not ok[b]:
            assert (ref > 0).sum() > 200 or ks[b] > 200  # it only declines rows it cannot do
            continue
        got = torch.zeros(V)
        got[idx[b]] = vals[b]
        assert torch.equal(got > 0, ref > 0), b
    assert ok[:4].all()  # peaked rows fit in 200 candidates
    assert not ok[4]  # top_k 999 > 200: its top-k mass needs the full sort
    assert not ok[5]  # a flat row's 90% nucleus does not


def test_exponential_race_matches_probabilities():
    p = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 200_000
    probs = p.expand(n, -1).contiguous()
    q = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(1))
    picks = (probs / q).argmax(-1)
    freq = torch.bincount(picks, minlength=5).float() / n
    assert (freq - p).abs().max().item() < 0.01


@pytest.fixture(params=["cpp-op", "torch-race"])
def sampling_path(request, monkeypatch) -> str:
    """Each sampler test on both ways of drawing: the C++ op, and the torch ops (GPUs, or a
    CPU without the C++ ops)."""
    if request.param == "cpp-op":
        assert cpu_kernels.load(), "the C++ ops did not build"
    else:
        monkeypatch.setattr(cpu_kernels, "eager_cpu", lambda x: False)
    return request.param


def filtered_reference(x: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row's sampling distribution, step by step: softmax(x / T), min-p, top-k / top-p."""
    p = torch.softmax(x.double() / temperature, -1)
    p = torch.where(p < min_p * p.max(), 0.0, p)
    p = reference_top_k_top_p_row(p, top_k, top_p)
    return p / p.sum()


@pytest.mark.cpu_caps  # the C++ ops at this CPU's vector width, and again at AVX2's
@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 0, 1.0, 0.0), (0.5, 10, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.8, 50, 0.6, 0.0), (1.0, 0, 1.0, 0.1),
     (2.0, 0, 0.9, 0.02), (1.0, 100, 1.0, 0.0), (1.0, 0, 0.9, 0.0)],
)
def test_cpp_sampling_draws_each_kept_token_by_its_filtered_probability(temperature, top_k, top_p, min_p):
    """With u on an even grid, the inverse of the kept mass gives each token a share of the
    grid equal to its probability (within a grid step): exact, not statistical. The last two
    rows have a peak and a long tail below the op's first gathering threshold, so that the
    top-k set and the nucleus are only found on a lower one."""
    assert cpu_kernels.load(), "the C++ ops did not build"
    vocab, n = 5000, 20_000
    x = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    if top_k == 100 or (top_p == 0.9 and temperature == 1.0):
        x = torch.full((vocab,), -8.0)  # e^-8 of the peak each: below 2^-10, 1.3x its mass together
        x[17] = 0.0
    want = filtered_reference(x, temperature, top_k or vocab, top_p, min_p)
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    ids = torch.ops.srt_lite_cpu.sample_rows(
        x[None].expand(n, vocab), torch.full((n,), temperature), torch.full((n,), top_k or vocab, dtype=torch.int64),
        torch.full((n,), top_p), torch.full((n,), min_p), u,
    )
    freq = torch.bincount(ids, minlength=vocab).double() / n
    assert set(ids.unique().tolist()) <= set(want.nonzero().flatten().tolist())
    assert (freq - want).abs().max().item() <= 1.5 / n


@pytest.mark.cpu_caps  # the C++ ops at this CPU's vector width, and again at AVX2's
def test_sampler_uses_probabilities_through_the_full_path(sampling_path):
    """Temperature 1, no filters: token frequencies over many rows follow softmax(logits)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(50_000, -1).contiguous()
    reqs = [make_req(i, temperature=1.0) for i in range(1)]
    info = SamplingBatchInfo.from_reqs(reqs * 50_000, 4, "cpu", set())
    ids = Sampler(0, "cpu")(logits, info).next_ids
    freq = torch.bincount(ids, minlength=4).float() / len(ids)
    assert (freq - torch.softmax(logits[0], -1)).abs().max().item() < 0.01


def test_penalties_match_reference_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0, 0.0]])
    prompt = torch.tensor([[False, False, False, True, True]])
    out = logits.clone()
    apply_penalties(out, counts, prompt, torch.tensor([[1.5]]), torch.tensor([[0.3]]), torch.tensor([[0.2]]))
    expected = [
        2.0 / 1.5 - 0.3 * 2 - 0.2,  # in output, positive: divided; 2 occurrences
        -1.0 * 1.5 - 0.3 * 1 - 0.2,  # in output, negative: multiplied
        0.5,  # never seen
        3.0 / 1.5,  # prompt only: repetition, no frequency/presence
        -2.0 * 1.5,
    ]
    assert torch.allclose(out[0], torch.tensor(expected))


def test_penalty_counts_are_incremental_and_follow_filter_merge():
    a = make_req(0, output_ids=[1, 1, 2], frequency_penalty=0.5)
    b = make_req(1, output_ids=[3], temperature=0)
    info = SamplingBatchInfo.from_reqs([a, b], V, "cpu", set())
    assert info.output_counts[0, 1] == 2 and info.output_counts[1, 3] == 1
    info.update(torch.tensor([1, 4]))
    assert info.output_counts[0, 1] == 3 and info.output_counts[1, 4] == 1
    c = make_req(2, output_ids=[9], presence_penalty=1.0, logit_bias={"7": 5.0})
    other = SamplingBatchInfo.from_reqs([c], V, "cpu", set())
    info.merge(other)
    assert info.batch_size == 3 and info.logit_bias == [None, None, ([7], [5.0])]
    info.filter([2, 0])
    assert info.output_counts[0, 9] == 1 and info.output_counts[1, 1] == 3
    assert info.pres_penalties[0, 0] == 1.0 and info.freq_penalties[1, 0] == 0.5
    assert info.logit_bias == [([7], [5.0]), None]
    rows, ids, vals = info.repeat_rows([1, 3]).logit_bias_index()
    assert rows.tolist() == [0] and ids.tolist() == [7] and vals.tolist() == [5.0]
    rows, ids, vals = info.repeat_rows([2, 1]).logit_bias_index()
    assert rows.tolist() == [0, 1] and ids.tolist() == [7, 7]
    info.filter([1])
    assert info.logit_bias is None


@pytest.mark.cpu_caps  # the C++ ops at this CPU's vector width, and again at AVX2's
@pytest.mark.parametrize("with_ops", [True, False], ids=["cpp-op", "torch-blocks"])
def test_greedy_argmax_equals_argmax_with_ties_and_a_short_last_block(with_ops, monkeypatch):
    if with_ops:
        assert cpu_kernels.load(), "the C++ ops did not build"
    else:
        monkeypatch.setattr(cpu_kernels, "eager_cpu", lambda x: False)
    g = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 49152), (7, 5000), (33, 49152), (4, ARGMAX_BLOCK * 4 + 1), (2, 1), (3, 17), (2, 128256)]:
        # bf16-rounded values: many exact ties between blocks and within one.
        x = torch.randn(rows, vocab, generator=g).bfloat16().float()
        assert torch.equal(greedy_argmax(x), x.argmax(-1))
        x = torch.randint(0, 3, (rows, vocab), generator=g).float()  # ties everywhere
        assert torch.equal(greedy_argmax(x), x.argmax(-1))
    x = torch.zeros(7, 5000)
    x[1, [10, 3000]] = 1.0  # tie across blocks: the first
    x[2, 4999] = 2.0  # in the short last block, at its last column
    x[3, [ARGMAX_BLOCK - 1, ARGMAX_BLOCK]] = 7.0  # tie at a block boundary
    x[4] = float("-inf")
    x[5, 4100:] = 3.0  # a tie filling the short last block
    x[6, 4000] = float("inf")
    assert greedy_argmax(x).tolist() == x.argmax(-1).tolist() == [0, 10, 4999, ARGMAX_BLOCK - 1, 0, 4100, 4000]
    assert greedy_argmax(x[:, ::2]).tolist() == x[:, ::2].argmax(-1).tolist()  # strided: plain argmax


@pytest.mark.cpu_caps  # the C++ ops at this CPU's vector width, and again at AVX2's
def test_the_cpp_greedy_pick_takes_the_first_nan_as_argmax_does():
    assert cpu_kernels.load(), "the C++ ops did not build"
    x = torch.randn(3, 70000, generator=torch.Generator().manual_seed(1))
    x[0, [9, 40000]] = float("nan")  # two NaN: the first, in the first block
    x[1, 65000] = float("nan")  # a NaN after the row's maximum
    x[1, 3] = 100.0
    assert greedy_argmax(x).tolist() == x.argmax(-1).tolist() == [9, 65000, int(x[2].argmax())]


def test_logit_bias_forces_and_forbids_without_touching_others():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g)
    reqs = [
        make_req(0, temperature=0, logit_bias={"42": 100}),
        make_req(1, temperature=0, logit_bias={str(int(logits[1].argmax())): -100}),
        make_req(2, temperature=0),
    ]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu", set())
    ids = Sampler(0, "cpu")(logits, info).next_ids.tolist()
    assert ids[0] == 42
    assert ids[1] != int(logits[1].argmax()) and ids[1] == int(logits[1].topk(2).indices[1])
    assert ids[2] == int(logits[2].argmax())


def test_min_new_tokens_bans_eos_until_reached():
    logits = torch.zeros(1, V)
    logits[0, 2] = 10.0  # EOS is by far the best token
    req = make_req(0, temperature=0, min_new_tokens=2)
    info = SamplingBatchInfo.from_reqs([req], V, "cpu", {2})
    sampler = Sampler(0, "cpu")
    assert sampler(logits, info).next_ids.item() != 2
    info.update(torch.tensor([5]))
    assert sampler(logits, info).next_ids.item() != 2
    info.update(torch.tensor([5]))
    assert sampler(logits, info).next_ids.item() == 2


@pytest.mark.cpu_caps  # the C++ ops at this CPU's vector width, and again at AVX2's
def test_seeded_rows_do_not_depend_on_batch_neighbours(sampling_path):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, V, generator=g)

    def seeded_req():
        r = make_req(0, temperature=1.0, seed=1234)
        r.generator = torch.Generator().manual_seed(1234)
        return r

    alone = [Sampler(0, "cpu")(logits[:1], SamplingBatchInfo.from_reqs([seeded_req()], V, "cpu", set())).next_ids.item()]
    r2 = seeded_req()
    batch = [r2, make_req(1, temperature=1.0), make_req(2, temperature=0.7), make_req(3, temperature=1.0)]
    info = SamplingBatchInfo.from_reqs(batch, V, "cpu", set())
    together = Sampler(99, "cpu")(logits, info).next_ids[0].item()
    assert together == alone[0]


def test_a_chunk_short_of_the_prompt_end_draws_no_seeded_noise(sampling_path):
    """The token sampled after a partial prompt chunk is dropped; a seeded request's own
    generator must not advance for it, or its output would depend on the chunking."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(6))
    mid, last = make_req(0, temperature=1.0, prompt=range(10)), make_req(1, temperature=1.0, prompt=range(10))
    mid.generator, last.generator = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    mid.extend_len, last.kv_len, last.extend_len = 4, 4, 6  # the first chunk; the last one
    Sampler(0, "cpu")(logits, SamplingBatchInfo.from_reqs([mid, last], V, "cpu", set()))
    assert mid.generator.get_state().equal(torch.Generator().manual_seed(9).get_state())
    assert not last.generator.get_state().equal(torch.Generator().manual_seed(9).get_state())


def test_greedy_top1_logprob_is_the_sampled_token():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, V, generator=g)
    reqs = [make_req(0, temperature=0), make_req(1, temperature=0, repetition_penalty=1.3)]
    info = SamplingBatchInfo.from_reqs(reqs, V, "cpu", set())
    out = Sampler(0, "cpu")(logits, info, LogprobRequest([0, 1], [3, 2], [[1, 2], None]))
    ref = torch.log_softmax(logits, -1)
    chosen, top, by_id = out.logprobs[0]
    assert top[0][1] == out.next_ids[0].item()
    assert math.isclose(chosen, ref[0].max().item(), rel_tol=1e-6)
    assert [t for _, t in top] == ref[0].topk(3).indices.tolist()
    assert [t for _, t in by_id] == [1, 2] and math.isclose(by_id[1][0], ref[0, 2].item(), rel_tol=1e-6)
    # Logprobs are the raw model distribution even when a penalty changed the choice.
    assert math.isclose(out.logprobs[1][0], ref[1, out.next_ids[1]].item(), rel_tol=1e-6)
    assert len(out.logprobs[1][1]) == 2 and out.logprobs[1][2] is None


@pytest.mark.cpu_caps  # the C++ ops at this CPU's vector width, and again at AVX2's
def test_min_p_drops_unlikely_tokens(sampling_path):
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(20_000, -1).contiguous()
    reqs = [make_req(0, temperature=1.0, min_p=0.2)] * 20_000
    info = SamplingBatchInfo.from_reqs(reqs, 4, "cpu", set())
    ids = Sampler(0, "cpu")(logits, info).next_ids
    # 0.15 < 0.2 * 0.5 is false (0.15 >= 0.1) so token 2 stays; 0.05 < 0.1 goes.
    assert (ids == 3).sum() == 0 and (ids == 2).sum() > 0
