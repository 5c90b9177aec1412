"""`python -m srt_lite.launch_server [--model-path PATH] [--host H] [--port P] ...`"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from srt_lite.entrypoints.child_processes import start_forkserver
from srt_lite.cli_args import prepare_server_args
from srt_lite.server_args import ServerArgs

if TYPE_CHECKING:
    from srt_lite.managers.tokenizer.tokenizer_manager import TokenizerManager

logger = logging.getLogger("srt_lite.launch_server")


class _Shutdown(Exception):
    pass


def _raise_shutdown(signum, frame) -> None:
    raise _Shutdown()


def served_name(server_args: ServerArgs, model_dir: str) -> str:
    if server_args.served_model_name:
        return server_args.served_model_name
    if server_args.model_path is None:
        from srt_lite.model_loader.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    return server_args.model_path.rstrip("/")


def launch_server(server_args: ServerArgs) -> int:
    """Runs until SIGINT/SIGTERM (returns 0) or until a child process dies (returns 1)."""
    import uvicorn

    from srt_lite.entrypoints.http_server import DrainingServer, build_app
    from srt_lite.entrypoints.server_state import ServerState
    from srt_lite.entrypoints.launcher import launch_subprocesses
    from srt_lite.managers.tokenizer.tokenizer_manager import TokenizerManager
    from srt_lite.managers.tokenizer.metrics import MetricsCollector

    if server_args.node_rank > 0:
        from srt_lite.entrypoints.launcher import run_follower_node

        return run_follower_node(server_args)
    _check_port_free(server_args.host, server_args.port)
    launch = launch_subprocesses(server_args)
    exit_code = 0
    tm = None
    loop = asyncio.new_event_loop()
    try:
        name = served_name(server_args, launch.model_dir)
        metrics = MetricsCollector(name) if server_args.enable_metrics else None
        tm = TokenizerManager(server_args, launch.port_args, launch.model_dir, launch.info, metrics, launch.tokenizer)
        state = ServerState(tm, launch.model_config, name)
        config = uvicorn.Config(
            build_app(state),
            host=server_args.host,
            port=server_args.port,
            log_level="warning",
            timeout_graceful_shutdown=2,
            access_log=False,
        )
        server = DrainingServer(config, tm, server_args.graceful_shutdown_timeout)

        def on_child_death(name: str, code: int | None) -> None:
            nonlocal exit_code
            exit_code = 1
            state.dead = f"{name} died unexpectedly (exit code {code})"
            logger.error("%s; shutting down", state.dead)
            loop.call_soon_threadsafe(tm.fail_all, state.dead)
            server.should_exit = True

        launch.procs.watch(on_child_death)
        logger.info("%s", banner(server_args, name, launch.model_dir, launch.info))
        # While serving, DrainingServer handles SIGINT/SIGTERM (drain, then stop). A signal
        # uvicorn re-raises after serving, or one that arrives outside serve(), reaches these
        # handlers, which turn it into an exception so the cleanup below runs.
        signal.signal(signal.SIGTERM, _raise_shutdown)
        signal.signal(signal.SIGINT, _raise_shutdown)
        try:
            loop.run_until_complete(server.serve())
        except _Shutdown:
            pass
        if not server.started and exit_code == 0:
            exit_code = 1  # e.g. the port was taken
    finally:
        launch.procs.shutdown()
        if tm is not None and tm.started:
            loop.run_until_complete(_close(tm))
    return exit_code


def _formats(formats: dict[str, int]) -> str:
    return ", ".join(f"{n} {fmt}" for fmt, n in sorted(formats.items()))


def banner(server_args: ServerArgs, served_name: str, model_dir: str, info) -> str:
    """What a user needs on start: what runs, how big, and where to call it."""
    url = f"http://{server_args.host}:{server_args.port}"
    return "\n".join([
        "srt_lite is ready",
        f"  model        {served_name}  ({model_dir})",
        f"  dtype        {info.dtype} on {info.device}, tensor parallel {server_args.tp_size}"
        + (f" over {server_args.nnodes} nodes" if server_args.nnodes > 1 else ""),
        f"  compute      linears: {info.linear_path}; CPU {info.cpu}",
        *([f"  weights      GGUF blocks: {_formats(info.gguf_formats)} ({info.weight_bytes / 2**20:.0f} MiB held)"]
          if info.gguf_formats else []),
        *([f"  deterministic  {'yes: batch-invariant' if info.deterministic else 'asked for, not here: ' + '; '.join(info.deterministic_gaps)}"]
          if server_args.enable_deterministic_inference else []),
        f"  KV cache     {info.max_total_num_tokens} tokens",
        f"  max context  {info.max_context_len} tokens",
        f"  URL          {url}  (OpenAI API: {url}/v1)",
        f"  try          curl {url}/v1/completions -H 'Content-Type: application/json' "
        '-d \'{"prompt": "The capital of France is", "max_tokens": 16}\'',
    ])


def _check_port_free(host: str, port: int) -> None:
    """Fails fast, before loading the model, when the port is taken."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror}") from None


async def _close(tm: TokenizerManager) -> None:
    tm.close()  # in the loop the manager's sockets belong to


def main(argv: list[str] | None = None) -> None:
    server_args = prepare_server_args(argv)
    # The children's forkserver imports torch and transformers while this process does.
    start_forkserver()
    from srt_lite.utils import configure_logging, set_process_title

    configure_logging(server_args.log_level)
    set_process_title("srt_lite::server")
    from srt_lite.model_loader.default_model import ModelPathError

    try:
        code = launch_server(server_args)
    except (ModelPathError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        code = 0
    # The children are stopped and the sockets closed: all that is left is the interpreter's
    # own teardown of torch's and transformers' modules (about a second), which nothing
    # needs and a restart or a test's next server would wait on.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
