"""Soak test: mixed traffic against a running server for a fixed time, watching for errors,
latency drift and memory growth.

    python benchmarks/soak.py --base-url http://127.0.0.1:30000 --duration 1800 [--concurrency 4]

Each worker loops over a mix of requests: chat and completions, streaming and not, stop
strings, seeds, n > 1, logprobs, the native /generate, and streams the client drops midway
(the intended aborts). Every `--sample-interval` seconds it records the RSS of the server's
process tree and the KV usage from /get_server_info. At the end it waits for the server to
go idle and reports errors, latency percentiles per kind, RSS drift (from the first sample
after warm-up at which the KV cache had been filled once, to the last) and KV in use. Exit code 1 when any request failed or KV is still
held; the JSON report goes to benchmarks/results/soak-<label>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import psutil

logger = logging.getLogger("soak")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
WORDS = "alpha river stone light music paper cloud garden window silver orange quiet".split()


@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    aborted: int = 0  # streams the client dropped on purpose

    def ok(self, kind: str, seconds: float) -> None:
        self.latencies.setdefault(kind, []).append(seconds)


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))


async def sse_events(r: httpx.Response):
    async for line in r.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def one_request(
    client: httpx.AsyncClient, rng: random.Random, model: str, stats: Stats, temperature: float | None = None
) -> None:
    """One request of a random kind; `temperature` (if set) replaces every kind's own."""

    def temp(default: float) -> float:
        return default if temperature is None else temperature

    kind = rng.choice(["chat", "chat_stream_stop", "completion_n", "completion_stream_logprobs", "generate", "dropped_stream"])
    t0 = time.perf_counter()
    seed = rng.randint(0, 2**31)
    max_tokens = rng.randint(4, 48)
    if kind == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": max_tokens,
                "temperature": temp(0.8), "seed": seed}
        r = await client.post("/v1/chat/completions", json=body)
        check(r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), kind, r, stats)
    elif kind == "completion_n":
        body = {"model": model, "prompt": prompt(rng), "max_tokens": max_tokens, "n": rng.randint(2, 3),
                "temperature": temp(1.0), "seed": seed}
        r = await client.post("/v1/completions", json=body)
        check(r.status_code == 200 and len(r.json()["choices"]) == body["n"], kind, r, stats)
    elif kind == "generate":
        body = {"text": prompt(rng), "sampling_params": {"max_new_tokens": max_tokens, "temperature": temp(0.0)}}
        r = await client.post("/generate", json=body)
        check(r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] in ("stop", "length"), kind, r, stats)
    else:
        stream_body = {
            "chat_stream_stop": ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt(rng)}], "stop": [".", "\n"]}),
            "completion_stream_logprobs": ("/v1/completions", {"prompt": prompt(rng), "logprobs": 2}),
            "dropped_stream": ("/v1/completions", {"prompt": prompt(rng), "ignore_eos": True}),
        }[kind]
        path, extra = stream_body
        body = {"model": model, "max_tokens": max_tokens if kind != "dropped_stream" else 200, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": temp(1.0), **extra}
        cut = rng.randint(1, 10) if kind == "dropped_stream" else None
        finish = None
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return check(False, kind, r, stats)
            n = 0
            async for event in sse_events(r):
                n += 1
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                if cut is not None and n >= cut:
                    stats.aborted += 1
                    return  # leaving the block closes the connection: the server must abort
        if finish not in ("stop", "length"):
            stats.errors.append(f"{kind}: stream ended without a finish_reason ({finish})")
            return
    stats.ok(kind, time.perf_counter() - t0)


def check(ok: bool, kind: str, r: httpx.Response, stats: Stats) -> None:
    if not ok:
        stats.errors.append(f"{kind}: HTTP {r.status_code} {r.text[:200]}")


async def worker(
    client: httpx.AsyncClient, rng: random.Random, model: str, stats: Stats, end: float, temperature: float | None
) -> None:
    while time.monotonic() < end:
        try:
            await one_request(client, rng, model, stats, temperature)
        except (httpx.HTTPError, KeyError, ValueError) as e:
            stats.errors.append(f"{type(e).__name__}: {e}")


def server_tree_rss_mb(pid: int) -> float:
    proc = psutil.Process(pid)
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def find_server_pid(base_url: str) -> int:
    port = urlparse(base_url).port
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return conn.pid
    raise SystemExit(f"no process listens on port {port}; pass --server-pid")


async def sample(client: httpx.AsyncClient, pid: int, t0: float) -> dict:
    row = {"t": round(time.monotonic() - t0, 1), "rss_mb": round(server_tree_rss_mb(pid), 1)}
    try:
        load = (await client.get("/get_server_info")).json().get("load", {})
        keys = ("kv_used_tokens", "kv_cached_tokens", "kv_capacity", "num_running_reqs", "num_waiting_reqs")
        row.update({k: load[k] for k in keys if k in load})
    except (httpx.HTTPError, ValueError):
        pass  # another server without this endpoint: RSS only
    return row


async def run(args: argparse.Namespace) -> dict:
    pid = args.server_pid or find_server_pid(args.base_url)
    stats, samples = Stats(), []
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.monotonic()
        end = t0 + args.duration
        tasks = [asyncio.create_task(worker(client, random.Random(args.seed + i), model, stats, end, args.temperature)) for i in range(args.concurrency)]
        while time.monotonic() < end:
            samples.append(await sample(client, pid, t0))
            logger.info("%s", samples[-1] | {"errors": len(stats.errors), "done": sum(map(len, stats.latencies.values()))})
            await asyncio.sleep(min(args.sample_interval, max(end - time.monotonic(), 0)))
        await asyncio.gather(*tasks)
        # Idle: every request finished or aborted, so no KV may stay in use.
        deadline = time.monotonic() + 30
        while True:
            final = await sample(client, pid, t0)
            if final.get("kv_used_tokens", 0) == 0 and final.get("num_running_reqs", 0) == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        samples.append(final)
    warm = drift_baseline(samples, args.warmup)
    report = {
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "requests": {k: len(v) for k, v in stats.latencies.items()},
        "intended_aborts": stats.aborted,
        "errors": len(stats.errors),
        "error_samples": stats.errors[:10],
        "latency_s": {k: percentiles(v) for k, v in stats.latencies.items()},
        "rss_mb": {"baseline_at_s": warm["t"], "baseline": warm["rss_mb"], "end": final["rss_mb"],
                   "max": max(s["rss_mb"] for s in samples), "drift": round(final["rss_mb"] - warm["rss_mb"], 1)},
        "kv_used_tokens_at_end": final.get("kv_used_tokens"),
        "samples": samples,
    }
    return report


def drift_baseline(samples: list[dict], warmup: float) -> dict:
    """The sample RSS drift is measured from: the first after `warmup` s at which the KV cache
    has been filled (>= 90%). KV buffers are allocated untouched, so RSS legitimately rises
    until every page has been used once; growth after that is what a leak would look like.
    Without KV figures (another server), the first sample after `warmup`."""
    later = [s for s in samples if s["t"] >= warmup] or samples[-1:]
    for s in later:
        if "kv_capacity" not in s:
            return later[0]
        if s["kv_used_tokens"] + s["kv_cached_tokens"] >= 0.9 * s["kv_capacity"]:
            return s
    return later[-1]  # never filled: no baseline after warm-up, so no drift is claimed


def percentiles(values: list[float]) -> dict:
    v = sorted(values)
    return {"p50": round(statistics.median(v), 3), "p90": round(v[int(0.9 * (len(v) - 1))], 3), "p99": round(v[int(0.99 * (len(v) - 1))], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--model", default=None, help="unset: the first id of GET /v1/models")
    parser.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sample-interval", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=None, help="RSS drift is measured from this time on, once the KV cache is full (default: 10%% of the duration)")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--server-pid", type=int, default=None, help="default: the process listening on the URL's port")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None,
                        help="use this temperature for every request (0: all greedy, e.g. to soak speculative decoding)")
    parser.add_argument("--label", default="run")
    parser.add_argument("--output-file", default=None)
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = 0.1 * args.duration
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    report = asyncio.run(run(args))
    out = Path(args.output_file) if args.output_file else RESULTS_DIR / f"soak-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=2))
    print(f"saved {out}")
    failed = report["errors"] > 0 or (report["kv_used_tokens_at_end"] or 0) > 0
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
