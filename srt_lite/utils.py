"""Small helpers shared by every process: logging, device and dtype choice."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Iterable, Iterator, TypeVar

from srt_lite import envs

logger = logging.getLogger(__name__)


def configure_logging(level: str = "info", prefix: str = "") -> None:
    """Sets up the root logger once per process, SGLang-style: time, optional process tag."""
    fmt = f"[%(asctime)s{(' ' + prefix) if prefix else ''}] %(message)s"
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=fmt,
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


T = TypeVar("T")


def progress(items: Iterable[T], total: int, desc: str, enabled: bool = True) -> Iterator[T]:
    """Iterates `items` with a tqdm bar when stderr is a terminal; otherwise (log files,
    pipes, CI) with two plain log lines, at the start and at the end."""
    if not enabled:
        yield from items
        return
    if sys.stderr.isatty():
        from tqdm.auto import tqdm

        yield from tqdm(items, total=total, desc=desc, leave=False)
        return
    logger.info("%s: 0/%d", desc, total)
    n = 0
    for n, item in enumerate(items, 1):
        yield item
    logger.info("%s: %d/%d done", desc, n, total)


# torch is imported where it is used: the HTTP process, which never runs the model, starts
# faster without it.


def resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def get_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def split_host_port(addr: str) -> tuple[str, int]:
    """'HOST:PORT' or '[IPv6]:PORT' -> (host, port); ValueError with the reason otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"--dist-init-addr: write an IPv6 address in brackets, [{host}]:{port}")
    if not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr port must be in 1..65535, got {port}")
    return host, int(port)


def cache_root() -> str:
    """Where converted models live: $SRT_LITE_CACHE, else ~/.cache/srt_lite."""
    return envs.CACHE_DIR.get() or os.path.join(
        os.path.expanduser("~"), ".cache", "srt_lite"
    )


def available_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info()
        return free
    import psutil

    return psutil.virtual_memory().available


def zmq_socket(ctx, kind: int, path: str, bind: bool):
    """A ZMQ socket on an ipc:// path; PUSH sockets never block the sender forever on exit."""
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    endpoint = f"ipc://{path}"
    sock.bind(endpoint) if bind else sock.connect(endpoint)
    return sock


def die_with_parent(sig: int) -> None:
    """Linux: this process receives `sig` when its parent dies, so no child is ever orphaned."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


def die_of_sigterm() -> None:
    """Ends this process as SIGTERM's default action does (the parent sees -SIGTERM)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def set_process_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass


def init_child_process(title: str, ipc_dir: str) -> None:
    """Common start of every child process: carries a recognisable title such as
    `srt_lite::scheduler_TP0`, leaves the parent's process group (so Ctrl-C or a group kill
    reaches only the parent, which stops children in order), and gets SIGTERM when its parent
    dies. On SIGTERM a child removes the server's socket dir before exiting: the parent does
    the same after stopping its children, but a parent killed with SIGKILL cannot, and then
    no stale socket file may be left behind. (The parent's death is not detectable here via
    getppid: PDEATHSIG arrives when the creating thread dies, before the reparenting.)"""
    import shutil
    import signal

    def on_sigterm(signum, frame) -> None:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        die_of_sigterm()

    import multiprocessing

    signal.signal(signal.SIGTERM, on_sigterm)
    die_with_parent(signal.SIGTERM)
    # The parent that started this process may not be the one it was forked from (the
    # launcher's forkserver, which exits when the launcher does): the PDEATHSIG above is tied
    # to the forking one, and the launcher's liveness is read from its sentinel.
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # it died before prctl took effect
        on_sigterm(signal.SIGTERM, None)
    try:
        os.setpgrp()
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_process_title(title)


def write_json_atomic(path: str, obj) -> None:
    """Writes `obj` as JSON to `path` through a temporary file and a rename, so a reader
    sees the old file or the new one, never half of one."""
    import json

    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
