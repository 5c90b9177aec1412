"""The n-choice fan-out pieces on their own (no server): how a prompt becomes n choices, and
how their streams merge and close."""

from __future__ import annotations

import asyncio

import pytest

from srt_lite.managers.tokenizer.choices import merge_streams, numbered_rids, split_choices
from srt_lite.sampling.sampling_params import SamplingParams


def test_split_choices_numbers_prompt_after_prompt_with_seed_offsets():
    a, b = [1, 2], [3]
    pa = SamplingParams.from_dict({"n": 3, "seed": 10, "max_new_tokens": 5})
    pb = SamplingParams.from_dict({"n": 1, "max_new_tokens": 7})
    choices = split_choices([a, b], [pa, pb])
    assert [c.input_ids for c in choices] == [a, a, a, b]
    assert [c.params.seed for c in choices] == [10, 11, 12, None]
    assert all(c.params.n == 1 for c in choices)
    assert [c.params.max_new_tokens for c in choices] == [5, 5, 5, 7]
    assert [c.rid for c in choices] == [None] * 4
    assert pa.n == 3 and pa.seed == 10  # the caller's params are left alone


def test_split_choices_takes_one_rid_per_choice():
    p = SamplingParams.from_dict({"n": 2})
    choices = split_choices([[1], [2]], [p, p], ["a", "b", "c", "d"])
    assert [(c.input_ids, c.rid) for c in choices] == [([1], "a"), ([1], "b"), ([2], "c"), ([2], "d")]
    with pytest.raises(ValueError):
        split_choices([[1]], [p], ["only-one"])


def test_numbered_rids():
    assert numbered_rids(None, 3) is None
    assert numbered_rids("r", 1) == ["r"]
    assert numbered_rids("r", 3) == ["r-0", "r-1", "r-2"]


class Source:
    """An async stream that records whether it was closed before its end."""

    def __init__(self, items: list, delay: float = 0.0, fail_after: int | None = None):
        self.items, self.delay, self.fail_after = items, delay, fail_after
        self.finished = self.closed_early = False

    async def gen(self):
        try:
            for k, item in enumerate(self.items):
                if self.fail_after is not None and k == self.fail_after:
                    raise RuntimeError("boom")
                await asyncio.sleep(self.delay)
                yield item
            self.finished = True
        finally:
            if not self.finished:
                self.closed_early = True


def collect(sources: list[Source]) -> list[tuple[int, object]]:
    async def main():
        return [x async for x in merge_streams([s.gen() for s in sources])]

    return asyncio.run(main())


def test_merge_tags_every_item_with_its_stream_and_keeps_each_streams_order():
    sources = [Source(["a0", "a1", "a2"], 0.003), Source(["b0", "b1"], 0.001), Source([])]
    out = collect(sources)
    assert sorted(out) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    for i in (0, 1):
        assert [item for j, item in out if j == i] == sources[i].items
    assert all(s.finished for s in sources)


def test_merge_of_one_stream():
    s = Source(["x", "y"])
    assert collect([s]) == [(0, "x"), (0, "y")]


def test_an_error_ends_the_merge_and_closes_the_other_streams():
    slow, failing = Source(list(range(100)), 0.01), Source(["a", "b"], 0.001, fail_after=1)
    with pytest.raises(RuntimeError, match="boom"):
        collect([slow, failing])
    assert slow.closed_early and not slow.finished


@pytest.mark.parametrize("count", [1, 3])
def test_closing_the_merge_early_closes_every_stream(count):
    sources = [Source(list(range(100)), 0.005) for _ in range(count)]

    async def main():
        merged = merge_streams([s.gen() for s in sources])
        first = await merged.__anext__()
        await merged.aclose()  # raises if a stream could not be closed
        return first

    assert asyncio.run(main())[1] == 0
    assert all(s.closed_early for s in sources)
