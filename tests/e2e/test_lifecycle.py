"""Process lifecycle: ready before serving, clean stop on signals, a dead child takes the
server down, and nothing (process or socket file) is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from server_utils import ServerProcess

ARGS = ("--max-total-tokens", "2048")


def assert_gone(procs: list[psutil.Process], ipc_dir: str | None) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=5)
    assert not alive, f"left behind: {[p.pid for p in alive]}"
    if ipc_dir:
        assert not os.path.exists(ipc_dir)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_everything_within_5s(sig):
    with ServerProcess(*ARGS) as s:
        children = s.children()
        titles = sorted(p.name() if p.name().startswith("srt_lite") else " ".join(p.cmdline()) for p in children)
        assert "srt_lite::detokenizer" in titles and "srt_lite::scheduler_TP0" in titles, titles
        ipc = s.ipc_dir()
        assert ipc and oct(os.stat(ipc).st_mode & 0o777) == "0o700"
        # A request in flight while the signal arrives must not keep the server up.
        with httpx.stream("POST", s.base_url + "/generate", json={"text": "Go", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}, timeout=30) as r:
            next(r.iter_lines())
            t0 = time.monotonic()
            s.proc.send_signal(sig)
            code = s.proc.wait(10)
        assert time.monotonic() - t0 < 5
        assert code == 0
        assert_gone(children, ipc)


def _stream_finish(lines) -> dict:
    """Reads the rest of a /generate SSE stream: its last meta_info."""
    last = None
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            last = json.loads(line[6:])
    return last["meta_info"]


def test_sigterm_drains_in_flight_requests_within_grace():
    """--graceful-shutdown-timeout: in-flight requests finish normally, while new ones and
    /health get 503, then the server exits 0."""
    with ServerProcess(*ARGS, "--graceful-shutdown-timeout", "60") as s:
        children = s.children()
        # Long enough (seconds) that both requests are still running when /health is asked.
        body = {"text": "Count", "stream": True, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        with ThreadPoolExecutor(1) as pool, httpx.stream("POST", s.base_url + "/generate", json=body, timeout=60) as r:
            other = pool.submit(httpx.post, s.base_url + "/generate", json={**body, "stream": False}, timeout=60)
            lines = r.iter_lines()
            next(lines)
            time.sleep(0.3)  # the second request is in flight too
            s.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            health = httpx.get(s.base_url + "/health", timeout=5)
            refused = httpx.post(s.base_url + "/generate", json={"text": "late"}, timeout=5)
            meta = _stream_finish(lines)
            done = other.result()
        assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]
        assert refused.status_code == 503
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 200
        assert done.status_code == 200 and done.json()["meta_info"]["finish_reason"]["type"] == "length"
        assert s.proc.wait(30) == 0
        assert_gone(children, None)


def test_sigterm_aborts_what_outlasts_the_grace():
    with ServerProcess(*ARGS, "--graceful-shutdown-timeout", "1") as s:
        body = {"text": "Go", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        with httpx.stream("POST", s.base_url + "/generate", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            meta = _stream_finish(lines)
        assert meta["finish_reason"]["type"] == "abort"
        assert 0.8 < time.monotonic() - t0 < 5
        assert meta["completion_tokens"] < 3000
        assert s.proc.wait(10) == 0


def test_killed_scheduler_takes_server_down():
    with ServerProcess(*ARGS) as s:
        children = s.children()
        ipc = s.ipc_dir()
        sched = next(p for p in children if p.name() == "srt_lite::scheduler_TP0")
        sched.kill()
        code = s.proc.wait(10)
        assert code != 0
        assert "scheduler_TP0 died unexpectedly" in s.read_log()
        assert_gone(children, ipc)


def test_scheduler_exception_logs_traceback_and_fails_requests():
    with ServerProcess(*ARGS, env={"SRT_LITE_TEST_CRASH_AT_STEP": "3"}) as s:
        children = s.children()
        ipc = s.ipc_dir()
        t0 = time.monotonic()
        r = httpx.post(s.base_url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}, timeout=30)
        # The in-flight request ends promptly with an abort instead of hanging.
        assert time.monotonic() - t0 < 10
        assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort"
        code = s.proc.wait(10)
        assert code != 0
        log = s.read_log()
        assert "Traceback" in log and "injected fault at step 3" in log
        assert_gone(children, ipc)


def test_killed_detokenizer_takes_server_down():
    with ServerProcess(*ARGS) as s:
        children = s.children()
        next(p for p in children if p.name() == "srt_lite::detokenizer").kill()
        assert s.proc.wait(10) != 0
        assert "detokenizer died unexpectedly" in s.read_log()
        assert_gone(children, None)


def test_killed_server_leaves_no_orphans():
    with ServerProcess(*ARGS) as s:
        children = s.children()
        ipc = s.ipc_dir()
        s.proc.kill()  # SIGKILL: the server itself cleans nothing up
        s.proc.wait(5)
        assert_gone(children, ipc)  # the children do, as they exit


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "srt_lite.launch_server", *args], capture_output=True, text=True, timeout=timeout
    )


def test_bad_model_path_is_one_line_error(tmp_path):
    r = run_cli("--model-path", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == f"error: model path does not exist: {tmp_path / 'missing'}"
    assert "Traceback" not in r.stderr


def test_port_in_use_fails_fast():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        t0 = time.monotonic()
        r = run_cli("--port", str(port))
    assert r.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr
    assert time.monotonic() - t0 < 15
