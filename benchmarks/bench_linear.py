"""One linear's product on the CPU, oneDNN's prepacked bf16 against srt_lite's panel layout,
at the shapes of the default model and of the 1B shape and at decode to prefill row counts.

    python benchmarks/bench_linear.py [--rows 1,2,4,8,16,32,64,256,1024] [--shapes 1b,135m]

Medians of interleaved runs; GB/s counts the weight's bytes once a product (the bound at few
rows); GFLOP/s the arithmetic (the bound at many).
"""

from __future__ import annotations

import argparse
import torch

from bench_sampler import timed  # the median of timed runs, after a warm-up
from srt_lite import cpu_kernels
from srt_lite.layers.cpu_linear.products import pack_panels, pack_weight, packed_linear, panel_linear

SHAPES = {  # name: [(out, in)], each model's qkv, o, gate_up, down and LM head
    "1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)],
    "135m": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256,1024")
    parser.add_argument("--shapes", default="1b,135m")
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    assert cpu_kernels.load(), "the C++ ops did not build"
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        for n, k in SHAPES[name]:
            w = torch.randn(n, k).bfloat16()  # [out, in]
            packed, panels = pack_weight(w), pack_panels(w)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k).bfloat16()  # [rows, in]
                a = timed(lambda: packed_linear(x, packed, None), args.reps)
                b = timed(lambda: panel_linear(x, panels, None, n), args.reps)
                print(f"{name} {n}x{k} rows={m}: onednn {a * 1e3:.3f} ms, panels {b * 1e3:.3f} ms ({a / b:.2f}x; "
                      f"{n * k * 2 / b / 1e9:.1f} GB/s, {2 * m * n * k / b / 1e9:.0f} GFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
