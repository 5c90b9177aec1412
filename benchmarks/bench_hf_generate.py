"""Plain transformers `generate()` at batch 1 on W1's prompts: the library a server replaces,
as the floor a single stream must beat (issue 24). No server, no HTTP; greedy, EOS held off
with `min_new_tokens`, so every prompt decodes exactly --output-len tokens as in W1.

    .venv/bin/python benchmarks/bench_hf_generate.py [--dtypes bfloat16,float32] [--num-prompts 4]

Reports, per dtype, output tok/s over the prompts run one after another (W1's output
throughput: tokens over wall time, prefill included) and the decode rate after the first token.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving_datasets import make_word_prompts  # noqa: E402

logger = logging.getLogger("bench_hf_generate")


def run(model_dir: str, dtype: torch.dtype, prompts: list[str], output_len: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    kwargs = {"do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    with torch.inference_mode():
        warm = tokenizer(prompts[0], return_tensors="pt")
        model.generate(**warm, max_new_tokens=8, min_new_tokens=8, **kwargs)  # kernels, allocator
        total, first, tokens = 0.0, 0.0, 0
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt")
            t0 = time.perf_counter()
            model.generate(**ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            first += time.perf_counter() - t0
            t0 = time.perf_counter()
            out = model.generate(**ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
            total += time.perf_counter() - t0
            tokens += out.shape[1] - ids["input_ids"].shape[1]
    return {
        "output_tok_s": tokens / total,
        "decode_tok_s": (tokens - len(prompts)) / max(total - first, 1e-9),
        "tokens": tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF directory or .gguf (default: the default model)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--input-words", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    from srt_lite.model_loader.default_model import resolve_model_path

    model_dir = resolve_model_path(args.model_path)
    prompts = [r.prompt for r in make_word_prompts(args.num_prompts, args.input_words, args.seed)]
    for name in args.dtypes.split(","):
        r = run(model_dir, getattr(torch, name), prompts, args.output_len)
        logger.info(
            "transformers generate() %s, %d threads: %.1f output tok/s (decode %.1f tok/s), %d tokens",
            name, torch.get_num_threads(), r["output_tok_s"], r["decode_tok_s"], r["tokens"],
        )


if __name__ == "__main__":
    main()
