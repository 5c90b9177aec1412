"""How srt_lite starts its child processes (scheduler ranks, detokenizer).

Kept free of heavy imports: the server's entry point starts the forkserver from here before
it imports torch, so that the two import at the same time.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
from typing import Callable

# Children fork from a forkserver that has imported what they need once (child_preload),
# instead of each re-importing torch and transformers under `spawn` (seconds of CPU each, on
# cores they share). The forkserver is a clean process of its own, so a parent that has run
# torch ops or CUDA (an Engine user's process) is never forked.
CHILD_PRELOAD = ["srt_lite.entrypoints.child_preload"]


def child_context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(CHILD_PRELOAD)
    return ctx


def start_forkserver() -> None:
    """Starts the forkserver now (if not running), so that its imports overlap the parent's
    own start-up work; the first child would otherwise start it and wait for them."""
    child_context()
    from multiprocessing import forkserver

    forkserver.ensure_running()


def child_main(env: dict[str, str], target: str | Callable, *args) -> None:
    """A child's entry point: the forkserver's environment is the parent's when the forkserver
    started, so the child takes the parent's environment at the time it was started, as under
    `spawn` (read lazily by torch, oneDNN and srt_lite.envs). `target` may be named as
    "module:function", so that the parent need not import the child's modules (the
    scheduler's import torch; the forkserver has them loaded already)."""
    _drop_forkserver_alive_fd()
    # Only the differences: a wholesale clear() would also undo setproctitle's set-up.
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    if isinstance(target, str):
        module, function = target.split(":")
        target = getattr(importlib.import_module(module), function)
    target(*args)


def _drop_forkserver_alive_fd() -> None:
    """A forked child inherits the write end of the pipe whose EOF tells the forkserver that
    its clients are gone. Held here, it would keep the forkserver up after the launcher dies
    (SIGKILL), and with it this child, whose PDEATHSIG is tied to the forkserver: closed, the
    launcher's death ends the forkserver, and that ends the children."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
