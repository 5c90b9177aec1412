"""The forkserver the children fork from (srt_lite/entrypoints/child_processes.py): a child
sees its parent's environment as of its own start, and the preloaded forkserver holds one
thread (no OpenMP pool or other thread that a fork would leave broken)."""

from __future__ import annotations

import os
from multiprocessing import forkserver

import psutil

from srt_lite.entrypoints.child_processes import child_context, child_main, start_forkserver

VAR = "SRT_LITE_TEST_CHILD_ENV"


def report_env(conn) -> None:
    conn.send(os.environ.get(VAR))


def run_child(wrapped: bool) -> str | None:
    ctx = child_context()
    reader, writer = ctx.Pipe(duplex=False)
    args = (dict(os.environ), report_env, writer) if wrapped else (writer,)
    proc = ctx.Process(target=child_main if wrapped else report_env, args=args, daemon=True)
    proc.start()
    writer.close()
    try:
        assert reader.poll(60), "the child did not answer"
        return reader.recv()
    finally:
        proc.join(10)


def test_child_takes_the_environment_at_its_start_not_the_forkservers(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)
    start_forkserver()
    monkeypatch.setenv(VAR, "set after the forkserver started")
    # A bare forkserver child has the forkserver's environment, without the variable ...
    assert run_child(wrapped=False) is None
    # ... and child_main hands it the parent's, as spawn did.
    assert run_child(wrapped=True) == "set after the forkserver started"
    monkeypatch.delenv(VAR)
    assert run_child(wrapped=True) is None


def test_preloaded_forkserver_runs_no_threads():
    start_forkserver()
    run_child(wrapped=True)  # returns once the preload is done and a child was forked
    server = psutil.Process(forkserver._forkserver._forkserver_pid)
    assert server.name() == "srt_lite::forkserver"
    assert server.num_threads() == 1
