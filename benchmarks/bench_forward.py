"""Time of one forward step of the ModelRunner alone (no scheduler, no sampling, no HTTP).

    python benchmarks/bench_forward.py [--batch-sizes 1,4,16] [--context 300] [--prefill 256,512]
                                       [--dtype auto] [--profile [decode|prefill]]

Decode: B requests whose KV already holds `--context` tokens each compute one new token.
Prefill: one fresh prompt of N tokens. Reports the median ms per step (and tok/s); with
`--profile` also the torch profiler's op table for the first decode batch size (or, with
`--profile prefill`, the first prefill length). This is the
tool for kernel-level work; bench_serving.py measures what users see.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.forward_batch import ForwardBatch
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.model_loader.default_model import resolve_model_path
from srt_lite.server_args import ServerArgs


def build_runner(args: argparse.Namespace) -> ModelRunner:
    # A .gguf file is served from its own blocks (ModelConfig reads it); other names resolve.
    gguf = (args.model_path or "").endswith(".gguf")
    sargs = ServerArgs(
        model_path=args.model_path if gguf else resolve_model_path(args.model_path),
        dtype=args.dtype,
        quantization=args.quantization,
        enable_deterministic_inference=args.deterministic,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=max(args.batch_sizes) + 1,
    )
    config = ModelConfig.load(sargs.model_path, sargs.context_length)
    return ModelRunner(config, sargs)


def make_batch(runner: ModelRunner, rows: list[int], prefix_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
    """Slots are written into req_to_token for the new tokens; prefix slots were set up front."""
    r2t = runner.req_to_token_pool.req_to_token
    locs = []
    for row, p, e in zip(rows, prefix_lens, extend_lens):
        slots = r2t[row, p : p + e].to(torch.int64)  # reuse the row's preassigned slots
        locs.append(slots)
    return ForwardBatch.create(
        input_ids=[i % 1000 + 1 for i in range(sum(extend_lens))],
        req_pool_indices=rows,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        out_cache_loc=torch.cat(locs),
        device=runner.device,
    )


def time_step(runner: ModelRunner, fb_factory, steps: int) -> float:
    times = []
    for i in range(steps + 2):
        fb = fb_factory()
        t0 = time.perf_counter()
        runner.forward(fb)
        if i >= 2:  # the first runs warm up allocator and kernels
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, choices=["gguf", "none"])
    parser.add_argument("--batch-sizes", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--context", type=int, default=300, help="KV tokens per request before the decode step")
    parser.add_argument("--shared-prefix", type=int, default=0, help="KV slots every decode row shares (a radix-cache hit)")
    parser.add_argument("--prefill", default="256,512", type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--deterministic", action="store_true", help="--enable-deterministic-inference")
    parser.add_argument(
        "--profile", nargs="?", const="decode", choices=["decode", "prefill"], default=None,
        help="profile the first decode batch size (default) or the first prefill length",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    runner = build_runner(args)
    pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    # Every request row gets context + 1 distinct slots up front, holding random KV of a real
    # pool's scale. Not the pool's uninitialised memory: it can hold denormal floats, which
    # some CPUs (Intel's) compute many times slower than normal ones, and real KV never does.
    max_b = max(args.batch_sizes)
    rows = [runner.req_to_token_pool.alloc() for _ in range(max_b)]
    shared = pool.alloc(args.shared_prefix).to(torch.int32) if args.shared_prefix else None
    for row in rows:
        r2t[row, : args.context + 1] = pool.alloc(args.context + 1).to(torch.int32)
        if shared is not None:
            r2t[row, : args.shared_prefix] = shared
    g = torch.Generator().manual_seed(0)
    for buf in pool.k_buffer + pool.v_buffer:
        buf[1:].copy_(torch.randn(buf[1:].shape, generator=g))
    print(f"dtype {runner.dtype}, threads {torch.get_num_threads()}, context {args.context}, shared prefix {args.shared_prefix}")
    for b in args.batch_sizes:
        ms = time_step(runner, lambda: make_batch(runner, rows[:b], [args.context] * b, [1] * b), args.steps)
        print(f"decode  B={b:<4d} {ms:8.1f} ms/step  {b / ms * 1e3:8.1f} tok/s")
    prompt_row = rows[0]
    for n in args.prefill:
        if n > args.context + 1:
            r2t[prompt_row, :n] = pool.alloc(n).to(torch.int32)
        ms = time_step(runner, lambda: make_batch(runner, [prompt_row], [0], [n]), max(args.steps // 3, 3))
        print(f"prefill N={n:<4d} {ms:8.1f} ms/step  {n / ms * 1e3:8.1f} tok/s")
    if args.profile:
        b, n = args.batch_sizes[0], args.prefill[0] if args.prefill else 0
        from torch.profiler import ProfilerActivity, profile

        def batch() -> ForwardBatch:
            if args.profile == "prefill":
                return make_batch(runner, [prompt_row], [0], [n])
            return make_batch(runner, rows[:b], [args.context] * b, [1] * b)

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                runner.forward(batch())
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
