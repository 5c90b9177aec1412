"""Tensor parallelism across nodes: two `launch_server` processes on one machine, node ranks 0
and 1 of `--nnodes 2`, meeting at a loopback `--dist-init-addr`. They serve what tp=1 serves,
listen on the given address only, stop together on SIGTERM to node 0, and a dead node ends
the other with an error instead of a hang."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import httpx
import psutil
import pytest
import torch

from server_utils import LoggedProcess, ServerProcess
from srt_lite.distributed.rendezvous import interface_of, local_address_towards, open_store, split_host_port
from srt_lite.server_args import ServerArgs
from srt_lite.utils import get_free_port

PROMPTS = ["The capital of France is", "Once upon a time,", "def add(a, b):"]
# Two "nodes" share this machine's cores: one thread per rank keeps them from fighting.
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """8 query and 2 KV heads (tp=2 splits both) over the default model's vocabulary, so text
    prompts work; weights drawn wide enough that greedy decoding does not repeat one token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from srt_lite.model_loader.default_model import resolve_model_path

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("tiny_multinode")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_model_path(None)).save_pretrained(path)
    return str(path)


class FollowerNode(LoggedProcess):
    """A node with --node-rank > 0: no HTTP server to poll, just a process and its log."""

    def __init__(self, *args: str):
        cmd = [sys.executable, "-m", "srt_lite.launch_server", *args]
        super().__init__(cmd, f"node1_{os.getpid()}_{time.monotonic_ns()}", ENV)

    def kill(self) -> None:
        for c in self.children():
            c.kill()
        self.stop(signal.SIGKILL)


def node_args(model: str, addr: str, rank: int) -> list[str]:
    return ["--model-path", model, "--dtype", "float32", "--max-total-tokens", "4096", "--tp-size", "2",
            "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr]


@pytest.fixture
def pair(tiny_model):
    """Node 0 (serving, ready) and node 1 of a fresh two-node server; both stopped after."""
    addr = f"127.0.0.1:{get_free_port()}"
    follower = FollowerNode(*node_args(tiny_model, addr, 1))
    head = ServerProcess(*node_args(tiny_model, addr, 0), env=ENV, warmup=True)  # as node 1 does
    try:
        yield head.wait_ready(), follower
    finally:
        head.__exit__(None, None, None)
        follower.kill()


def greedy(base_url: str) -> tuple[list[str], str]:
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    r = httpx.post(base_url + "/generate", json={"text": PROMPTS, "sampling_params": params}, timeout=120)
    chat = httpx.post(base_url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, "temperature": 0,
    }, timeout=120)
    return [o["text"] for o in r.json()], chat.json()["choices"][0]["message"]["content"]


def srt_lite_names(procs: list[psutil.Process]) -> list[str]:
    """The titles of srt_lite's own processes (multiprocessing adds a resource tracker; the
    forkserver that the ranks fork from carries srt_lite::forkserver)."""
    return sorted(n for n in (p.name() for p in procs) if n.startswith("srt_lite::"))


def listening_addresses(procs: list[psutil.Process]) -> set[str]:
    found = set()
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.add(c.laddr.ip)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture
def tp1_greedy(tiny_model) -> tuple[list[str], str]:
    with ServerProcess("--model-path", tiny_model, "--dtype", "float32", "--max-total-tokens", "4096") as ref:
        expected = greedy(ref.base_url)
    assert len(set(expected[0])) == len(PROMPTS), "the prompts' continuations differ (a real comparison)"
    return expected


def test_two_nodes_serve_what_tp1_serves_and_stop_with_node_0(tp1_greedy, pair):
    head, follower = pair
    head_procs = [psutil.Process(head.proc.pid), *head.children()]
    follower_procs = [psutil.Process(follower.proc.pid), *follower.children()]
    assert srt_lite_names(head.children()) == ["srt_lite::detokenizer", "srt_lite::forkserver", "srt_lite::scheduler_TP0"]
    assert srt_lite_names(follower.children()) == ["srt_lite::forkserver", "srt_lite::scheduler_TP1"], "node 1 runs its rank only"
    # The store, gloo's pairs and the HTTP server listen on loopback, never everywhere.
    assert listening_addresses(head_procs + follower_procs) == {"127.0.0.1"}

    assert greedy(head.base_url) == tp1_greedy

    assert head.stop() == 0  # SIGTERM to node 0
    assert follower.proc.wait(30) == 0
    assert "Node 0 stopped serving; node 1 exits" in follower.read_log()
    gone, alive = psutil.wait_procs(head_procs[1:] + follower_procs[1:], timeout=10)
    assert not alive, "no rank outlives its node"


def test_killed_follower_node_ends_node_0_with_an_error(pair):
    head, follower = pair
    assert httpx.get(head.base_url + "/health", timeout=10).status_code == 200
    follower.proc.send_signal(signal.SIGKILL)  # its rank gets SIGTERM from the kernel (parent death)
    assert head.proc.wait(60) != 0
    log = head.read_log()
    assert "Scheduler TP0 lost contact with another rank" in log
    assert "scheduler_TP0 died unexpectedly" in log


def test_dead_node_0_ends_the_follower_with_an_error(pair):
    head, follower = pair
    rank0 = next(p for p in head.children() if p.name() == "srt_lite::scheduler_TP0")
    rank0.kill()  # node 0's rank crashes: no shutdown message reaches node 1
    assert follower.proc.wait(60) == 1
    log = follower.read_log()
    assert "Scheduler TP1 lost contact with another rank" in log
    assert "scheduler_TP1 exited with code 1" in log
    assert head.proc.wait(30) != 0


# ---- the rendezvous, without a server -----------------------------------------------------


@pytest.mark.parametrize("addr, expected", [
    ("10.0.0.1:5000", ("10.0.0.1", 5000)),
    ("node0.cluster:29500", ("node0.cluster", 29500)),
    ("[fd00::1]:29500", ("fd00::1", 29500)),
])
def test_split_host_port(addr, expected):
    assert split_host_port(addr) == expected


@pytest.mark.parametrize("addr", ["10.0.0.1", ":5000", "host:", "host:0", "host:70000", "fd00::1:5000"])
def test_split_host_port_refuses(addr):
    with pytest.raises(ValueError, match="--dist-init-addr"):
        split_host_port(addr)


def test_local_ranks_per_node():
    args = dict(tp_size=4, nnodes=2, dist_init_addr="127.0.0.1:5000")
    assert ServerArgs(node_rank=0, **args).local_tp_ranks() == range(0, 2)
    assert ServerArgs(node_rank=1, **args).local_tp_ranks() == range(2, 4)
    assert ServerArgs(tp_size=3).local_tp_ranks() == range(0, 3)


def test_engine_runs_on_node_0_only():
    from srt_lite import Engine

    with pytest.raises(ValueError, match="an Engine runs on node 0"):
        Engine(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:5000")


def test_store_listens_on_the_given_address_only():
    import datetime

    port = get_free_port()
    store = open_store("127.0.0.1", port, 0, 1, datetime.timedelta(seconds=5))
    store.set("k", "v")
    mine = {c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", port) in {(a.ip, a.port) for a in mine}
    assert all(a.ip == "127.0.0.1" for a in mine if a.port == port)
    del store


def test_store_on_an_address_of_another_machine_is_a_clear_error():
    import datetime

    with pytest.raises(RuntimeError, match="must be an address of this machine"):
        open_store("203.0.113.7", get_free_port(), 0, 2, datetime.timedelta(seconds=5))  # TEST-NET-3


def test_collectives_use_the_interface_that_reaches_the_host():
    loopback = interface_of("127.0.0.1")
    assert loopback is not None
    assert interface_of(local_address_towards("127.0.0.1", 1)) == loopback
    # Every address this machine holds maps back to its own interface.
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET:
                assert interface_of(a.address) == name
