"""The user's GGUF workload of shared/BENCHMARKS.md: srt_lite and llama.cpp's server on the
same K-quant and Q8_0 files, both up at once.

    .venv/bin/python benchmarks/bench_gguf.py make DIR          # writes the files (once)
    .venv/bin/python benchmarks/bench_gguf.py run DIR/1b-Q4_K_M.gguf [--rounds 8]

`make` writes, with gguf-py, an F16 GGUF of a Llama with Llama-3.2-1B's layer shape (hidden
2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192, tied embeddings) and random normal
weights, with SmolLM2's tokenizer padded to 128256 tokens; and the default model's weights as
F16. llama.cpp's own quantizer (`llama_model_quantize`, from llama-cpp-python in its own venv:
$LLAMACPP_PYTHON, default .bench-venvs/llama/bin/python) turns each into Q4_K_M and Q8_0.

`run` starts srt_lite (`--model-path FILE`, its defaults) and llama.cpp's server (`--n_ctx
4096 --n_threads <cores>`) on the same file, warms both, then for each round probes the read
bandwidth, sends one-stream requests to each engine in turn (which goes first alternates from
round to round, so that neither always follows the other's or its own heavier work) and then
4 and 8 concurrent 64-token streams to srt_lite alone. One-stream requests are greedy
completions of a fixed prompt, 64 tokens less 1 token (decode tok/s with the prefill
cancelled; no logit_bias: llama-cpp-python applies it in Python, and the token counts are
reported), and a ~512-token prompt with one output token (prefill).

A shared host's memory bandwidth can change between two requests a few seconds apart
(docs/benchmarks.md), so a median of each engine's own rounds can pair different conditions.
Reported: medians over the rounds, every round's figures, and the one-stream ratio
per round (the two engines' requests of a round ran seconds apart) with its median, which
is the figure to quote. Also each server's start time and memory (PSS summed over its
processes), and the roofline fraction of single-stream decode against the best read
bandwidth measured in the run (bandwidth.py's probe; the file's tensor bytes per token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bandwidth import read_rates_gbs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHAPE_1B = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192, "vocab": 128256}
QUANTS = ("Q4_K_M", "Q8_0")
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _llamacpp_python() -> str:
    return os.environ.get("LLAMACPP_PYTHON", str(ROOT / ".bench-venvs" / "llama" / "bin" / "python"))


# ---- make ---------------------------------------------------------------------------------

def _tokenizer_fields(vocab: int) -> dict:
    """The default model's tokenizer metadata, padded with unused tokens to `vocab`."""
    from srt_lite.model_loader.default_model import default_gguf_path
    from srt_lite.model_loader.gguf_reader import GGUFFile, StringArray

    # Arrays of strings come undecoded (StringArray); the writer takes lists.
    fields = {k: list(v) if isinstance(v, StringArray) else v
              for k, v in GGUFFile(default_gguf_path()).metadata.items() if k.startswith("tokenizer.")}
    tokens = list(fields["tokenizer.ggml.tokens"])
    pad = vocab - len(tokens)
    if pad > 0:
        fields["tokenizer.ggml.tokens"] = tokens + [f"<|unused_{i}|>" for i in range(pad)]
        fields["tokenizer.ggml.token_type"] = list(fields["tokenizer.ggml.token_type"]) + [5] * pad  # UNUSED
    return fields


def _write_header(w, fields: dict, shape: dict, rope_base: float) -> None:
    from gguf import GGUFValueType

    w.add_context_length(8192)
    w.add_embedding_length(shape["hidden"])
    w.add_block_count(shape["layers"])
    w.add_feed_forward_length(shape["intermediate"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_base)
    w.add_vocab_size(shape["vocab"])
    w.add_file_type(1)  # mostly F16
    for key, value in fields.items():
        if isinstance(value, list):
            sub = GGUFValueType.STRING if isinstance(value[0], str) else GGUFValueType.INT32
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=sub)
        elif isinstance(value, str):
            w.add_key_value(key, value, GGUFValueType.STRING)
        elif isinstance(value, bool):
            w.add_key_value(key, value, GGUFValueType.BOOL)
        else:
            w.add_key_value(key, value, GGUFValueType.UINT32)


def write_f16(path: str, name: str, tensors, fields: dict, shape: dict, rope_base: float) -> None:
    """An F16 GGUF (norms F32) of (GGUF name, array) pairs, written as llama.cpp reads it."""
    from gguf import GGUFWriter

    w = GGUFWriter(path, "llama")
    w.add_name(name)
    _write_header(w, fields, shape, rope_base)
    for tname, arr in tensors:
        w.add_tensor(tname, arr.astype(np.float32 if arr.ndim == 1 else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def random_1b_tensors(shape: dict):
    rng = np.random.default_rng(0)
    h, inter, hd = shape["hidden"], shape["intermediate"], shape["hidden"] // shape["heads"]

    def normal(*dims: int) -> np.ndarray:
        return rng.standard_normal(dims, dtype=np.float32) * 0.02

    yield "token_embd.weight", normal(shape["vocab"], h)
    for i in range(shape["layers"]):
        yield f"blk.{i}.attn_norm.weight", np.ones(h, np.float32)
        yield f"blk.{i}.attn_q.weight", normal(shape["heads"] * hd, h)
        yield f"blk.{i}.attn_k.weight", normal(shape["kv_heads"] * hd, h)
        yield f"blk.{i}.attn_v.weight", normal(shape["kv_heads"] * hd, h)
        yield f"blk.{i}.attn_output.weight", normal(h, shape["heads"] * hd)
        yield f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32)
        yield f"blk.{i}.ffn_gate.weight", normal(inter, h)
        yield f"blk.{i}.ffn_up.weight", normal(inter, h)
        yield f"blk.{i}.ffn_down.weight", normal(h, inter)
    yield "output_norm.weight", np.ones(h, np.float32)


def default_model_tensors():
    """The default model's weights, dequantized from its file, under their GGUF names (q and
    k rows as the file stores them)."""
    from srt_lite.model_loader.default_model import default_gguf_path
    from srt_lite.model_loader.gguf_reader import GGUFFile
    from srt_lite.model_loader.gguf_types import dequantize

    f = GGUFFile(default_gguf_path())
    for name, t in f.tensors.items():
        yield name, dequantize(f.raw(name), t.type, t.cols).view(t.shape).numpy()


def make(out: str) -> None:
    from srt_lite.model_loader.default_model import default_gguf_path
    from srt_lite.model_loader.gguf_reader import GGUFFile

    os.makedirs(out, exist_ok=True)
    jobs = []
    f16 = os.path.join(out, "1b-F16.gguf")
    if not os.path.exists(f16):
        write_f16(f16, "llama-1b-shape", random_1b_tensors(SHAPE_1B), _tokenizer_fields(SHAPE_1B["vocab"]), SHAPE_1B,
                  500000.0)
    jobs.append(("1b", f16))
    small = os.path.join(out, "smollm2-135m-F16.gguf")
    if not os.path.exists(small):
        src = GGUFFile(default_gguf_path())
        shape = {"hidden": 576, "layers": 30, "heads": 9, "kv_heads": 3, "intermediate": 1536, "vocab": 49152}
        write_f16(small, "SmolLM2-135M-Instruct", default_model_tensors(), _tokenizer_fields(0), shape,
                  float(src.get("llama.rope.freq_base")))
    jobs.append(("smollm2-135m", small))
    for stem, src in jobs:
        for quant in QUANTS:
            dst = os.path.join(out, f"{stem}-{quant}.gguf")
            if os.path.exists(dst):
                continue
            code = (
                "import llama_cpp, sys\n"
                "p = llama_cpp.llama_model_quantize_default_params()\n"
                f"p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_{quant}\n"
                "p.nthread = 0\n"
                "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n"
            )
            subprocess.run([_llamacpp_python(), "-c", code, src, dst + ".tmp"], check=True)
            os.replace(dst + ".tmp", dst)
            print(f"wrote {dst} ({os.path.getsize(dst) / 2**20:.0f} MiB)")


# ---- run ----------------------------------------------------------------------------------

def read_bandwidth_gbs(seconds: float = 3.0) -> float:
    """The best read of the probe (bandwidth.py) over `seconds`."""
    return max(read_rates_gbs(seconds))


def tensor_bytes(path: str) -> int:
    from srt_lite.model_loader.gguf_reader import GGUFFile

    return sum(t.nbytes for t in GGUFFile(path).tensors.values())


class Server:
    def __init__(self, name: str, cmd: list[str], port: int, ready_path: str):
        self.name, self.port, self.ready_path = name, port, ready_path
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(f"/tmp/bench_gguf_{name}.log", "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 600) -> float:
        deadline = self.t0 + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log.name}")
            try:
                if httpx.get(self.base + self.ready_path, timeout=1).status_code == 200:
                    return time.perf_counter() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.name)

    def pss_gib(self) -> float:
        total = 0
        procs = [psutil.Process(self.proc.pid)]
        procs += procs[0].children(recursive=True)
        for p in procs:
            try:
                total += p.memory_full_info().pss
            except psutil.Error:
                pass
        return total / 2**30

    def stop(self) -> None:
        """SIGTERM to the server (which stops its own children), SIGKILL to its group after 30 s."""
        import signal

        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


async def complete(client: httpx.AsyncClient, base: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """One greedy completion: (seconds, completion tokens by the server's own count)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = await client.post(base + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0, int(r.json()["usage"]["completion_tokens"])


async def single_stream(client: httpx.AsyncClient, base: str, model: str, max_tokens: int, prompt: str) -> dict:
    """Decode tok/s of one stream: a max_tokens completion less a one-token one of the same
    (cached) prompt, so the prompt's prefill cancels out."""
    t1, _ = await complete(client, base, model, prompt, 1)
    tn, n = await complete(client, base, model, prompt, max_tokens)
    return {"rate": (n - 1) / max(tn - t1, 1e-9), "tokens": n, "ttft": t1}


async def concurrent_streams(client: httpx.AsyncClient, base: str, model: str, streams: int, rnd: int) -> float:
    """Aggregate tok/s of `streams` 64-token completions sent at once (prompts new to the
    radix cache past the shared instruction, so each round prefills them as the first did)."""
    t0 = time.perf_counter()
    res = await asyncio.gather(*(complete(client, base, model, f"{PROMPT} ({rnd}.{i})", 64) for i in range(streams)))
    return sum(n for _, n in res) / (time.perf_counter() - t0)


async def run_async(args) -> dict:
    model_file = os.path.abspath(args.file)
    threads = os.cpu_count() or 1
    srt = Server("srt_lite", [sys.executable, "-m", "srt_lite.launch_server", "--model-path", model_file, "--port",
                              str(args.port)], args.port, "/health")
    srt_start = srt.wait()
    llama = Server("llamacpp", [_llamacpp_python(), "-m", "llama_cpp.server", "--model", model_file, "--n_ctx", "4096",
                                "--n_threads", str(threads), "--port", str(args.port + 1)], args.port + 1, "/v1/models")
    llama_start = llama.wait()
    servers = {"srt_lite": srt, "llamacpp": llama}
    out: dict = {"file": model_file, "threads": threads, "start_s": {"srt_lite": srt_start, "llamacpp": llama_start}}
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 52)  # ~512 tokens
    try:
        async with httpx.AsyncClient() as client:
            names = {n: (await client.get(s.base + "/v1/models")).json()["data"][0]["id"] for n, s in servers.items()}
            for n, s in servers.items():  # warm: page cache, kernels, first shapes
                await complete(client, s.base, names[n], PROMPT, 16)
                await complete(client, s.base, names[n], f"0 {long_prompt}", 1)
            single = {n: [] for n in servers}
            prefill = {n: [] for n in servers}
            many: dict[int, list[float]] = {4: [], 8: []}
            probes = []
            for rnd in range(args.rounds):
                probes.append(read_bandwidth_gbs(1.0))
                order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
                for n in order:
                    s = servers[n]
                    single[n].append(await single_stream(client, s.base, names[n], 64, args.prompt))
                    prefill[n].append((await complete(client, s.base, names[n], f"{rnd + 1} {long_prompt}", 1))[0])
                for streams in many:  # in every round, so that the host's drift meets them as it meets one stream
                    many[streams].append(await concurrent_streams(client, srt.base, names["srt_lite"], streams, rnd))
            out["single_tok_s"] = {n: statistics.median(r["rate"] for r in v) for n, v in single.items()}
            out["single_tok_s_rounds"] = {n: [round(r["rate"], 2) for r in v] for n, v in single.items()}
            ratios = [a["rate"] / b["rate"] for a, b in zip(single["srt_lite"], single["llamacpp"])]
            out["single_ratio_rounds"] = [round(r, 3) for r in ratios]
            out["single_ratio_median"] = statistics.median(ratios)
            out["single_tokens"] = {n: [r["tokens"] for r in v] for n, v in single.items()}
            out["round_probe_gbs"] = [round(b, 1) for b in probes]
            out["prefill_512_s"] = {n: statistics.median(v) for n, v in prefill.items()}
            for streams, rates in many.items():
                out[f"srt_lite_{streams}_streams_tok_s"] = statistics.median(rates)
                out[f"srt_lite_{streams}_streams_tok_s_rounds"] = [round(r, 2) for r in rates]
            out["pss_gib"] = {n: s.pss_gib() for n, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    out["read_bandwidth_gbs_end"] = read_bandwidth_gbs()
    bw = max(out["read_bandwidth_gbs_end"], *probes)
    out["read_bandwidth_gbs"] = bw
    out["roofline_tok_s"] = bw * 1e9 / tensor_bytes(model_file)
    out["srt_lite_roofline_fraction"] = out["single_tok_s"]["srt_lite"] / out["roofline_tok_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out")
    r = sub.add_parser("run")
    r.add_argument("file")
    r.add_argument("--rounds", type=int, default=8)
    r.add_argument("--prompt", default=PROMPT, help="the one-stream prompt; a real model's file needs one it continues "
                   "for 64 tokens rather than ending (e.g. the opening of a story)")
    r.add_argument("--port", type=int, default=30300)
    args = p.parse_args()
    if args.cmd == "make":
        make(args.out)
    else:
        print(json.dumps(asyncio.run(run_async(args)), indent=1))


if __name__ == "__main__":
    main()
