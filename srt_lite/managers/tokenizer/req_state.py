"""One request's state in the TokenizerManager, and the output dicts built from it.

The TokenizerManager appends what the detokenizer sends (`ReqState.apply`) and hands the
request's consumer the dicts `ReqState.output` builds: SGLang's `{"text", "output_ids",
"meta_info"}` layout, whole or as the part not yet sent.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from srt_lite.managers.io_struct import BatchStrOut
from srt_lite.managers.validation import NO_LOGPROBS, LogprobOptions

if TYPE_CHECKING:
    from srt_lite.managers.tokenizer.metrics import MetricsCollector

LOGPROB_KEYS = (
    "input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
    "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
)


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    created: float = field(default_factory=time.perf_counter)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    text_sent: int = 0  # characters already yielded (streaming)
    ids_sent: int = 0
    finished_reason: dict | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: dict[str, list] = field(default_factory=dict)
    logprobs_sent: dict[str, int] = field(default_factory=dict)
    # Wall-clock times for the metrics: comparable with the scheduler's stamps.
    created_wall: float = field(default_factory=time.time)
    last_tokens_wall: float | None = None
    itl_observed: bool = False
    queue_time: float | None = None
    first_token_time: float | None = None
    internal: bool = False  # the server's own request (n > 1 warm-up, health probe): not counted
    logprob_opts: LogprobOptions = NO_LOGPROBS
    embedding: list[float] | None = None  # an embedding request's vector, once computed

    def apply(self, msg: BatchStrOut, i: int, metrics: MetricsCollector | None) -> None:
        """Takes row i of a detokenizer message and wakes the request's consumer."""
        self.text += msg.texts[i]
        self.output_ids.extend(msg.new_ids[i])
        self.completion_tokens = msg.completion_tokens[i]
        self.cached_tokens = msg.cached_tokens[i]
        if msg.logprobs[i]:
            for key, values in msg.logprobs[i].items():
                self.logprobs.setdefault(key, []).extend(values)
        if metrics is not None and not self.internal:
            self._record_metrics(msg, i, metrics)
        if msg.embeddings and msg.embeddings[i] is not None:
            self.embedding = msg.embeddings[i]
        if msg.finished_reasons[i] is not None:
            self.finished_reason = msg.finished_reasons[i]
        self.event.set()

    def finish_with_abort(self, message: str) -> None:
        """Ends a request that can no longer be served (a child process died)."""
        if self.finished_reason is None:
            self.finished_reason = {"type": "abort", "matched": None, "message": message}
            self.event.set()

    def _record_metrics(self, msg: BatchStrOut, i: int, metrics: MetricsCollector) -> None:
        if msg.queue_times:
            self.queue_time = msg.queue_times[i]
            self.first_token_time = msg.first_token_times[i]
        now = time.time()
        n_new = len(msg.new_ids[i])
        if n_new and self.last_tokens_wall is not None:
            metrics.on_stream_tokens(now - self.last_tokens_wall, n_new)
            self.itl_observed = True
        if n_new:
            self.last_tokens_wall = now
        finished = msg.finished_reasons[i]
        if finished is not None:
            metrics.on_finish(
                created_wall=self.created_wall,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                cached_tokens=self.cached_tokens,
                aborted=finished.get("type") == "abort",
                queue_time=self.queue_time,
                first_token_time=self.first_token_time,
                itl_observed=self.itl_observed,
            )

    def output(self, incremental: bool, tokenizer: Any) -> dict:
        """The whole result so far, or (incremental) only what the last call did not return."""
        if incremental:
            text, ids = self.text[self.text_sent :], self.output_ids[self.ids_sent :]
            self.text_sent, self.ids_sent = len(self.text), len(self.output_ids)
        else:
            text, ids = self.text, list(self.output_ids)
        meta = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finished_reason,
            "e2e_latency": time.perf_counter() - self.created,
        }
        if self.logprob_opts.return_logprob:
            meta.update(self._logprob_fields(incremental, tokenizer))
        if self.embedding is not None:
            meta["embedding"] = self.embedding
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _logprob_fields(self, incremental: bool, tokenizer: Any) -> dict[str, list]:
        """SGLang's layout: entries are (logprob, token_id, text or None); top / token-id
        entries are lists of those (or None where a position has none)."""
        with_text = self.logprob_opts.return_text_in_logprobs

        def entry(pair: list) -> tuple:
            logprob, tid = pair
            return (logprob, tid, tokenizer.decode([tid]) if with_text else None)

        out = {}
        for key in LOGPROB_KEYS:
            values = self.logprobs.get(key, [])
            if incremental:
                start = self.logprobs_sent.get(key, 0)
                self.logprobs_sent[key] = len(values)
                values = values[start:]
            if key.endswith("token_logprobs"):
                out[key] = [entry(e) for e in values]
            else:
                out[key] = [None if e is None else [entry(x) for x in e] for e in values]
        return out
