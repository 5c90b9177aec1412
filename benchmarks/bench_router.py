"""Replicas behind SGLang's router (`pip install sglang-router`): where shared prefixes land,
what that saves, and what a killed worker costs.

    python benchmarks/bench_router.py --policies cache_aware round_robin --failover

Starts --workers srt_lite servers (default flags plus --enable-cache-report and
--enable-metrics), then for each policy a fresh router in front of them (the workers' caches
flushed in between) and sends a shared-prefix chat workload through it: --groups system
prompts of --prefix-words each, every one followed by --per-group different questions, the
groups shuffled together, --concurrency requests in flight, sampled (temperature 0.7, top_p 0.95, a
seed per request, EOS allowed). Reports per policy: the workers' request counts and cache hit
rates, how many requests of a group found their prefix cold (1 means the group stayed on one
worker), prompt tokens actually prefilled, TTFT and output throughput.

--failover then runs the same traffic closed-loop through a cache_aware router for
--failover-seconds, kills one worker (SIGKILL, as a crash) --kill-after seconds in, and counts
the requests that failed before and after the router marked the worker unhealthy (health checks
every second, one failure: router_utils.FAST_HEALTH_CHECKS).

On one machine the workers share its cores (each gets cores / workers threads), so more
replicas cannot be faster here; the point is placement, not speed. Results go to
benchmarks/results/router_<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "helpers"), str(Path(__file__).resolve().parent)]

from bench_serving import RESULTS_DIR, RequestOutput, percentile, stream_request  # noqa: E402
from serving_datasets import WORDS  # noqa: E402
from router_utils import FAST_HEALTH_CHECKS, RouterProcess, kill_worker, start_workers, worker_counters  # noqa: E402

QUESTIONS = [
    "Summarise the policy above in two sentences.",
    "What is the most important rule here?",
    "Write a short email to a customer based on this.",
    "List three questions a new employee might ask.",
    "Explain this to a ten-year-old.",
    "What would you change first, and why?",
    "Write a haiku about it.",
    "Give one example of a case this does not cover.",
]


def system_prompts(groups: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"You are the assistant of team {g}. Read this handbook and answer from it only. "
        + " ".join(rng.choice(WORDS) for _ in range(words))
        for g in range(groups)
    ]


def chat_body(model: str, system: str, question: str, max_tokens: int, seed: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens, "temperature": 0.7, "top_p": 0.95, "seed": seed,
        "stream": True, "stream_options": {"include_usage": True},
    }


async def run_groups(base_url: str, model: str, args: argparse.Namespace) -> tuple[list[tuple[int, RequestOutput]], float]:
    """Every (group, question) once in a seeded random order (a fixed interleaving would let
    round_robin keep a group on one worker by accident); returns (group, output) pairs."""
    prompts = system_prompts(args.groups, args.prefix_words, args.seed)
    order = [(g, q) for q in range(args.per_group) for g in range(args.groups)]
    random.Random(args.seed).shuffle(order)
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(i: int, g: int, q: int) -> tuple[int, RequestOutput]:
            async with gate:
                body = chat_body(model, prompts[g], QUESTIONS[q % len(QUESTIONS)], args.output_len, args.seed + i)
                return g, await stream_request(client, base_url + "/v1/chat/completions", body, "chat")

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, g, q) for i, (g, q) in enumerate(order)))
    return results, time.perf_counter() - t0


def counters(urls: list[str]) -> dict[str, dict[str, float]]:
    return {u: worker_counters(u) for u in urls}


def policy_report(
    policy: str, results: list[tuple[int, RequestOutput]], duration: float, before: dict, after: dict
) -> dict:
    ok = [(g, o) for g, o in results if o.success]
    per_worker = {}
    for url in before:
        delta = {k: after[url][k] - before[url][k] for k in ("num_requests_total", "prompt_tokens_total", "cached_tokens_total")}
        per_worker[url] = {
            "requests": int(delta["num_requests_total"]),
            "hit_rate": delta["cached_tokens_total"] / max(delta["prompt_tokens_total"], 1),
        }
    # A request whose cache covered less than half its prompt prefilled its group's prefix.
    cold = {}
    for g, o in ok:
        cold[g] = cold.get(g, 0) + int((o.cached_tokens or 0) < (o.prompt_len or 0) / 2)
    prompt = sum(o.prompt_len or 0 for _, o in ok)
    cached = sum(o.cached_tokens or 0 for _, o in ok)
    return {
        "policy": policy,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "per_worker": per_worker,
        "hit_rate": cached / max(prompt, 1),
        "prefilled_tokens": prompt - cached,
        "cold_requests_per_group": statistics.fmean(cold.values()) if cold else float("nan"),
        "mean_ttft_ms": 1000 * statistics.fmean(o.ttft for _, o in ok),
        "median_ttft_ms": 1000 * percentile([o.ttft for _, o in ok], 50),
        "output_throughput": sum(o.output_len for _, o in ok) / duration,
        "mean_output_len": statistics.fmean(o.output_len for _, o in ok),
    }


async def closed_loop(base_url: str, model: str, args: argparse.Namespace, seconds: float) -> list[tuple[float, RequestOutput]]:
    """--concurrency clients, each sending its next request as soon as one ends, for
    `seconds`; returns (start time, output) pairs (time.monotonic())."""
    prompts = system_prompts(args.groups, args.prefix_words, args.seed)
    done: list[tuple[float, RequestOutput]] = []
    stop_at = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=600) as client:

        async def client_loop(c: int) -> None:
            i = c
            while time.monotonic() < stop_at:
                g, q = i % args.groups, (i // args.groups) % len(QUESTIONS)
                body = chat_body(model, prompts[g], QUESTIONS[q], args.output_len, args.seed + i)
                start = time.monotonic()
                done.append((start, await stream_request(client, base_url + "/v1/chat/completions", body, "chat")))
                i += args.concurrency

        await asyncio.gather(*(client_loop(c) for c in range(args.concurrency)))
    return done


def failover(workers: list, model: str, args: argparse.Namespace) -> dict:
    victim = workers[-1]
    with RouterProcess([w.base_url for w in workers], "cache_aware", *FAST_HEALTH_CHECKS) as router:
        marks: dict[str, float] = {}

        async def scenario() -> list[tuple[float, RequestOutput]]:
            traffic = asyncio.create_task(closed_loop(router.base_url, model, args, args.failover_seconds))
            await asyncio.sleep(args.kill_after)
            marks["kill"] = time.monotonic()
            kill_worker(victim)
            marks["noticed"] = marks["kill"] + await asyncio.to_thread(router.wait_unhealthy, victim.base_url)
            return await traffic

        done = asyncio.run(scenario())
    phases = {"before_kill": [], "kill_to_notice": [], "after_notice": []}
    for start, out in done:
        phase = "before_kill" if start < marks["kill"] else "kill_to_notice" if start < marks["noticed"] else "after_notice"
        phases[phase].append(out)
    return {
        "noticed_after_s": marks["noticed"] - marks["kill"],
        **{name: {"requests": len(outs), "failed": sum(not o.success for o in outs),
                  "errors": sorted({o.error[:120] for o in outs if not o.success})} for name, outs in phases.items()},
    }


def print_report(reports: list[dict], fail: dict | None) -> None:
    print(f"\n{'policy':<14}{'hit rate':>9}{'cold/group':>11}{'prefilled':>10}{'TTFT mean':>10}{'TTFT p50':>9}"
          f"{'tok/s':>7}{'failed':>7}  per worker (requests, hit rate)")
    for r in reports:
        workers = ", ".join(f"{w['requests']} @ {w['hit_rate']:.0%}" for w in r["per_worker"].values())
        print(f"{r['policy']:<14}{r['hit_rate']:>9.1%}{r['cold_requests_per_group']:>11.2f}{r['prefilled_tokens']:>10}"
              f"{r['mean_ttft_ms']:>8.0f}ms{r['median_ttft_ms']:>7.0f}ms{r['output_throughput']:>7.1f}{r['failed']:>7}  {workers}")
    if fail:
        print(f"\nfailover: router marked the killed worker unhealthy {fail['noticed_after_s']:.1f} s after the kill")
        for name in ("before_kill", "kill_to_notice", "after_notice"):
            p = fail[name]
            print(f"  {name:<15} {p['requests']:>4} requests, {p['failed']} failed {p['errors'] if p['errors'] else ''}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--worker-args", default="", help="extra srt_lite flags for every worker, one string")
    p.add_argument("--threads-per-worker", type=int, default=0, help="OMP_NUM_THREADS per worker; 0: cores / workers")
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--prefix-words", type=int, default=400)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--failover", action="store_true")
    p.add_argument("--failover-seconds", type=float, default=40.0)
    p.add_argument("--kill-after", type=float, default=10.0)
    p.add_argument("--output", default="", help="JSON path (default: benchmarks/results/router_<time>.json)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // args.workers)
    worker_args = ["--enable-cache-report", "--enable-metrics", *args.worker_args.split()]
    workers = start_workers(args.workers, *worker_args, env={"OMP_NUM_THREADS": str(threads)}, warmup=True)
    urls = [w.base_url for w in workers]
    try:
        model = httpx.get(urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        reports = []
        for policy in args.policies:
            for url in urls:
                httpx.post(url + "/flush_cache", timeout=30).raise_for_status()
            before = counters(urls)
            with RouterProcess(urls, policy) as router:
                results, duration = asyncio.run(run_groups(router.base_url, model, args))
            reports.append(policy_report(policy, results, duration, before, counters(urls)))
        fail = failover(workers, model, args) if args.failover else None
    finally:
        for w in workers:
            w.__exit__(None, None, None)
    print_report(reports, fail)
    result = {"args": vars(args), "threads_per_worker": threads, "policies": reports, "failover": fail}
    out = Path(args.output) if args.output else RESULTS_DIR / f"router_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nsaved {out}")
    return result


if __name__ == "__main__":
    main()
