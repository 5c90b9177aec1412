"""Starting, watching and stopping the scheduler rank(s) and the detokenizer."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import threading
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any, Callable

from srt_lite.entrypoints.child_processes import child_context, child_main, start_forkserver
from srt_lite.managers.io_struct import PortArgs, SchedulerReady
from srt_lite.model_config import ModelConfig
from srt_lite.model_loader import tokenizer_cache
from srt_lite.server_args import ServerArgs

logger = logging.getLogger(__name__)

# The children's entry points, by name (child_processes.child_main).
SCHEDULER_MAIN = "srt_lite.managers.scheduler.scheduler:run_scheduler_process"
DETOKENIZER_MAIN = "srt_lite.managers.detokenizer.detokenizer_manager:run_detokenizer_process"


class Subprocesses:
    def __init__(self, port_args: PortArgs):
        self.port_args = port_args
        self.procs: list[tuple[str, mp.Process]] = []
        self.stopping = False
        self._watchdog: threading.Thread | None = None

    def start(self, name: str, target: str, args: tuple) -> mp.connection.Connection:
        """Starts `target` ("module:function") as a child named `name`; it is called with
        `args` and the write end of the returned pipe, on which it says ready or why not."""
        ctx = child_context()
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=child_main, args=(dict(os.environ), target, *args, writer), name=name, daemon=True)
        proc.start()
        writer.close()
        self.procs.append((name, proc))
        return reader

    def wait_ready(self, readers: list[tuple[str, mp.connection.Connection]]) -> list[dict]:
        """Blocks until each child says ready; raises with the child's error otherwise."""
        infos = []
        for name, reader in readers:
            proc = dict(self.procs)[name]
            while not reader.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(f"{name} exited with code {proc.exitcode} during start-up (see its log above)")
            try:
                status, payload = reader.recv()
            except EOFError:
                raise RuntimeError(f"{name} exited during start-up (see its log above)") from None
            if status != "ready":
                raise RuntimeError(f"{name} failed to start: {payload}")
            infos.append(payload)
        return infos

    def watch(self, on_death: Callable[[str, int | None], None]) -> None:
        """Calls on_death(name, exitcode) from a thread if a child dies while we are running."""

        def run() -> None:
            sentinels = {p.sentinel: (name, p) for name, p in self.procs}
            ready = wait(list(sentinels))
            if self.stopping:
                return
            name, proc = sentinels[ready[0]]
            proc.join(0.1)
            on_death(name, proc.exitcode)

        self._watchdog = threading.Thread(target=run, name="srt_lite-watchdog", daemon=True)
        self._watchdog.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for _, p in self.procs:
            if p.is_alive():
                p.terminate()
        for _, p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(1)
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)


def in_background(fn: Callable, *args) -> Future:
    """fn(*args) on a daemon thread (which never holds up the exit of a failed start)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the result
            future.set_exception(e)

    threading.Thread(target=run, name="srt_lite-tokenizer", daemon=True).start()
    return future


@dataclasses.dataclass
class LaunchResult:
    procs: Subprocesses
    port_args: PortArgs
    model_config: ModelConfig
    info: SchedulerReady
    tokenizer: Any = None  # transformers' tokenizer, for node 0's TokenizerManager

    @property
    def model_dir(self) -> str:
        return self.model_config.path


def launch_subprocesses(server_args: ServerArgs) -> LaunchResult:
    """Converts the model if needed (once, here, so children never race on it), then starts
    this node's scheduler rank(s) and, on node 0, the detokenizer, and waits until every one
    is ready. Node 0 loads transformers' tokenizer meanwhile (seconds of imports that the
    children, which do without transformers, leave this process)."""
    start_forkserver()
    model_config = ModelConfig.load(server_args.model_path, server_args.context_length)
    model_config.verify_tp(server_args.tp_size)
    # Children find the converted model (or a GGUF file's prepared folder) without work.
    child_args = dataclasses.replace(server_args, model_path=model_config.gguf_file or model_config.path)
    port_args = PortArgs.create(server_args.tp_size, server_args.dist_init_addr)
    procs = Subprocesses(port_args)
    # On its own thread: starting a child waits for the forkserver's imports, and these are
    # seconds of imports too.
    tokenizer = in_background(tokenizer_cache.load_transformers, model_config.path) if server_args.node_rank == 0 else None
    try:
        readers = []
        for rank in server_args.local_tp_ranks():
            name = f"scheduler_TP{rank}"
            readers.append((name, procs.start(name, SCHEDULER_MAIN, (child_args, port_args, rank))))
        if server_args.node_rank == 0:
            readers.append(("detokenizer", procs.start("detokenizer", DETOKENIZER_MAIN, (child_args, port_args, model_config.path))))
        infos = procs.wait_ready(readers)
        if tokenizer is not None:
            tokenizer = tokenizer.result()
    except BaseException:
        procs.shutdown()
        raise
    info = SchedulerReady(**infos[0])
    logger.info(
        "Ready: %s, KV capacity %d tokens, context length %d, %s on %s",
        os.path.basename(model_config.path.rstrip("/")), info.max_total_num_tokens, info.max_context_len,
        info.dtype, info.device,
    )
    return LaunchResult(procs, port_args, model_config, info, tokenizer)


def run_follower_node(server_args: ServerArgs) -> int:
    """A node with --node-rank > 0: its scheduler ranks only, following rank 0's broadcast.
    Returns 0 once they leave with node 0 (it stopped) or on SIGTERM/SIGINT here, 1 when one
    of them fails (another node died, or this rank itself)."""
    launch = launch_subprocesses(server_args)
    ranks = server_args.local_tp_ranks()
    logger.info(
        "Node %d of %d is serving: ranks TP%d-TP%d follow node 0 at %s (no HTTP server on this node)",
        server_args.node_rank, server_args.nnodes, ranks.start, ranks.stop - 1, server_args.dist_init_addr,
    )
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    procs = launch.procs
    try:
        while not stop.is_set():
            wait([p.sentinel for _, p in procs.procs], timeout=0.5)
            ended = [(name, p) for name, p in procs.procs if p.exitcode is not None]
            if not ended:
                continue
            failed = [(name, p.exitcode) for name, p in ended if p.exitcode != 0]
            if failed:
                name, code = failed[0]
                logger.error("%s exited with code %s: lost the other nodes or failed (see its line above); node %d stops",
                             name, code, server_args.node_rank)
                return 1
            if len(ended) == len(procs.procs):
                logger.info("Node 0 stopped serving; node %d exits", server_args.node_rank)
                return 0
        logger.info("Stopping node %d", server_args.node_rank)
        return 0
    finally:
        procs.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
