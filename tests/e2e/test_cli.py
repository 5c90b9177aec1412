"""The command line: --help grouped with defaults, every flag from ServerArgs, and invalid
values or combinations refused at start with one clear line (exit 2, no traceback)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from srt_lite.cli_args import GROUP_ORDER
from srt_lite.server_args import ServerArgs


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "srt_lite.launch_server", *args], capture_output=True, text=True, timeout=60)


def test_help_is_grouped_with_defaults_and_lists_every_flag():
    r = cli("--help")
    assert r.returncode == 0
    out = r.stdout
    positions = [out.index(f"\n{group}:\n") for group in GROUP_ORDER]
    assert positions == sorted(positions), "groups appear in GROUP_ORDER"
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in out, f.name
    assert "(default: 30000)" in out and "(default: 127.0.0.1)" in out and "(default: lpm)" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp-size", "0"], "error: --tp-size must be >= 1"),
        (["--chunked-prefill-size", "0"], "error: --chunked-prefill-size must be positive or -1"),
        (["--mem-fraction-static", "1.5"], "error: --mem-fraction-static must be in (0, 1)"),
        (["--graceful-shutdown-timeout", "-1"], "error: --graceful-shutdown-timeout must be >= 0"),
        (["--max-request-bytes", "10"], "error: --max-request-bytes must be >= 1024"),
        (["--attention-backend", "flashinfer"], "error: --attention-backend flashinfer needs a CUDA device; use torch_native on the CPU"),
        (["--chat-template", "/nonexistent.jinja"], "error: --chat-template file not found: /nonexistent.jinja"),
        (["--nnodes", "2", "--tp-size", "2"], "error: --nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)"),
        (["--nnodes", "2", "--tp-size", "3", "--dist-init-addr", "127.0.0.1:5000"], "error: --tp-size 3 must be a multiple of --nnodes 2"),
        (["--nnodes", "2", "--node-rank", "2", "--tp-size", "2"], "error: --node-rank must be in 0..1 (--nnodes 2)"),
        (["--tp-size", "2", "--dist-init-addr", "127.0.0.1"], "error: --dist-init-addr must be HOST:PORT, got '127.0.0.1'"),
        (["--tp-size", "2", "--dist-init-addr", "::1:5000"], "error: --dist-init-addr: write an IPv6 address in brackets, [::1]:5000"),
    ],
)
def test_invalid_flags_exit_with_one_line(args, message):
    r = cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines == [message], r.stderr


def test_progress_is_a_bar_on_a_terminal_and_log_lines_otherwise(monkeypatch, caplog, capsys):
    import io
    import logging

    from srt_lite import utils

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert list(utils.progress(range(5), 5, "Loading weights")) == [0, 1, 2, 3, 4]
    assert "Loading weights:   0%" in tty.getvalue() and "| 0/5 [" in tty.getvalue()  # tqdm drew a bar

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a log file
    with caplog.at_level(logging.INFO, logger="srt_lite.utils"):
        assert list(utils.progress(range(3), 3, "Warming up")) == [0, 1, 2]
    assert [r.getMessage() for r in caplog.records] == ["Warming up: 0/3", "Warming up: 3/3 done"]


def test_flashinfer_with_float32_is_refused_before_loading(monkeypatch):
    """On a CUDA machine: FlashInfer has no fp32 kernels, so the explicit pair fails at the
    flag check (the CPU here stands in for one with CUDA)."""
    from srt_lite import server_args

    monkeypatch.setattr(server_args, "_cuda_available", lambda: True)
    with pytest.raises(ValueError, match="flashinfer runs float16/bfloat16 only"):
        ServerArgs(attention_backend="flashinfer", dtype="float32", device="cuda").check()
    ServerArgs(attention_backend="flashinfer", dtype="bfloat16", device="cuda").check()
    ServerArgs(attention_backend="auto", dtype="float32", device="cuda").check()  # auto picks torch_native


def test_device_defaults_resolve_in_server_args():
    """An unset --chunked-prefill-size is 512 on the CPU and 8192 on CUDA; -1 and a set value
    stay; warm-up runs decode batches up to 16 requests and one chunk of at most 512 tokens."""
    args = ServerArgs()
    assert (args.chunk_size_for("cpu"), args.chunk_size_for("cuda")) == (512, 8192)
    assert ServerArgs(chunked_prefill_size=64).chunk_size_for("cuda") == 64
    assert ServerArgs(chunked_prefill_size=-1).chunk_size_for("cpu") == -1
    assert args.warmup_sizes(max_running=48, chunk_size=8192) == (16, 512)
    assert args.warmup_sizes(max_running=4, chunk_size=64) == (4, 64)
    assert args.warmup_sizes(max_running=4, chunk_size=-1) == (4, 512)
