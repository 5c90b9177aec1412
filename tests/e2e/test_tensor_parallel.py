"""Tensor parallelism: sharded layers match tp=1, the served model matches tp=1, bad sizes
are refused, and a dead rank takes the server down."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import psutil
import pytest
import torch

from engine_utils import PROMPTS
from server_utils import ServerProcess
from tiny_models import make_tp_llama
from srt_lite.utils import get_free_port

HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tp_llama(tmp_path_factory.mktemp("tiny_tp"), 64, 322, 256, torch.float32)


def run_tp(model_dir: str, tp: int, out, steps: int = 32) -> dict:
    port = get_free_port()
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HELPERS, "tp_worker_main.py"), model_dir, str(r), str(tp), str(port), str(out), str(steps)])
        for r in range(tp)
    ]
    for p in procs:
        assert p.wait(300) == 0
    return torch.load(out)


def test_sharded_logits_match_tp1(tiny_model, tmp_path):
    ref = run_tp(tiny_model, 1, tmp_path / "tp1.pt")
    for tp in (2, 4):
        got = run_tp(tiny_model, tp, tmp_path / f"tp{tp}.pt")
        assert got["tokens"] == ref["tokens"], tp  # identical greedy tokens over 32 steps
        for a, b in zip(got["logits"], ref["logits"]):
            assert (a - b).abs().max().item() < 1e-4, tp


@pytest.mark.slow
def test_smollm2_tp3_generates_what_tp1_does(engine):
    prompts = PROMPTS[:4]
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    ref = [o["text"] for o in engine.generate(prompts, params)]
    with ServerProcess("--tp-size", "3", "--dtype", "float32", "--max-total-tokens", "4096") as s:
        names = sorted(p.name() for p in s.children())
        assert [n for n in names if n.startswith("srt_lite::scheduler")] == [
            "srt_lite::scheduler_TP0", "srt_lite::scheduler_TP1", "srt_lite::scheduler_TP2"
        ]
        r = httpx.post(s.base_url + "/generate", json={"text": prompts, "sampling_params": params}, timeout=300)
        assert [o["text"] for o in r.json()] == ref
        children = s.children()
        assert s.stop() == 0  # SIGTERM
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, "no rank is left behind"


def test_tp_size_not_dividing_heads_is_refused():
    r = subprocess.run([sys.executable, "-m", "srt_lite.launch_server", "--tp-size", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: --tp-size 2 does not divide the model's 9 attention heads")


def test_killed_rank_takes_tp_server_down(tiny_model):
    with ServerProcess("--model-path", tiny_model, "--tp-size", "2", "--dtype", "float32", "--max-total-tokens", "512") as s:
        children = s.children()
        ok = httpx.post(s.base_url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        assert ok.status_code == 200
        next(p for p in children if p.name() == "srt_lite::scheduler_TP1").kill()
        assert s.proc.wait(15) != 0
        assert "scheduler_TP1 died unexpectedly" in s.read_log()
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive
