"""A 2-minute soak (benchmarks/soak.py) in the suite: mixed traffic with intended aborts ends
with zero errors, every request kind exercised, KV back to idle and bounded RSS growth.
The 30-minute run quoted in docs/benchmarks.md is the same script with --duration 1800."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from server_utils import ServerProcess

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
KINDS = {"chat", "chat_stream_stop", "completion_n", "completion_stream_logprobs", "generate"}


@pytest.mark.slow
def test_two_minute_soak(tmp_path):
    out = tmp_path / "soak.json"
    with ServerProcess("--max-total-tokens", "2048", warmup=True) as s:
        r = subprocess.run(
            [sys.executable, str(SOAK), "--base-url", s.base_url, "--duration", "120", "--concurrency", "4",
             "--sample-interval", "5", "--warmup", "20", "--server-pid", str(s.proc.pid), "--output-file", str(out)],
            capture_output=True, text=True, timeout=300,
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["errors"] == 0
    assert set(report["requests"]) == KINDS and min(report["requests"].values()) > 0
    assert report["intended_aborts"] > 0
    assert report["kv_used_tokens_at_end"] == 0
    # Drift counts from the first sample after 20 s with the KV cache full (the buffers are
    # allocated untouched, so filling them raises RSS by design); the cache must fill early.
    assert report["rss_mb"]["baseline_at_s"] <= 60, report["rss_mb"]
    assert report["rss_mb"]["drift"] < 48, report["rss_mb"]
