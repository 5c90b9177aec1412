"""The n choices of a request: how one prompt becomes n samples, and how their outputs are
merged back into one stream.

Both the OpenAI endpoints and the native /generate (and the Engine) run their choices through
`TokenizerManager.generate_choices`, which is built from the two pieces here.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import AsyncIterator, Sequence, TypeVar

from srt_lite.sampling.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class Choice:
    """One sample to generate: a prompt with parameters for exactly one completion."""

    input_ids: list[int]
    params: SamplingParams
    rid: str | None


def split_choices(
    prompts: Sequence[list[int]], params: Sequence[SamplingParams], rids: Sequence[str | None] | None = None,
    default_seed: int | None = None,
) -> list[Choice]:
    """Prompt j's `params[j].n` choices, prompt after prompt. With a seed, choice i of a prompt
    samples with seed + i, so the choices differ and each is reproducible; a prompt without
    one takes `default_seed` when given (deterministic inference). `rids` names each
    choice (one entry per choice, not per prompt); None lets the manager pick ids."""
    choices = []
    for ids, p in zip(prompts, params, strict=True):
        seed = default_seed if p.seed is None else p.seed
        for i in range(p.n):
            one = dataclasses.replace(p, n=1, seed=None if seed is None else seed + i)
            choices.append(Choice(ids, one, None))
    if rids is not None:
        if len(rids) != len(choices):
            raise ValueError(f"{len(rids)} rids for {len(choices)} choices")
        choices = [dataclasses.replace(c, rid=r) for c, r in zip(choices, rids)]
    return choices


def numbered_rids(rid: str | None, count: int) -> list[str | None] | None:
    """The ids of `count` choices asked for under one client rid: the rid itself for a single
    choice, else rid-0, rid-1, ... (ids must be unique while in flight)."""
    if rid is None:
        return None
    return [rid] if count == 1 else [f"{rid}-{k}" for k in range(count)]


_DONE = object()


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) for the items of every stream, in the order they arrive.

    An error in one stream ends the merge with that error. Ending the merge early (the
    consumer closed it, or an error) cancels and closes every stream, so for request streams
    each unfinished request is aborted.
    """
    if len(streams) == 1:  # no tasks needed for a single stream
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, _DONE, None))
        except Exception as e:  # noqa: BLE001 - re-raised to the consumer
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _DONE:
                remaining -= 1
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        # A stream can only be closed once its pump has let go of it.
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
