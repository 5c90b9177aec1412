"""Prometheus metrics (`--enable-metrics`, served at /metrics), in SGLang's naming style.

Everything lives in the TokenizerManager's process, in one registry of its own, so no
multi-process collection is needed and nothing is double counted:
- request metrics (token counters, TTFT, inter-token and end-to-end latency, queue time) are
  recorded from the outputs each request receives; the scheduler stamps its outputs with the
  request's queue time and the wall-clock time of its first token, so non-streaming requests
  (whose tokens arrive all at once) are measured like streaming ones;
- scheduler state (running and queued requests, KV usage, generation throughput) is asked
  from the scheduler (GetLoadReq) at scrape time, so it is as fresh as the scrape.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from srt_lite.managers.io_struct import GetLoadReqOutput

PREFIX = "srt_lite:"
# Buckets in seconds, from SGLang's defaults for the same metrics.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)


class MetricsCollector:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name}
        names = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, names, registry=self.registry).labels(**self.labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=self.registry).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=buckets, registry=self.registry).labels(**self.labels)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens served from the prefix cache.")
        self.num_requests = counter("num_requests", "Finished requests (any finish reason).")
        self.num_aborted = counter("num_aborted_requests", "Requests that ended with finish_reason abort.")
        self.num_running = gauge("num_running_reqs", "Requests in the running batch.")
        self.num_queue = gauge("num_queue_reqs", "Requests waiting to be scheduled.")
        self.num_used_tokens = gauge("num_used_tokens", "KV cache tokens held by requests.")
        self.max_total_tokens = gauge("max_total_num_tokens", "KV cache capacity in tokens.")
        self.token_usage = gauge("token_usage", "Share of the KV cache held by requests (0-1).")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prefix cache hit rate since start: cached / prompt tokens.")
        self.gen_throughput = gauge("gen_throughput", "Generation throughput of recent decode steps (token/s).")
        self.spec_accept_length = gauge(
            "spec_accept_length",
            "Speculative decoding: mean tokens per request-step that verified drafts, since start (0: none yet).",
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", E2E_BUCKETS)
        self.queue_time = histogram("queue_time_seconds", "Time from arrival at the scheduler to first scheduling.", E2E_BUCKETS)
        self._prompt_total = 0
        self._cached_total = 0

    def on_stream_tokens(self, gap: float, num_tokens: int) -> None:
        """A streaming request received num_tokens more tokens `gap` s after the previous ones."""
        for _ in range(num_tokens):
            self.itl.observe(gap / num_tokens)

    def on_finish(
        self,
        *,
        created_wall: float,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        aborted: bool,
        queue_time: float | None,
        first_token_time: float | None,
        itl_observed: bool,
    ) -> None:
        now = time.time()
        self.num_requests.inc()
        if aborted:
            self.num_aborted.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.cached_tokens.inc(cached_tokens)
        self._prompt_total += prompt_tokens
        self._cached_total += cached_tokens
        self.e2e.observe(now - created_wall)
        if queue_time is not None:
            self.queue_time.observe(queue_time)
        if first_token_time is not None:
            self.ttft.observe(max(first_token_time - created_wall, 0.0))
            if not itl_observed and completion_tokens > 1:
                # Tokens arrived together (not streamed): their mean spacing stands for each gap.
                gap = (now - first_token_time) / (completion_tokens - 1)
                for _ in range(completion_tokens - 1):
                    self.itl.observe(gap)

    def render(self, load: "GetLoadReqOutput") -> tuple[bytes, str]:
        """The exposition text with scheduler gauges refreshed from `load`."""
        self.num_running.set(load.num_running_reqs)
        self.num_queue.set(load.num_waiting_reqs)
        self.num_used_tokens.set(load.kv_used_tokens)
        self.max_total_tokens.set(load.kv_capacity)
        self.token_usage.set(load.kv_used_tokens / max(load.kv_capacity, 1))
        self.gen_throughput.set(load.gen_throughput)
        rows = load.spec_verified_rows
        self.spec_accept_length.set(load.spec_new_tokens / rows if rows else 0.0)
        self.cache_hit_rate.set(self._cached_total / self._prompt_total if self._prompt_total else 0.0)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
