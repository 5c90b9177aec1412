"""The running batch: requests that decode every step, with their sampling rows kept aligned.

The batch keeps one SamplingBatchInfo for its whole life (penalty counts and other state
grow incrementally), so adding and removing requests must add and drop the same rows.
"""

from __future__ import annotations

from typing import Iterator

from srt_lite.req import Req
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo


class RunningBatch:
    def __init__(self) -> None:
        self.reqs: list[Req] = []
        self.info: SamplingBatchInfo | None = None  # row i belongs to reqs[i]

    def __len__(self) -> int:
        return len(self.reqs)

    def __bool__(self) -> bool:
        return bool(self.reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self.reqs)

    def add(self, reqs: list[Req], info: SamplingBatchInfo) -> None:
        """Appends newly prefilled requests; `info` holds exactly their rows."""
        self.reqs.extend(reqs)
        if self.info is None:
            self.info = info
        else:
            self.info.merge(info)

    def remove(self, reqs: list[Req]) -> None:
        gone = {id(r) for r in reqs}
        keep = [i for i, r in enumerate(self.reqs) if id(r) not in gone]
        if len(keep) == len(self.reqs):
            return
        self.reqs = [self.reqs[i] for i in keep]
        if not keep:
            self.info = None
        else:
            self.info.filter(keep)
