"""benchmarks/replay_steps.py: recorded steps replayed in one process, variants interleaved."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import replay_steps  # noqa: E402

from srt_lite.managers.scheduler.tp_worker import TpModelWorker  # noqa: E402


def test_recorded_steps_replay_once_per_variant_in_rotating_order(tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    recorder = SimpleNamespace(record_steps=str(path))
    # What the worker writes for a prefill, a mixed step and a verify step.
    steps = [([0], [40], 12.5), ([40, 32], [1, 6], 8.0), ([41, 38], [3, 2], 7.25)]
    for prefix, ext, ms in steps:
        TpModelWorker._record_step(recorder, prefix, ext, ms / 1e3)
    assert replay_steps.load_steps(str(path)) == [tuple(s) for s in steps]
    assert replay_steps.load_steps(str(path), skip=1) == [tuple(s) for s in steps[1:]]

    monkeypatch.setattr(replay_steps, "SHARED_PREFIX", 32)  # rows share their first 32 slots
    loaded = replay_steps.load_steps(str(path))
    runner, rows = replay_steps.build_runner(loaded, None, compile_=False)
    r2t = runner.req_to_token_pool.req_to_token
    assert len(rows) == 2 and r2t[rows[0], :32].tolist() == r2t[rows[1], :32].tolist()
    assert r2t[rows[0], 32:46].tolist() != r2t[rows[1], 32:46].tolist()

    order = []
    forward = runner.forward
    active = []

    def counting_forward(fb):
        order.append((active[-1], fb.extend_seq_lens_cpu))
        return forward(fb)

    monkeypatch.setattr(runner, "forward", counting_forward)
    variants = {"a": lambda: active.append("a"), "b": lambda: active.append("b")}
    totals, per_step = replay_steps.replay(runner, rows, loaded, passes=2, variants=variants)
    assert {k: len(v) for k, v in totals.items()} == {"a": 2, "b": 2}
    assert all(t > 0 for v in totals.values() for t in v) and len(per_step["a"]) == 3
    # One untimed pass per variant, then every step once per variant, the order rotating.
    timed = order[6:]
    assert [name for name, _ in timed] == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert [ext for _, ext in timed[::2]] == [[40], [1, 6], [3, 2]] * 2
