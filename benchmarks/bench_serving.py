"""Online serving benchmark for any OpenAI-compatible server (srt_lite, vLLM, SGLang, ...).

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 \
        --num-prompts 64 --max-concurrency 16 --input-words 200 --output-len 128

Prompts are built locally and seeded, so every engine gets the same requests: `random-words`
draws from the word list of shared/tools/bench_client.py (same seed, same prompts as that
client), `random-ids` sends lists of random token ids. Every request generates exactly
--output-len tokens: `ignore_eos` for servers that know it, and `logit_bias` banning the EOS ids
for those that do not. Requests arrive as a Poisson process (--request-rate) and/or are capped
by a semaphore (--max-concurrency). Reports throughput and TTFT / ITL / TPOT / E2E latency like
SGLang's bench_serving, prints a table and saves JSON under benchmarks/results/.

As a library: `result = asyncio.run(run_benchmark(parse_args([...])))`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import AsyncIterator

import httpx
from tqdm import tqdm

from serving_datasets import RequestInput, build_dataset

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WARMUP_OUTPUT_LEN = 8  # warmup only has to touch every code path, not to be long


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    prompt_len: int | None = None
    output_len: int = 0
    ttft: float = 0.0  # seconds from sending to the first content chunk
    latency: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between content chunks
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported


# ---- one request ------------------------------------------------------------------------


def request_body(args: argparse.Namespace, prompt: str | list[int], output_len: int, seed: int | None = None) -> tuple[str, dict]:
    body = {
        "model": args.model,
        "max_tokens": output_len,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if seed is not None:
        body["seed"] = seed
    if not args.allow_eos:
        body["ignore_eos"] = True
        # Servers that ignore `ignore_eos` still cannot stop early when EOS is unsampleable.
        body["logit_bias"] = {str(t): -100 for t in args.ban}
    if args.backend == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = output_len  # newer servers prefer it over max_tokens
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def chunk_text(choice: dict, backend: str) -> str:
    if backend == "chat":
        delta = choice.get("delta") or {}
        # Reasoning models stream part of their output as reasoning_content: it is output too.
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient, args: argparse.Namespace, req: RequestInput, output_len: int
) -> RequestOutput:
    path, body = request_body(args, req.prompt, output_len, req.seed)
    return await stream_request(client, args.base_url + path, body, args.backend, req.prompt_len)


async def stream_request(
    client: httpx.AsyncClient, url: str, body: dict, backend: str, prompt_len: int | None = None
) -> RequestOutput:
    """One streamed request (`body` asks for usage in the stream), timed chunk by chunk."""
    out = RequestOutput(prompt_len=prompt_len)
    chunks = 0
    usage_tokens = None
    done = False
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                msg = json.loads(data)
                if msg.get("error"):
                    out.error = f"error in stream: {json.dumps(msg['error'])[:300]}"
                    return out
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens", usage_tokens)
                    out.prompt_len = msg["usage"].get("prompt_tokens", out.prompt_len)
                    out.cached_tokens = (msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                if msg.get("choices") and chunk_text(msg["choices"][0], backend):
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
    except Exception as e:  # noqa: BLE001 - a dropped connection or bad SSE is a failed request
        out.error = f"{type(e).__name__}: {e}"[:300]
        return out
    out.latency = time.perf_counter() - start
    if chunks == 0:
        out.ttft = out.latency  # all the text came with the end of the stream
    if not done:
        # A server that closes the stream early has dropped the request, even without an error.
        out.error = "stream ended before [DONE]"
        return out
    # A chunk may carry several tokens, so the server's count wins when it sends one.
    out.output_len = usage_tokens if usage_tokens is not None else chunks
    out.success = True
    return out


# ---- load shape ---------------------------------------------------------------------------


async def arrivals(requests: list[RequestInput], rate: float, rng: random.Random) -> AsyncIterator[RequestInput]:
    """Yields requests as a Poisson process of `rate` per second (all at once if inf)."""
    for i, req in enumerate(requests):
        if i > 0 and not math.isinf(rate):
            await asyncio.sleep(rng.expovariate(rate))
        yield req


async def get_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(base_url + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


# ---- metrics ------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(name: str, xs: list[float]) -> dict:
    mean = statistics.fmean(xs) if xs else float("nan")
    return {
        f"mean_{name}_ms": 1000 * mean,
        f"median_{name}_ms": 1000 * percentile(xs, 50),
        f"p99_{name}_ms": 1000 * percentile(xs, 99),
    }


def summarize(outputs: list[RequestOutput], duration: float, expected_output_len: int) -> dict:
    ok = [o for o in outputs if o.success]
    input_known = [o.prompt_len for o in ok if o.prompt_len is not None]
    total_input = sum(input_known)
    total_output = sum(o.output_len for o in ok)
    # TPOT excludes the first token, so it needs at least two.
    tpots = [(o.latency - o.ttft) / (o.output_len - 1) for o in ok if o.output_len > 1]
    metrics = {
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "duration_s": duration,
        # Only completed requests count: a failed one produced nothing useful.
        "total_input_tokens": total_input,
        "input_tokens_reported": len(input_known),
        "total_output_tokens": total_output,
        "wrong_output_len": sum(o.output_len != expected_output_len for o in ok),
        # Engines stop at different places when EOS is allowed: compare tok/s with this.
        "mean_output_len": total_output / len(ok) if ok else float("nan"),
        "request_throughput": len(ok) / duration,
        "input_throughput": total_input / duration,
        "output_throughput": total_output / duration,
        "total_throughput": (total_input + total_output) / duration,
        # Mean requests in flight: the time they spent in the server over the wall time.
        "concurrency": sum(o.latency for o in ok) / duration,
    }
    metrics.update(stats_ms("ttft", [o.ttft for o in ok]))
    metrics.update(stats_ms("itl", [x for o in ok for x in o.itl]))
    metrics.update(stats_ms("tpot", tpots))
    metrics.update(stats_ms("e2e_latency", [o.latency for o in ok]))
    return metrics


# ---- the benchmark ------------------------------------------------------------------------


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Runs warmup then the timed workload; returns the config, metrics and per-request data."""
    if args.backend == "chat" and args.dataset == "random-ids":
        raise ValueError("the chat backend takes text only: use --dataset random-words")
    args.base_url = args.base_url.rstrip("/")
    # No connection cap: a client-side queue would show up as server TTFT.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, headers=headers) as client:
        if args.model is None:
            args.model = await get_model(client, args.base_url)

        # Warmup prompts use another seed and no shared prefix, so they do not prime the cache
        # that a shared-prefix workload is meant to measure.
        for req in build_dataset(args, args.warmup, args.seed + 1, shared_prefix=False):
            out = await send_request(client, args, req, min(WARMUP_OUTPUT_LEN, args.output_len))
            if not out.success:
                raise RuntimeError(f"warmup request failed: {out.error}")

        requests = build_dataset(args, args.num_prompts, args.seed)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", disable=args.disable_tqdm)
        in_flight = peak = 0

        async def run_one(req: RequestInput) -> RequestOutput:
            nonlocal in_flight, peak
            if sem is not None:
                await sem.acquire()
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send_request(client, args, req, args.output_len)
            finally:
                in_flight -= 1
                if sem is not None:
                    sem.release()
                bar.update(1)

        start = time.perf_counter()
        arrival_rng = random.Random(args.seed)
        tasks = [asyncio.create_task(run_one(req)) async for req in arrivals(requests, args.request_rate, arrival_rng)]
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()

    errors: dict[str, int] = {}
    for o in outputs:
        if not o.success:
            errors[o.error] = errors.get(o.error, 0) + 1
    return {
        "label": args.label,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key", "output_file")},
        **summarize(outputs, duration, args.output_len),
        "peak_concurrency": peak,
        "errors": errors,  # error text -> how many requests failed with it
        "requests": [asdict(o) for o in outputs],
    }


# ---- report -------------------------------------------------------------------------------


def print_report(result: dict) -> None:
    cfg = result["config"]
    width = 60
    rows: list[tuple[str, str] | str] = [
        ("Label", result["label"] or "-"),
        ("Backend", cfg["backend"]),
        ("Model", cfg["model"]),
        ("Dataset", cfg["dataset"]),
        ("Request rate (req/s)", str(cfg["request_rate"])),
        ("Max concurrency", str(cfg["max_concurrency"] or "-")),
        ("Successful requests", str(result["completed"])),
        ("Failed requests", str(result["failed"])),
        ("Benchmark duration (s)", f"{result['duration_s']:.2f}"),
        ("Total input tokens", f"{result['total_input_tokens']}"
         + ("" if result["input_tokens_reported"] == result["completed"]
            else f" ({result['input_tokens_reported']} requests reported)")),
        ("Total generated tokens", str(result["total_output_tokens"])),
        ("Requests with output != --output-len", str(result["wrong_output_len"])),
        ("Mean output length (tokens)", f"{result['mean_output_len']:.1f}"),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{result['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{result['total_throughput']:.2f}"),
        ("Concurrency (mean / peak)", f"{result['concurrency']:.2f} / {result['peak_concurrency']}"),
    ]
    for name, title in (("e2e_latency", "End-to-End Latency"), ("ttft", "Time to First Token"),
                        ("tpot", "Time per Output Token (excl. 1st token)"), ("itl", "Inter-Token Latency")):
        rows.append(title)
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper().replace('_LATENCY', '')} (ms)",
                         f"{result[f'{stat}_{name}_ms']:.2f}"))
    print(" Serving Benchmark Result ".center(width, "="))
    for row in rows:
        if isinstance(row, str):
            print(f" {row} ".center(width, "-"))
        else:
            label = row[0] + ":"
            print(f"{label}{row[1]:>{width - len(label)}}")
    for err, count in result["errors"].items():
        print(f"error x{count}: {err}")
    print("=" * width)


def json_safe(x):
    """inf and nan as strings: strict JSON readers (jq, JavaScript) reject the bare tokens."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = ap.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:30000")
    g.add_argument("--model", default=None, help="model name to send; unset: the first id of GET /v1/models")
    g.add_argument("--backend", choices=["completions", "chat"], default="completions",
                   help="POST /v1/completions or /v1/chat/completions, both streaming with usage")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token")
    g.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    g = ap.add_argument_group("dataset")
    g.add_argument("--dataset", choices=["random-words", "random-ids", "instructions"], default="random-words",
                   help="instructions: varied natural chat requests (INSTRUCTIONS), for --backend chat")
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-words", type=int, default=200, help="random-words: words per prompt")
    g.add_argument("--shared-prefix-words", type=int, default=0,
                   help="random-words: a common prefix of this many words before every prompt")
    g.add_argument("--input-len", type=int, default=1024, help="random-ids: tokens per prompt")
    g.add_argument("--min-token-id", type=int, default=100,
                   help="random-ids: lowest id (low ids are often special tokens)")
    g.add_argument("--max-token-id", type=int, default=10000,
                   help="random-ids: ids are below this (keep under the smallest vocabulary compared)")
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    g = ap.add_argument_group("sampling")
    g.add_argument("--output-len", type=int, default=128, help="tokens generated by every request")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed-per-request", action="store_true",
                   help="send a sampling seed with each request (the same requests get the same seeds)")
    g.add_argument("--allow-eos", action="store_true",
                   help="let requests end at EOS (realistic chat) instead of running to --output-len")
    g.add_argument("--ban", type=int, nargs="*", default=[0, 2],
                   help="token ids banned with logit_bias -100 (the EOS ids), so that every request "
                        "runs to --output-len even on servers without ignore_eos")
    g = ap.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second; inf sends all requests at once")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument("--warmup", type=int, default=2, help="untimed requests sent one by one first")
    g = ap.add_argument_group("output")
    g.add_argument("--label", default="", help="tag stored in the result and used as the file name")
    g.add_argument("--output-file", default=None,
                   help="JSON result path; unset: benchmarks/results/<label or timestamp>.json")
    g.add_argument("--disable-tqdm", action="store_true")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    try:
        result = asyncio.run(run_benchmark(args))
    except (RuntimeError, ValueError, httpx.HTTPError) as e:
        sys.exit(f"bench_serving: {e}")
    print_report(result)
    name = args.label or time.strftime("%Y%m%d-%H%M%S")
    path = Path(args.output_file) if args.output_file else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(result), indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    main()
