"""Starting a real server process for HTTP and lifecycle tests."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil

from srt_lite.utils import get_free_port


_STARTED: list["LoggedProcess"] = []


@atexit.register
def _kill_leftovers() -> None:
    """A failed test must never leave a server (and its children) running."""
    for s in _STARTED:
        if s.proc.poll() is None:
            for c in s.children():
                c.kill()
            s.proc.kill()


class LoggedProcess:
    """A child process whose output goes to a log file, killed with its children at exit if a
    test leaves it running."""

    def __init__(self, cmd: list[str], log_name: str, env: dict | None = None):
        self.log_path = f"/tmp/srt_lite_test_{log_name}.log"
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        _STARTED.append(self)

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode


class ServerProcess(LoggedProcess):
    """Use as a context manager so the server stops even when the test fails.

    warmup: run the start-up warm-up forwards. Off by default: they only spare the first
    requests some latency, which no test here measures, and over the suite's many starts
    they add up to minutes. The servers started as the docs and a user start
    them (the docs' commands, the soak, a start per dtype) and every node of a multi-node
    server (whose ranks warm up together) keep it; test_tiny_models checks what it runs."""

    def __init__(self, *args: str, env: dict | None = None, warmup: bool = False):
        self.port = get_free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        skip = [] if warmup or "--skip-server-warmup" in args else ["--skip-server-warmup"]
        cmd = [sys.executable, "-m", "srt_lite.launch_server", "--port", str(self.port), *args, *skip]
        super().__init__(cmd, f"server_{self.port}", env)

    def __enter__(self) -> "ServerProcess":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        children = self.children()
        self.stop()
        for c in children:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready:\n{self.read_log()}")

    def ipc_dir(self) -> str | None:
        """The server's private socket dir, found from its open unix sockets' paths."""
        for c in self.children():
            for conn in c.net_connections(kind="unix"):
                if conn.laddr and "srt_lite-" in conn.laddr:
                    return os.path.dirname(conn.laddr)
        return None
