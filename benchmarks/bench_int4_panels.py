"""A decode step's linears over a GGUF model's 4-bit weights: bf16 panels against the 4-bit
panels (int4_panel_linear, or on AMX amx_int4_panel_linear) and torch's int4 matmul, at
decode row counts. Every layer has its own weights, so they stream from memory as in a real
step (one weight alone would sit in L3 and time the arithmetic only).

    python benchmarks/bench_int4_panels.py [--rows 1,2,4,8,12,16,24,32] [--layers 30]

Shapes: the default model's qkv, o, gate_up and down. Medians of the whole stack's time.
"""

from __future__ import annotations

import argparse
import logging

import torch

from bench_sampler import timed  # the median of timed runs, after a warm-up
from srt_lite import cpu_kernels
from srt_lite.layers.cpu_linear.paths import amx_panels_built
from srt_lite.layers.cpu_linear.products import (
    int4_linear, int4_pack, int4_panel_linear, pack_int4_panels, pack_panels, panel_linear,
)

logger = logging.getLogger(__name__)
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8,12,16,24,32")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not cpu_kernels.load() or not torch.ops.srt_lite_cpu.bf16_gemv_supported():
        raise SystemExit("the bf16 and 4-bit panels need the C++ ops and AVX512-BF16")
    amx = amx_panels_built()
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        for n, k in SHAPES:
            codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
            scale = torch.rand(n, k // 32, generator=g) * 0.02
            zero = torch.randn(n, k // 32, generator=g) * 0.05
            w = ((codes.float().view(n, k // 32, 32) - 8) * scale[..., None] + zero[..., None]).view(n, k).bfloat16()
            layers.append((n, k, pack_panels(w), pack_int4_panels(codes, scale, zero),
                           int4_pack(codes, scale, zero, torch.bfloat16)))
    logger.info("%d layers; 4-bit panels on %s", args.layers, "AMX tiles" if amx else "AVX512-BF16 dot products")
    logger.info("%5s %12s %12s %12s %8s", "rows", "bf16 ms", "4-bit ms", "torch int4", "speedup")
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in {k for _, k in SHAPES}}

        def bf16() -> None:
            for n, k, panels, _, _ in layers:
                panel_linear(xs[k], panels, None, n)

        def four_bit() -> None:
            for n, k, _, int4_panels, _ in layers:
                int4_panel_linear(xs[k], int4_panels, None, n, amx)

        def torch_int4() -> None:
            for _, k, _, _, packed in layers:
                int4_linear(xs[k], *packed)

        a, b, c = (timed(f, args.reps) * 1e3 for f in (bf16, four_bit, torch_int4))
        logger.info("%5d %12.2f %12.2f %12.2f %7.2fx", rows, a, b, c, a / b)


if __name__ == "__main__":
    main()
