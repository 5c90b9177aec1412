"""SGLang's router (the `sglang-router` package) in front of srt_lite workers, for the router
tests and benchmarks/bench_router.py (a helper module, not a test file)."""

from __future__ import annotations

import re
import sys
import time

import httpx

from server_utils import LoggedProcess, ServerProcess
from srt_lite.utils import get_free_port

# The router colours its log even into a file, whatever NO_COLOR says.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Health checks every second and one failure marks a worker unhealthy: the router notices a
# dead worker within about two seconds instead of its defaults' minutes (60 s, 3 failures).
FAST_HEALTH_CHECKS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1")


class RouterProcess(LoggedProcess):
    """`python -m sglang_router.launch_router` on a free loopback port; a context manager."""

    def __init__(self, worker_urls: list[str], policy: str = "cache_aware", *args: str):
        self.port = get_free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.worker_urls = worker_urls
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(get_free_port()),
            "--worker-urls", *worker_urls, "--policy", policy, *args,
        ]
        super().__init__(cmd, f"router_{self.port}")

    def __enter__(self) -> "RouterProcess":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 120.0) -> "RouterProcess":
        """Until every worker is registered and healthy (registration runs in the background
        after the router starts listening)."""
        deadline = time.monotonic() + timeout
        seen: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                seen = self.workers()
                healthy = [w["url"] for w in seen if w["is_healthy"]]
                if sorted(healthy) == sorted(self.worker_urls):
                    return self
            except (httpx.HTTPError, ValueError, KeyError) as e:
                seen = repr(e)
            time.sleep(0.5)
        raise TimeoutError(f"router not ready after {timeout} s; /workers said {seen}\n{self.log_without_polls()}")

    def log_without_polls(self) -> str:
        """The router's log, colour codes removed, less the lines of our own /workers polls,
        which would bury the registration steps' outcome."""
        lines = _ANSI.sub("", self.read_log()).splitlines()
        return "\n".join(line for line in lines if "uri=/workers " not in line)

    def workers(self) -> list[dict]:
        return httpx.get(self.base_url + "/workers", timeout=5).json()["workers"]

    def wait_unhealthy(self, url: str, timeout: float = 30.0) -> float:
        """Seconds until the router marks `url` unhealthy."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if any(w["url"] == url and not w["is_healthy"] for w in self.workers()):
                return time.monotonic() - t0
            time.sleep(0.1)
        raise TimeoutError(f"the router still routes to {url} after {timeout} s:\n{self.log_without_polls()[-3000:]}")


def start_workers(n: int, *args: str, env: dict | None = None, warmup: bool = False) -> list[ServerProcess]:
    """n srt_lite servers started together (their start-ups overlap), each ready; warmup as
    ServerProcess takes it (a benchmark's workers warm up, as a user's do)."""
    workers = [ServerProcess(*args, env=env, warmup=warmup) for _ in range(n)]
    try:
        for w in workers:
            w.wait_ready(timeout=180)
    except BaseException:
        for w in workers:
            w.__exit__(None, None, None)
        raise
    return workers


def kill_worker(worker: ServerProcess) -> None:
    """As a crash would end it: SIGKILL to the server and its children, no drain."""
    for c in worker.children():
        c.kill()
    worker.proc.kill()
    worker.proc.wait()


_METRIC = re.compile(r"^srt_lite:(\w+)\{[^}]*\} ([0-9.e+-]+)$", re.M)


def worker_counters(worker_url: str) -> dict[str, float]:
    """A worker's Prometheus counters and gauges (needs --enable-metrics), by bare name:
    num_requests_total, prompt_tokens_total, cached_tokens_total, ..."""
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    return {name: float(value) for name, value in _METRIC.findall(text)}
