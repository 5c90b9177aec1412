"""Quality of GGUF files served from their blocks (issue: K-quant and Q8_0 GGUF served natively).

    .venv/bin/python benchmarks/gguf_quality.py DIR/smollm2-135m-Q4_K_M.gguf [more files] [--tokens 512]

For each file, over a fixed English text (public-domain prose, below), teacher-forced one
token a step through srt_lite's decode path (the int8-activation dot products that serve
users' decode steps), in fp32 and in the default dtype of this CPU:
- next-token top-1 agreement and mean KL(reference || srt_lite) against the same file's
  weights dequantized to fp32 (`--quantization none`, the whole text in one fp32 prefill);
- perplexity of the text, and llama.cpp's perplexity on the same file and token ids (all
  logits from llama-cpp-python, run in its own venv: $LLAMACPP_PYTHON, as bench_gguf.py);
  `--no-llamacpp` leaves it out.
Prints one JSON object per file and a markdown table. Files from `bench_gguf.py make`; on
random-weight files (the 1B shape) only agreement and KL mean anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))

from model_harness import Harness  # noqa: E402
from srt_lite.model_config import ModelConfig  # noqa: E402
from srt_lite.model_executor.model_runner import ModelRunner  # noqa: E402
from srt_lite.server_args import ServerArgs  # noqa: E402

# Opening paragraphs of Jane Austen's "Pride and Prejudice" (1813) and Charles Dickens's
# "A Tale of Two Cities" (1859), both in the public domain.
TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him "
    "one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But "
    "it is,\" returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made "
    "no answer. \"Do you not want to know who has taken it?\" cried his wife impatiently. \"You want to tell me, "
    "and I have no objection to hearing it.\" This was invitation enough. \"Why, my dear, you must know, Mrs. "
    "Long says that Netherfield is taken by a young man of large fortune from the north of England; that he came "
    "down on Monday in a chaise and four to see the place, and was so much delighted with it, that he agreed "
    "with Mr. Morris immediately; that he is to take possession before Michaelmas, and some of his servants are "
    "to be in the house by the end of next week.\" \"What is his name?\" \"Bingley.\" \"Is he married or "
    "single?\" \"Oh! Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. "
    "What a fine thing for our girls!\"\n\n"
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
    "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the other "
    "way - in short, the period was so far like the present period, that some of its noisiest authorities "
    "insisted on its being received, for good or for evil, in the superlative degree of comparison only. There "
    "were a king with a large jaw and a queen with a plain face, on the throne of England; there were a king "
    "with a large jaw and a queen with a fair face, on the throne of France. In both countries it was clearer "
    "than crystal to the lords of the State preserves of loaves and fishes, that things in general were settled "
    "for ever. It was the year of Our Lord one thousand seven hundred and seventy-five. Spiritual revelations "
    "were conceded to England at that favoured period, as at this."
)


def runner(path: str, dtype: str, quantization: str | None = None, tokens: int = 1024) -> ModelRunner:
    args = ServerArgs(model_path=path, dtype=dtype, quantization=quantization, max_total_tokens=tokens + 64)
    return ModelRunner(ModelConfig.load(path), args)


def decode_logits(r: ModelRunner, ids: list[int]) -> torch.Tensor:
    """fp32 [len(ids), vocab]: the logits after each prefix, one token a step (decode path)."""
    h = Harness(r)
    out = [h.prefill([ids[:1]]).next_token_logits[0]]
    for t in ids[1:]:
        out.append(h.decode([t])[0])
    return torch.stack(out).float()


def prompt_logits(r: ModelRunner, ids: list[int]) -> torch.Tensor:
    return Harness(r).prefill([ids]).all_logits.float()


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] given logits[:-1]."""
    logp = logits[:-1].double().log_softmax(-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item()
    return math.exp(nll)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean")
    return {"top1": (got.argmax(-1) == want.argmax(-1)).float().mean().item(), "kl": kl.item()}


LLAMACPP_CODE = """
import json, sys
import numpy as np
from llama_cpp import Llama
path, ids_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
ids = json.load(open(ids_file))
llm = Llama(model_path=path, logits_all=True, n_ctx=len(ids) + 8, n_threads={threads}, verbose=False)
llm.eval(ids)
np.save(out, np.asarray(llm.scores[: len(ids)], dtype=np.float32))
"""


def llamacpp_logits(path: str, ids: list[int]) -> torch.Tensor:
    python = os.environ.get("LLAMACPP_PYTHON", os.path.join(os.path.dirname(__file__), "..", ".bench-venvs", "llama",
                                                            "bin", "python"))
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        ids_file, out = os.path.join(tmp, "ids.json"), os.path.join(tmp, "scores.npy")
        with open(ids_file, "w") as f:
            json.dump(ids, f)
        code = LLAMACPP_CODE.replace("{threads}", str(os.cpu_count() or 1))
        subprocess.run([python, "-c", code, path, ids_file, out], check=True)
        return torch.from_numpy(np.load(out))


def measure(path: str, tokens: int, llamacpp: bool) -> dict:
    ref_runner = runner(path, "float32", "none", tokens)
    tok = ref_runner.tokenizer if hasattr(ref_runner, "tokenizer") else None
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ModelConfig.load(path).path)
    ids = tok.encode(TEXT)[:tokens]
    want = prompt_logits(ref_runner, ids)
    del ref_runner
    out: dict = {"file": os.path.basename(path), "tokens": len(ids), "ppl_dequantized_fp32": perplexity(want, ids)}
    for dtype in ("float32", "auto"):
        r = runner(path, dtype, None, tokens)
        got = decode_logits(r, ids)
        name = "fp32" if dtype == "float32" else str(r.dtype).replace("torch.", "")
        out[name] = {**compare(got, want), "ppl": perplexity(got, ids), "formats": r.gguf_formats}
        del r
    if llamacpp:
        ll = llamacpp_logits(path, ids)
        out["llamacpp"] = {**compare(ll, want), "ppl": perplexity(ll, ids)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--no-llamacpp", action="store_true")
    args = parser.parse_args()
    rows = []
    for path in args.files:
        res = measure(path, args.tokens, not args.no_llamacpp)
        print(json.dumps(res), flush=True)
        rows.append(res)
    print("\n| file | tokens | engine, dtype | top-1 vs fp32 dequantized | mean KL | perplexity |")
    print("| --- | --- | --- | --- | --- | --- |")
    for res in rows:
        print(f"| {res['file']} | {res['tokens']} | fp32 dequantized (reference) | - | - | "
              f"{res['ppl_dequantized_fp32']:.3f} |")
        for key, label in (("fp32", "srt_lite fp32"), ("bfloat16", "srt_lite bf16"), ("float32", "srt_lite fp32"),
                           ("llamacpp", "llama.cpp")):
            if key in res and isinstance(res[key], dict):
                v = res[key]
                print(f"| {res['file']} | {res['tokens']} | {label} | {v['top1']:.3f} | {v['kl']:.4f} | {v['ppl']:.3f} |")


if __name__ == "__main__":
    main()
