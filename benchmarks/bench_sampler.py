"""Micro-benchmark: the batched sampler vs a per-request reference loop.

    python benchmarks/bench_sampler.py [--batch 64] [--vocab 49152] [--iters 20]

A batch with mixed parameters (greedy rows, temperature, top-k, top-p, min_p, penalties,
logit_bias, seeds) is sampled by `Sampler` in one pass and by a loop that treats each request
on its own (what a naive engine does). Prints both medians and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from srt_lite.req import Req
from srt_lite.sampling.sampler import Sampler
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo
from srt_lite.sampling.sampling_params import SamplingParams


def mixed_reqs(batch: int, vocab: int) -> list[Req]:
    g = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(batch):
        kind = i % 6
        params = {
            0: {"temperature": 0},
            1: {"temperature": 0.8, "top_k": 40},
            2: {"temperature": 1.0, "top_p": 0.9},
            3: {"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.1},
            4: {"temperature": 1.0, "frequency_penalty": 0.5, "presence_penalty": 0.3, "seed": i},
            5: {"temperature": 0.9, "top_k": 20, "top_p": 0.95, "logit_bias": {"7": 2.0}},
        }[kind]
        req = Req(f"r{i}", torch.randint(0, vocab, (64,), generator=g).tolist(), SamplingParams.from_dict(params))
        req.output_ids = torch.randint(0, vocab, (32,), generator=g).tolist()
        if req.sampling_params.seed is not None:
            req.generator = torch.Generator().manual_seed(req.sampling_params.seed)
        reqs.append(req)
    return reqs


def per_request_loop(logits: torch.Tensor, reqs: list[Req]) -> list[int]:
    """Each request alone: its own penalties, filters and torch.multinomial."""
    out = []
    for row, req in zip(logits, reqs):
        p = req.sampling_params
        x = row.float().clone()
        for tid, bias in (p.logit_bias or {}).items():
            x[int(tid)] += bias
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            counts = torch.bincount(torch.tensor(req.output_ids), minlength=x.numel()).float()
            seen = counts > 0
            seen[req.origin_input_ids] = True
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.is_greedy:
            out.append(int(x.argmax()))
            continue
        probs = torch.softmax(x / p.temperature, -1)
        if p.min_p > 0:
            probs[probs < p.min_p * probs.max()] = 0
        sp, idx = probs.sort(descending=True)
        if p.top_k > 0:
            sp[p.top_k:] = 0
        if p.top_p < 1:
            sp[(sp.cumsum(0) - sp) > p.top_p * sp.sum()] = 0
        out.append(int(idx[torch.multinomial(sp, 1, generator=req.generator)]))
    return out


def timed(fn, iters: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    # Peaked like a language model's logits (std ~4): a nucleus of tens to hundreds of tokens.
    logits = torch.randn(args.batch, args.vocab) * 4.0
    reqs = mixed_reqs(args.batch, args.vocab)
    sampler = Sampler(0, "cpu")

    def batched():
        # The scheduler builds this once per batch and keeps it; timed here anyway.
        info = SamplingBatchInfo.from_reqs(reqs, args.vocab, "cpu", {2})
        sampler(logits, info)

    info = SamplingBatchInfo.from_reqs(reqs, args.vocab, "cpu", {2})
    t_step = timed(lambda: sampler(logits, info), args.iters)
    t_batched = timed(batched, args.iters)
    t_loop = timed(lambda: per_request_loop(logits, reqs), args.iters)
    print(f"batch {args.batch} x vocab {args.vocab}, mixed parameters, {torch.get_num_threads()} threads")
    print(f"  batched sampler, per step (info kept):  {t_step * 1e3:8.2f} ms")
    print(f"  batched sampler, info rebuilt:          {t_batched * 1e3:8.2f} ms")
    print(f"  per-request loop:                       {t_loop * 1e3:8.2f} ms")
    print(f"  ratio loop / batched step:              {t_loop / t_step:8.2f}x")


if __name__ == "__main__":
    main()
