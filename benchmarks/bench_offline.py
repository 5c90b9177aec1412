"""Offline throughput on the Python Engine API, in the shape of nano-vllm's bench.py.

    python benchmarks/bench_offline.py [--num-prompts 256] [--max-total-tokens 65536]

Random token-id prompts with lengths uniform in [--min-input, --max-input] and output lengths
uniform in [--min-output, --max-output], all with ignore_eos so each request generates exactly
its output length. Every request is submitted at once and the whole batch is timed; reports
output tok/s and total (input + output) tok/s. No HTTP: this measures the engine alone.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from tqdm import tqdm

import srt_lite

MAX_TOKEN_ID = 10000  # nano-vllm draws prompt ids from [0, 10000)


def make_requests(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(args.seed)
    high = min(MAX_TOKEN_ID, vocab_size)  # tiny test models have small vocabularies
    input_ids, params = [], []
    for _ in range(args.num_prompts):
        input_ids.append([rng.randrange(high) for _ in range(rng.randint(args.min_input, args.max_input))])
        params.append({
            "max_new_tokens": rng.randint(args.min_output, args.max_output),
            "ignore_eos": True,
            "temperature": args.temperature,
        })
    return input_ids, params


async def generate_with_progress(engine: srt_lite.Engine, input_ids: list[list[int]], params: list[dict]) -> list[dict]:
    """All requests in flight at once, like one batched generate call, but each completion
    ticks a progress bar (a single blocking call gives nothing to tick)."""
    bar = tqdm(total=len(input_ids), desc="requests")

    async def one(ids: list[int], p: dict) -> dict:
        out = await engine.async_generate(input_ids=ids, sampling_params=p)
        bar.update(1)
        return out

    try:
        return await asyncio.gather(*(one(ids, p) for ids, p in zip(input_ids, params)))
    finally:
        bar.close()


def engine_kwargs(args: argparse.Namespace) -> dict:
    # Only what the user set, so the Engine's own defaults apply otherwise.
    kwargs = {"log_level": args.log_level}
    for name in ("model_path", "max_total_tokens", "dtype", "tp_size"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    return kwargs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=256, help="requests, all submitted at once")
    ap.add_argument("--min-input", type=int, default=100, help="shortest prompt in tokens")
    ap.add_argument("--max-input", type=int, default=1024, help="longest prompt in tokens")
    ap.add_argument("--min-output", type=int, default=100, help="fewest tokens generated")
    ap.add_argument("--max-output", type=int, default=1024, help="most tokens generated")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    ap.add_argument("--seed", type=int, default=0, help="seeds the prompts and lengths")
    ap.add_argument("--disable-tqdm", action="store_true",
                    help="submit with one blocking engine.generate call instead")
    g = ap.add_argument_group("engine (passed only when set)")
    g.add_argument("--model-path", default=None)
    g.add_argument("--max-total-tokens", type=int, default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument("--tp-size", type=int, default=None)
    # Warning by default: the engine's periodic decode log lines would break up the progress bar.
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                    help="the Engine's log level")
    args = ap.parse_args(argv)
    if not (0 < args.min_input <= args.max_input and 0 < args.min_output <= args.max_output):
        ap.error("need 0 < min <= max for input and output lengths")
    return args


def main() -> None:
    args = parse_args()
    with srt_lite.Engine(**engine_kwargs(args)) as engine:
        input_ids, params = make_requests(args, len(engine.tokenizer_manager.tokenizer))
        # Untimed: the first request pays one-off costs (allocations, kernel selection).
        engine.generate(input_ids=input_ids[0][:16], sampling_params={"max_new_tokens": 4, "ignore_eos": True})

        start = time.perf_counter()
        if args.disable_tqdm:
            outs = engine.generate(input_ids=input_ids, sampling_params=params)
        else:
            outs = asyncio.run(generate_with_progress(engine, input_ids, params))
        elapsed = time.perf_counter() - start

    input_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    output_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    short = sum(o["meta_info"]["completion_tokens"] != p["max_new_tokens"] for o, p in zip(outs, params))
    print(f"Requests: {len(outs)}, input tokens: {input_tokens}, output tokens: {output_tokens}"
          + (f" ({short} requests short of their output length)" if short else ""))
    print(f"Time: {elapsed:.2f}s, output throughput: {output_tokens / elapsed:.2f} tok/s, "
          f"total throughput: {(input_tokens + output_tokens) / elapsed:.2f} tok/s")


if __name__ == "__main__":
    main()
