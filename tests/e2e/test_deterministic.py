"""Deterministic inference (--enable-deterministic-inference): a request's tokens and logprobs
are bit-identical sent alone to an idle server, sent with all the others at random moments
under KV pressure (retraction and resumption, chunked prompts, radix-cache hits, n=2
siblings and JSON-schema rows beside it), and after a restart. Run on the default model in
the machine's default dtype (and, through the cpu_caps leg of `make test`, capped at AVX2),
its GGUF file on the native 4-bit path, a bf16 Hugging Face directory, and tp=2; the ranks'
sums in rank order at tp=3."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import torch.multiprocessing as mp

from server_utils import ServerProcess
from tiny_models import make_tp_llama
from srt_lite.distributed import parallel_state
from srt_lite.model_loader.default_model import default_gguf_path
from srt_lite.utils import get_free_port

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
SHARED = "You are a careful assistant who answers in one short sentence. " * 8  # a cached prefix
STORY = "The old ship left the harbour at dawn, and the sea was grey and calm. "  # long prompts chunk


def pressure(kv_tokens: int) -> list[str]:
    """A KV pool small enough that the concurrent run retracts requests; prompts longer than a chunk."""
    return ["--max-running-requests", "6", "--max-total-tokens", str(kv_tokens), "--chunked-prefill-size", "64"]


def requests(n: int, long_output: int = 48) -> list[dict]:
    """n /generate bodies mixing what can change a batch's rounding; a third of them (n=2
    siblings and sampled counting) run long_output tokens past EOS."""
    out = []
    for i in range(n):
        params: dict = {"max_new_tokens": 12}
        greedy = i % 2 == 0
        params.update({"temperature": 0} if greedy else {"temperature": 1.0, "seed": 1000 + i})
        kind = i % 6
        if kind in (0, 1):
            text = SHARED + f"Question {i}: what colour is the sky at noon?"
        elif kind == 2:
            text = STORY * (3 + i % 5) + f"Chapter {i}:"
        elif kind == 3:
            text = f"List three animals that start with the letter {chr(65 + i % 26)}:"
            params.update(n=2, temperature=0.8, seed=2000 + i, max_new_tokens=long_output, ignore_eos=True)
        elif kind == 4:
            text = f"Person {i} as JSON:"
            params["json_schema"] = json.dumps(SCHEMA)
            params["max_new_tokens"] = 24
        else:
            text = f"Count from {i} to {i + 9}:"
            # Long outputs: admission expects less, so the concurrent run retracts some.
            params.update(temperature=0.7, top_p=0.9, top_k=40, seed=3000 + i, max_new_tokens=long_output, ignore_eos=True)
        out.append({"text": text, "sampling_params": params, "return_logprob": True})
    return out


def token_requests(n: int, vocab: int) -> list[dict]:
    """requests(n) as token ids, for a tiny model with a vocabulary of its own (no schema:
    its random weights would never close the JSON)."""
    rng = random.Random(7)
    shared = [rng.randrange(vocab) for _ in range(80)]
    out = []
    for i, body in enumerate(requests(n)):
        ids = shared + [rng.randrange(vocab) for _ in range(4)] if i % 3 == 0 else [rng.randrange(vocab) for _ in range(10 + 30 * (i % 4))]
        params = {k: v for k, v in body["sampling_params"].items() if k != "json_schema"}
        out.append({"input_ids": ids, "sampling_params": params, "return_logprob": True})
    return out


def result(body: dict, response: dict | list) -> list[tuple]:
    """(output ids, their logprobs) of each choice: what must not change."""
    choices = response if isinstance(response, list) else [response]
    assert len(choices) == body["sampling_params"].get("n", 1)
    return [(tuple(c["output_ids"]), tuple(lp for lp, _, _ in c["meta_info"]["output_token_logprobs"])) for c in choices]


def alone(server: ServerProcess, bodies: list[dict]) -> list:
    out = []
    for body in bodies:
        r = httpx.post(server.base_url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        out.append(result(body, r.json()))
    return out


def together(server: ServerProcess, bodies: list[dict], seed: int, spread: float = 1.5) -> list:
    """All bodies at once, each sent after a random delay of up to `spread` seconds, in a
    shuffled order."""
    rng = random.Random(seed)
    delays = [rng.uniform(0, spread) for _ in bodies]

    def send(i: int):
        time.sleep(delays[i])
        r = httpx.post(server.base_url + "/generate", json=bodies[i], timeout=600)
        assert r.status_code == 200, r.text
        return result(bodies[i], r.json())

    order = list(range(len(bodies)))
    rng.shuffle(order)
    with ThreadPoolExecutor(len(bodies)) as pool:
        got = dict(zip(order, pool.map(send, order)))
    return [got[i] for i in range(len(bodies))]


def server_state(server: ServerProcess) -> dict:
    info = httpx.get(server.base_url + "/server_info", timeout=30).json()
    assert info["deterministic"] is True, info["deterministic_gaps"]
    return info


def check_invariant(args: list[str], bodies: list[dict], kv_tokens: int = 200) -> None:
    """Alone, together (with retractions), and together again after a restart: equal."""
    with ServerProcess(*args, "--enable-deterministic-inference", *pressure(kv_tokens)) as s:
        server_state(s)
        want = alone(s, bodies)
        # Whether the pressure retracts depends on arrival timing: another random arrival
        # order, up to three, until it does, then all of them at once (on a fast CPU the
        # first arrivals can finish before the last come); every one must equal the
        # requests alone.
        for seed, spread in ((1, 1.5), (11, 1.5), (21, 1.5), (31, 0.0)):
            assert together(s, bodies, seed=seed, spread=spread) == want
            if server_state(s)["load"]["num_retractions"] > 0:
                break
        assert server_state(s)["load"]["num_retractions"] > 0  # the pressure did what it is there for
    with ServerProcess(*args, "--enable-deterministic-inference", *pressure(kv_tokens)) as s:
        assert together(s, bodies, seed=2) == want


@pytest.mark.slow
@pytest.mark.cpu_caps
def test_default_model_is_batch_invariant():
    """48 requests on the default model in this CPU's default dtype. Their long outputs are
    shorter than the 12-request cases', and the pool smaller to retract all the same."""
    check_invariant([], requests(48, long_output=24), kv_tokens=170)


@pytest.mark.slow
def test_gguf_file_is_batch_invariant():
    """The default model from its own GGUF file: the 4-bit products for every row count."""
    check_invariant(["--model-path", default_gguf_path()], requests(12))


@pytest.mark.slow
def test_bf16_directory_is_batch_invariant():
    """A Hugging Face directory in bf16 (no 4-bit copies): the bf16 products."""
    check_invariant(["--quantization", "none", "--dtype", "bfloat16"], requests(12))


@pytest.fixture(scope="module")
def tiny_tp_model(tmp_path_factory) -> str:
    """Heads of 16: tp=2 splits them; the C++ attention takes 16."""
    return make_tp_llama(tmp_path_factory.mktemp("tiny_det_tp"), 128, 512, 512, torch.bfloat16)


@pytest.mark.slow
def test_tensor_parallel_is_batch_invariant(tiny_tp_model):
    check_invariant(["--model-path", tiny_tp_model, "--tp-size", "2", "--dtype", "bfloat16"], token_requests(12, 512))


def _reduce_rank(rank: int, size: int, port: int, out: str) -> None:
    """One rank of test_tensor_parallel_sums_in_rank_order: this rank's parts of 40 rows,
    reduced whole and in slices of other row counts."""
    parallel_state.init_distributed(rank, size, "cpu", f"127.0.0.1:{port}")
    parallel_state.sum_in_rank_order(True)
    gen = torch.Generator().manual_seed(rank)
    # [40, 96]: magnitudes over many binades, so that the order of a sum shows in its rounding
    part = torch.randn(40, 96, generator=gen) * torch.exp(4 * torch.randn(40, 96, generator=gen))
    got = {f"{a}:{b}": parallel_state.tp_all_reduce(part[a:b].clone()) for a, b in ((0, 40), (5, 6), (0, 7), (3, 40))}
    torch.save({"part": part, "sums": got}, f"{out}.{rank}")
    # Leaves as a scheduler rank does (after a barrier, without C++ teardown): destroying the
    # gloo group while a peer's connections close can make gloo's threads abort the process.
    parallel_state.exit_together(0)


def test_tensor_parallel_sums_in_rank_order(tmp_path):
    """With three ranks a ring all-reduce starts each element's sum at a rank picked by where the
    element falls in the buffer; in rank order, a row's sum is ((p0 + p1) + p2) whatever the
    rows beside it, on every rank."""
    size, out = 3, str(tmp_path / "sums")
    mp.spawn(_reduce_rank, args=(size, get_free_port(), out), nprocs=size)
    ranks = [torch.load(f"{out}.{r}") for r in range(size)]
    want = (ranks[0]["part"] + ranks[1]["part"]) + ranks[2]["part"]
    for r in ranks:
        for span, got in r["sums"].items():
            a, b = map(int, span.split(":"))
            assert torch.equal(got, want[a:b]), span


def test_what_is_not_batch_invariant_is_reported():
    """The flag never claims more than holds: CUDA, torch's fp32 matmul, oneDNN's packed path
    and torch.compile are named; the C++ CPU paths are not."""
    from srt_lite import cpu_kernels
    from srt_lite.model_executor import determinism
    from srt_lite.layers.cpu_linear.paths import PATH_F32_PANELS, PATH_PACKED, PATH_PANELS, PATH_TORCH

    def gaps(**kw):
        args = dict(device="cpu", dtype=torch.bfloat16, linear_path=PATH_PANELS, head_dims={64}, torch_compile=False)
        return determinism.gaps(**{**args, **kw})

    if cpu_kernels.load():
        assert gaps() == [] and gaps(dtype=torch.float32, linear_path=PATH_F32_PANELS) == []
        assert "attention" in gaps(head_dims={8})[0]  # a head size the C++ op does not take
    assert "cuda" in gaps(device="cuda")[0]
    assert any("fp32 matmul" in g for g in gaps(dtype=torch.float32, linear_path=PATH_TORCH))
    assert any("onednn" in g for g in gaps(linear_path=PATH_PACKED))
    assert any("torch-compile" in g for g in gaps(torch_compile=True))


@pytest.mark.slow
def test_speculative_decoding_changes_no_greedy_token():
    """NGRAM drafts verified several rows at a time give the tokens one-row steps give."""
    bodies = [b for b in requests(24) if b["sampling_params"].get("temperature") == 0]
    for b in bodies:
        b["sampling_params"]["max_new_tokens"] = 32
    with ServerProcess("--enable-deterministic-inference") as s:
        want = [[ids for ids, _ in r] for r in together(s, bodies, seed=3)]
    with ServerProcess("--enable-deterministic-inference", "--speculative-algorithm", "ngram") as s:
        got = [[ids for ids, _ in r] for r in together(s, bodies, seed=4)]
    assert got == want
