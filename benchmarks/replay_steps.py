"""Replays a server run's forward steps in one process, to compare code variants.

    SRT_LITE_RECORD_STEPS=/tmp/w3.jsonl python -m srt_lite.launch_server ...   # record a run
    python benchmarks/replay_steps.py /tmp/w3.jsonl [--skip N] [--passes 4] [--compile]
    python benchmarks/replay_steps.py /tmp/w3.jsonl --variants my_variants.py [--steps]

On this host two server runs of the same code differ by 20-30%, so a change worth 2-5% of a
step cannot be seen in server A/B pairs. A recorded run (one JSON line per forward: the
rows' prefix lengths, their new-token counts, the forward's ms) is replayed here through the
real ModelRunner with the default model: every row's first SHARED_PREFIX KV slots are the
same slots (W3's shared prefix, so the cascade path runs as in the server), the rest its own.
Only the forward is timed (no sampling; logits only at each row's last token).

With --variants FILE, FILE defines `variants(runner) -> {name: activate}`: callables that
switch the runner (or a module) to one variant. Every step then runs once per variant, in a
rotating order, and the per-pass totals are reported side by side: noise that lasts longer
than a step hits all variants alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import make_batch  # noqa: E402

from srt_lite.model_config import ModelConfig  # noqa: E402
from srt_lite.model_executor.model_runner import ModelRunner  # noqa: E402
from srt_lite.model_loader.default_model import resolve_model_path  # noqa: E402
from srt_lite.server_args import ServerArgs  # noqa: E402

logger = logging.getLogger("replay_steps")

# KV slots every replayed row shares at its start (W3: an 800-token common prefix).
SHARED_PREFIX = 800


def load_steps(path: str, skip: int = 0) -> list[tuple[list[int], list[int], float]]:
    with open(path, "rb") as f:
        steps = [tuple(orjson.loads(line)) for line in f if line.strip()]
    return steps[skip:]


def build_runner(steps: list, model_path: str | None, compile_: bool) -> tuple[ModelRunner, list[int]]:
    """A runner whose request rows can hold every recorded row: returns it and the rows."""
    max_rows = max(len(e) for _, e, _ in steps)
    max_len = max(p + x for prefix, ext, _ in steps for p, x in zip(prefix, ext))
    shared = min(SHARED_PREFIX, max_len)
    sargs = ServerArgs(
        model_path=resolve_model_path(model_path),
        max_total_tokens=shared + max_rows * max_len + 1024,  # + the warm-up's scratch KV
        max_running_requests=max_rows,
        enable_torch_compile=compile_,
    )
    runner = ModelRunner(ModelConfig.load(sargs.model_path, sargs.context_length), sargs)
    if compile_:
        runner.warmup(max_rows, num_draft_tokens=4, prefill_chunk=0)  # before the rows take the cache: it needs scratch KV
    pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    rows = [runner.req_to_token_pool.alloc() for _ in range(max_rows)]
    common = pool.alloc(shared).to(torch.int32)
    for row in rows:
        r2t[row, :max_len] = pool.alloc(max_len).to(torch.int32)
        r2t[row, :shared] = common
    return runner, rows


def replay(
    runner: ModelRunner, rows: list[int], steps: list, passes: int, variants: dict[str, Callable[[], None]]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per variant: the total ms of each pass, and the mean ms of each step."""
    names = list(variants)
    totals = {n: [] for n in names}
    per_step = {n: [0.0] * len(steps) for n in names}
    for n in names:  # one untimed pass each: oneDNN primitives, allocator, compiled graphs
        variants[n]()
        for prefix, ext, _ in steps:
            runner.forward(make_batch(runner, rows[: len(ext)], prefix, ext))
    for i in range(passes):
        total = dict.fromkeys(names, 0.0)
        for j, (prefix, ext, _) in enumerate(steps):
            k = (i + j) % len(names)
            for n in names[k:] + names[:k]:
                variants[n]()
                fb = make_batch(runner, rows[: len(ext)], prefix, ext)
                t0 = time.perf_counter()
                runner.forward(fb)
                dt = (time.perf_counter() - t0) * 1e3
                total[n] += dt
                per_step[n][j] += dt / passes
        for n in names:
            totals[n].append(total[n])
    return totals, per_step


def load_variants(path: str | None, runner: ModelRunner) -> dict[str, Callable[[], None]]:
    if path is None:
        return {"current": lambda: None}
    spec = importlib.util.spec_from_file_location("replay_variants", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.variants(runner)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps", help="JSON lines written with SRT_LITE_RECORD_STEPS")
    parser.add_argument("--skip", type=int, default=0, help="leading steps to leave out (a warm-up request)")
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--compile", action="store_true", help="as --enable-torch-compile")
    parser.add_argument("--variants", default=None, help="file defining variants(runner) -> {name: activate}")
    parser.add_argument("--steps-table", action="store_true", help="also print every step's mean ms")
    parser.add_argument("--model-path", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    steps = load_steps(args.steps, args.skip)
    runner, rows = build_runner(steps, args.model_path, args.compile)
    variants = load_variants(args.variants, runner)
    totals, per_step = replay(runner, rows, steps, args.passes, variants)
    recorded = sum(ms for _, _, ms in steps)
    logger.info("%d steps, %d tokens; recorded forward total %.0f ms", len(steps), sum(sum(e) for _, e, _ in steps), recorded)
    first = statistics.median(totals[next(iter(totals))])
    for name, values in totals.items():
        med = statistics.median(values)
        logger.info(
            "%-12s passes %s ms, median %.0f (%.3f of the first)",
            name, " ".join(f"{v:.0f}" for v in values), med, med / first,
        )
    if args.steps_table:
        for (prefix, ext, ms), *means in zip(steps, *per_step.values()):
            logger.info("%4d tokens %2d rows: recorded %.1f, %s", sum(ext), len(ext), ms, " ".join(f"{m:.1f}" for m in means))


if __name__ == "__main__":
    main()
