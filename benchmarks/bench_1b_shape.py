"""The 1B-class workload of shared/BENCHMARKS.md: a Llama with Llama-3.2-1B's layer shape and
random bf16 weights, served by any OpenAI-compatible engine; single stream and 8 streams with
EOS banned; single-stream decode as a fraction of the machine's memory-bandwidth roofline.

    .venv/bin/python benchmarks/bench_1b_shape.py make /path/to/llama-1b-shape
    .venv/bin/python -m srt_lite.launch_server --model-path /path/to/llama-1b-shape --port 30000 &
    .venv/bin/python benchmarks/bench_1b_shape.py run --base-url http://127.0.0.1:30000 --model-dir /path/to/llama-1b-shape

`make` writes the model once (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate 8192,
vocabulary 128256, tied embeddings: 1.24B parameters, 2.47 GB in bf16). The tokenizer is
SmolLM2's (49152 tokens): ids past it decode to nothing, as a model's padded vocabulary
does; the engines still compute and sample over all 128256 logits. `run` measures the memory read bandwidth in this
process first (the best of several sums over a buffer far larger than the caches), then runs
the two workloads through benchmarks/bench_serving.py. Decode reads every weight once per step,
so the single-stream roofline is bandwidth / weight bytes (in the dtype the server reports; a
peer that does not report one is taken to run the checkpoint's bf16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bandwidth import read_rates_gbs  # noqa: E402
from bench_serving import RESULTS_DIR, parse_args as serving_args, run_benchmark  # noqa: E402

SHAPE = {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "intermediate": 8192, "vocab": 128256}
WORKLOADS = {  # bench_serving arguments; EOS banned (its default), so every request decodes --output-len
    "single": ["--num-prompts", "4", "--max-concurrency", "1", "--input-words", "32", "--output-len", "128"],
    "c8": ["--num-prompts", "16", "--max-concurrency", "8", "--input-words", "32", "--output-len", "128"],
}


def make_model(path: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from srt_lite.model_loader.default_model import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(None))
    cfg = LlamaConfig(
        vocab_size=max(vocab, len(tokenizer)), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, tie_word_embeddings=True,
        max_position_embeddings=4096, rope_theta=500000.0, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {path}: {n / 1e9:.2f}B parameters, {2 * n / 1e9:.2f} GB in bf16")


def read_bandwidth_gbs(gib: float = 1.0, repeats: int = 9) -> tuple[float, float]:
    """GB/s of reading a buffer `gib` GiB large with every torch thread (bandwidth.py), as
    (best, median) of `repeats` reads of each kind. The best is what a decode step that
    streams the weights can at most get, so the roofline uses it; a shared host's bandwidth
    moves between runs (the median shows by how much)."""
    rates = read_rates_gbs(0.0, gib, min_reads=repeats)
    return max(rates), statistics.median(rates)


def weight_bytes(model_dir: str, dtype: str) -> int:
    """Bytes of weights read per decode step: every parameter once (a tied embedding once, as
    the LM head), at the serving dtype's width."""
    from safetensors import safe_open

    n = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                n += _numel(st.get_slice(key).get_shape())
    return n * {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 2)


def _numel(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def server_dtype(base_url: str) -> str | None:
    try:
        return httpx.get(base_url + "/get_server_info", timeout=10).json().get("dtype")
    except (httpx.HTTPError, ValueError):
        return None  # not srt_lite or SGLang


def run(args: argparse.Namespace) -> dict:
    bandwidth, median_bw = read_bandwidth_gbs(args.buffer_gib)
    dtype = server_dtype(args.base_url) or "bfloat16"
    nbytes = weight_bytes(args.model_dir, dtype)
    roofline = bandwidth * 1e9 / nbytes
    result = {"bandwidth_gbs": bandwidth, "median_bandwidth_gbs": median_bw, "dtype": dtype, "weight_gb": nbytes / 1e9, "roofline_tok_s": roofline}
    for name, wargs in WORKLOADS.items():
        sargs = serving_args(["--base-url", args.base_url, "--disable-tqdm", *wargs, *args.extra])
        out = asyncio.run(run_benchmark(sargs))
        decode = 1000 / out["mean_tpot_ms"] if out["mean_tpot_ms"] > 0 else float("nan")
        result[name] = {k: out[k] for k in ("completed", "failed", "output_throughput", "mean_ttft_ms", "mean_tpot_ms")}
        result[name]["decode_tok_s_per_stream"] = decode
    result["single"]["roofline_fraction"] = result["single"]["decode_tok_s_per_stream"] / roofline
    print(f"memory read bandwidth {bandwidth:.1f} GB/s (median {median_bw:.1f}); weights {nbytes / 1e9:.2f} GB ({dtype}) per step: "
          f"roofline {roofline:.1f} tok/s")
    for name in WORKLOADS:
        r = result[name]
        print(f"{name:<7} {r['output_throughput']:7.2f} tok/s  TTFT {r['mean_ttft_ms']:7.0f} ms  "
              f"TPOT {r['mean_tpot_ms']:6.1f} ms  failed {r['failed']}")
    print(f"single-stream decode {result['single']['decode_tok_s_per_stream']:.2f} tok/s = "
          f"{result['single']['roofline_fraction']:.0%} of the roofline")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the model directory")
    m.add_argument("path")
    for key, value in SHAPE.items():
        m.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    r = sub.add_parser("run", help="bandwidth, then both workloads against a server")
    r.add_argument("--base-url", default="http://127.0.0.1:30000")
    r.add_argument("--model-dir", required=True, help="the directory `make` wrote (for its weight bytes)")
    r.add_argument("--buffer-gib", type=float, default=1.0)
    r.add_argument("--output", default="", help="JSON path (default: benchmarks/results/1b-shape_<time>.json)")
    r.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more bench_serving arguments")
    args = p.parse_args()
    if args.cmd == "make":
        os.makedirs(args.path, exist_ok=True)
        make_model(args.path, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.vocab)
        return
    result = run(args)
    out = Path(args.output) if args.output else RESULTS_DIR / f"1b-shape_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
