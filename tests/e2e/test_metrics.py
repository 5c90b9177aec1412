"""/metrics (--enable-metrics): after a known workload the counters and histograms hold the
expected counts, the prefix cache hit rate is positive after repeated prompts, and the
scheduler's gauges are read across the process boundary."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_utils import ServerProcess

MODEL = "m"


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--enable-metrics", "--served-model-name", MODEL, "--max-total-tokens", "4096") as s:
        yield s


def scrape(server) -> dict[str, float]:
    r = httpx.get(server.base_url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name.startswith("srt_lite:"):
                assert sample.labels.get("model_name") == MODEL, sample
                if "le" not in sample.labels:
                    values[sample.name] = sample.value
    return values


def test_metrics_after_known_workload(server):
    before = scrape(server)
    assert before["srt_lite:num_requests_total"] == 0 and before["srt_lite:max_total_num_tokens"] == 4096
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    usages = []
    for _ in range(3):  # repeats: the 2nd and 3rd hit the prefix cache
        usages.append(httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).json()["usage"])
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    # Streamed in pieces and ended; not a chunk per token: tokens decoded faster than they
    # are sent go out together (as OpenAI's API allows), and a partial character waits.
    assert sum(1 for line in lines if line.startswith("data: {")) >= 2 and lines[-1] == "data: [DONE]"
    two = httpx.post(server.base_url + "/v1/completions", json={**body, "n": 2, "temperature": 1.0}, timeout=60).json()
    assert len(two["choices"]) == 2
    prompt_len = usages[0]["prompt_tokens"]

    m = scrape(server)
    requests = 3 + 1 + 2  # n=2 counts as two requests; its prefill warm-up is not counted
    assert m["srt_lite:num_requests_total"] == requests
    assert m["srt_lite:prompt_tokens_total"] == requests * prompt_len
    assert m["srt_lite:generation_tokens_total"] == requests * 6
    assert m["srt_lite:cached_tokens_total"] >= 2 * (prompt_len - 1)
    assert 0 < m["srt_lite:cache_hit_rate"] < 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "queue_time_seconds"):
        assert m[f"srt_lite:{name}_count"] == requests, name
        assert m[f"srt_lite:{name}_sum"] > 0, name
    assert m["srt_lite:inter_token_latency_seconds_count"] == requests * 5  # 6 tokens, 5 gaps each
    assert m["srt_lite:num_running_reqs"] == 0 and m["srt_lite:num_queue_reqs"] == 0
    assert m["srt_lite:num_used_tokens"] == 0 and m["srt_lite:token_usage"] == 0
    assert m["srt_lite:num_aborted_requests_total"] == 0
