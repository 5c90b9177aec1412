"""N-gram speculative decoding's drafter alone (no model): the n-gram index, greedy
acceptance, the cost model that sizes a draft, acceptance learned per source, which requests
draft, where drafts come from, the shared table's bound, and the replay tool."""

from __future__ import annotations

import sys
from pathlib import Path

from srt_lite.req import Req
from srt_lite.sampling.sampling_params import SamplingParams
from srt_lite.speculative.ngram import PROBE_INTERVAL, AcceptStats, NgramIndex, NgramProposer, SharedNgramTable, accept_greedy


def test_index_finds_the_longest_latest_match_and_never_the_tail_itself():
    ix = NgramIndex(1, 3)
    # Tail (5, 6) occurred at 0..1 and was followed by 7, 8, 5, 6.
    assert ix.propose([5, 6, 7, 8, 5, 6], 4) == [7, 8, 5, 6]
    ix = NgramIndex(1, 3)
    assert ix.propose([1, 2, 3], 3) == []  # nothing repeats
    # The longer match (2, 9) wins over the more recent 1-gram (9).
    ix = NgramIndex(1, 2)
    assert ix.propose([2, 9, 4, 9, 5, 2, 9], 1) == [4]
    # Incremental: later calls index the new tokens only, and still see the old ones.
    ix = NgramIndex(1, 2)
    toks = [3, 4, 5]
    assert ix.propose(toks, 2) == []
    toks += [3]
    assert ix.propose(toks, 2) == [4, 5]


def test_index_holds_the_latest_end_of_every_ngram_before_the_last_position():
    """Grown in random pieces, the index equals a brute-force table: every n-gram
    (min_n <= n <= max_n) ending at a position before the last, mapped to its latest end."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        tokens = [rng.randint(0, 5) for _ in range(rng.randint(0, 50))]
        ix = NgramIndex(min_n, max_n)
        for cut in sorted(rng.sample(range(len(tokens) + 1), min(3, len(tokens) + 1))) + [len(tokens)]:
            ix.extend(tokens[:cut])
            want = {}
            for end in range(1, cut):
                for n in range(min_n, min(max_n, end) + 1):
                    want[tuple(tokens[end - n : end])] = end
            assert ix.ends == want


def test_a_loop_shorter_than_the_draft_is_copied_over_itself():
    assert NgramIndex(1, 3).propose([7, 1, 1, 1], 5) == [1, 1, 1, 1, 1]
    assert NgramIndex(1, 3).propose([7, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_accept_greedy_takes_the_matching_prefix_and_the_model_token_after_it():
    assert accept_greedy([7, 8, 9], [7, 8, 9, 10]) == [7, 8, 9, 10]
    assert accept_greedy([7, 8, 9], [7, 8, 4, 1]) == [7, 8, 4]
    assert accept_greedy([7, 8, 9], [5, 8, 9, 10]) == [5]
    assert accept_greedy([], [3]) == [3]


def test_cost_model_drafts_more_when_cheap_or_likely():
    p = NgramProposer(8, 1, 4)
    # A lone request: draft tokens are nearly free, so even a coin flip drafts several.
    assert p.num_worth_drafting(0.5, 0.5, 100, 1) >= 4
    assert p.num_worth_drafting(0.95, 0.95, 300, 1) == 8
    # Monotone: more with a higher acceptance rate, fewer with bigger batches and contexts.
    for b in (1, 8, 16, 64):
        ks = [p.num_worth_drafting(q, q, 300, b) for q in (0.1, 0.3, 0.5, 0.7, 0.9)]
        assert ks == sorted(ks)
        assert p.num_worth_drafting(0.5, 0.9, 300, b) >= p.num_worth_drafting(0.5, 0.5, 300, b)
    assert p.num_worth_drafting(0.5, 0.5, 300, 16) < p.num_worth_drafting(0.5, 0.5, 300, 1)
    assert p.num_worth_drafting(0.5, 0.5, 4000, 16) <= p.num_worth_drafting(0.5, 0.5, 300, 16)
    assert p.num_worth_drafting(0.1, 0.9, 1000, 16) == 0


def test_acceptance_is_learned_per_source_and_tail_length():
    """A kind of match whose drafts fail stops drafting in a busy batch (probing now and
    then) while another kind keeps drafting; the estimates follow the observed rates."""
    stats = AcceptStats()
    for _ in range(40):
        stats.observe(4, 1)  # first token always accepted, the second never
    first, later = stats.rates()
    assert first > 0.9 and later < 0.15
    p = NgramProposer(4, 1, 2)

    def req(prompt: list[int], output: list[int]) -> Req:
        r = Req("r", prompt, SamplingParams(max_new_tokens=50, temperature=0))
        r.output_ids = output
        return r

    for _ in range(10):  # prompt matches of length 2 fail (drafted alone, where it is cheap)...
        r = req([1, 2, 9, 1], [2])
        r.draft_ids = p.propose(r, room=10, batch_size=1)
        assert r.draft_ids
        p.observe(r, 0)
    assert p.stats[("prompt", 2)].rates()[0] < 0.2
    drafts = [len(p.propose(req([1, 2, 9, 1], [2]), room=10, batch_size=32)) for _ in range(PROBE_INTERVAL)]
    assert drafts == [0] * (PROBE_INTERVAL - 1) + [1]
    # ...while a request repeating its own output still drafts in the same batch.
    assert p.propose(req([5], [6, 7, 6, 7, 6]), room=10, batch_size=32)


def test_only_plain_greedy_requests_draft():
    p = NgramProposer(4, 1, 3)

    def req(**params) -> Req:
        r = Req("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_new_tokens=50, **params))
        r.output_ids = [3]
        return r

    assert p.propose(req(temperature=0), room=10, batch_size=1) == [1, 2, 3, 1]
    assert p.propose(req(temperature=0), room=2, batch_size=1) == [1, 2]
    for params in ({"temperature": 0.7}, {"temperature": 0, "frequency_penalty": 0.5},
                   {"temperature": 0, "repetition_penalty": 1.2}, {"temperature": 0, "min_new_tokens": 5}):
        assert p.propose(req(**params), room=10, batch_size=1) == []
    r = req(temperature=0)
    r.return_logprob = True
    assert p.propose(r, room=10, batch_size=1) == []


def test_drafts_come_from_own_output_then_other_requests_output_then_own_prompt():
    p = NgramProposer(4, 1, 2)

    def req(prompt: list[int], output: list[int]) -> Req:
        r = Req("r", prompt, SamplingParams(max_new_tokens=50, temperature=0))
        r.output_ids = output
        return r

    # Request a generated 7 8 9 after the prompt tail 5 6; its n-grams go to the shared table
    # as it decodes (propose indexes them), pointing into its live output list.
    a = req([1, 5, 6], [7, 8, 9])
    p.propose(a, room=10, batch_size=1)
    # b's tail 5 6 occurs in its own prompt (followed by 2) and in a's text (followed by 7 8 9):
    # another request's generated text beats a prompt match.
    b = req([5, 6, 2, 3, 5], [6])
    assert p.propose(b, room=10, batch_size=1) == [7, 8, 9]
    # a's continuation grows while a decodes.
    a.output_ids.append(10)
    assert p.propose(req([4, 5, 6, 0, 5], [6]), room=10, batch_size=1) == [7, 8, 9, 10]
    # The request's own generated text beats both.
    c = req([5, 6, 2], [5, 6, 4, 5, 6])
    assert p.propose(c, room=10, batch_size=1) == [4, 5, 6, 4]
    # With no shared match, a prompt match still drafts.
    assert p.propose(req([3, 1, 2, 3, 3], [1]), room=10, batch_size=1) == [2, 3, 3, 1]


def test_shared_table_is_bounded_and_never_drafts_a_request_from_itself():
    table = SharedNgramTable(1, 2, capacity=6)
    index = NgramIndex(1, 2)
    r = Req("r", [1, 2], SamplingParams(max_new_tokens=50, temperature=0))
    r.output_ids = [3, 4, 5, 6, 7]
    table.add(r, index, r.fill_ids)
    assert len(table.ends) <= 6
    assert table.match((6,), exclude=[]) == (r.output_ids, 4)  # the newest n-grams stay
    assert table.match((1, 2), exclude=[]) is None  # the oldest went first
    assert table.match((6,), exclude=r.output_ids) is None
    table.add(r, index, r.fill_ids)  # nothing new: indexing is incremental
    assert index.shared_indexed == 5


def test_replay_tool_measures_drafting_without_the_model():
    """benchmarks/replay_drafts.py: looping outputs yield several tokens per row and step, a
    request asked again after another yields its whole output in a few steps, and text that
    never repeats yields one token per step."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from replay_drafts import replay

    loop = ([1, 2, 3], [4, 5, 6] * 10)
    r = replay([loop], concurrency=1, proposer=NgramProposer(8, 1, 4))
    assert r["tokens_per_row_step"] > 3 and r["accepted"] <= r["drafted"]
    fresh = ([7, 8], list(range(100, 130)))
    alone = replay([fresh], concurrency=1, proposer=NgramProposer(8, 1, 4))
    assert alone["tokens_per_row_step"] == 1.0 and alone["accepted"] == 0
    again = replay([fresh, fresh], concurrency=1, proposer=NgramProposer(8, 1, 4))
    assert again["row_steps"] <= alone["row_steps"] + 5
