"""The forkserver the children fork from (srt_lite/entrypoints/child_processes.py): a child
sees its parent's environment as of its own start, and the preloaded forkserver holds one
thread (no OpenMP pool or other thread that a fork would leave broken)."""

from __future__ import annotations

import os
import time
from multiprocessing import forkserver

import httpx
import psutil

from server_utils import ServerProcess
from srt_lite.entrypoints.child_processes import child_context, child_main, start_forkserver
from srt_lite.model_loader import tokenizer_cache

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


# Loaded through PYTHONPATH into every process of a server: notes, by title, which processes
# import transformers, and whether the HTTP process ever holds torch (polled: transformers
# asks for torch's spec without importing it, so an import hook would see false imports).
IMPORT_HOOK = '''
import os, sys, threading, time

def _note(what):
    with open(os.environ["SRT_LITE_TEST_IMPORT_LOG"], "a") as f:
        f.write(open(f"/proc/{os.getpid()}/cmdline").read().split("\\0")[0] + " " + what + "\\n")

class _NoteTransformers:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers":
            sys.meta_path.remove(self)
            _note(name)
        return None

def _watch_torch():
    while "torch" not in sys.modules:
        time.sleep(0.02)
    _note("torch")

sys.meta_path.insert(0, _NoteTransformers())
if "srt_lite.launch_server" in open("/proc/self/cmdline").read():
    threading.Thread(target=_watch_torch, daemon=True).start()
'''


def test_only_the_http_process_imports_transformers_and_it_not_torch(default_model_dir, tmp_path):
    """The scheduler and detokenizer read the config and the cached tokenizer pipeline
    without transformers, and the forkserver does not import it; the HTTP process serves a
    request without torch (each of these is seconds of every start)."""
    tokenizer_cache.load_transformers(default_model_dir)  # a first start would cache this
    (tmp_path / "sitecustomize.py").write_text(IMPORT_HOOK)
    log = tmp_path / "imports.log"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    with ServerProcess(env={"PYTHONPATH": path, "SRT_LITE_TEST_IMPORT_LOG": str(log)}) as server:
        out = httpx.post(f"{server.base_url}/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        assert out.status_code == 200
        time.sleep(0.1)  # the watcher's poll
        imports = [tuple(line.split()) for line in log.read_text().splitlines()]
    assert sorted(title for title, name in imports if name == "transformers") == ["srt_lite::server"]
    assert ("srt_lite::server", "torch") not in imports, imports
