"""Replays saved greedy outputs through the n-gram drafter, without the model.

    python benchmarks/replay_drafts.py --generate greedy.json   # greedy outputs of W1-W3 (Engine)
    python benchmarks/replay_drafts.py greedy.json [--draft-tokens 15]

Drafting policies (sources, their order, the cost model) are hard to compare with server
runs on a noisy host. Here every request's true greedy continuation is known, so each
"step" drafts with the real `NgramProposer` for every request in flight (as many as the
workload's concurrency), accepts the matching prefix plus one token, and moves on. Reported:
tokens per row and step (what a step of the batch yields per request), draft tokens, and how
many of them were accepted. Seconds per policy, the same result every time.
"""

from __future__ import annotations

import argparse
import json
import logging

from srt_lite.req import Req
from srt_lite.sampling.sampling_params import SamplingParams
from srt_lite.speculative.ngram import NgramProposer, accept_greedy

logger = logging.getLogger("replay_drafts")

# name: (prompts, input words, shared prefix words, output tokens, concurrency), as in BENCHMARKS.md
WORKLOADS = {"W1": (4, 32, 0, 128, 1), "W2": (64, 200, 0, 128, 16), "W3": (32, 20, 800, 32, 8)}


def replay(requests: list[tuple[list[int], list[int]]], concurrency: int, proposer: NgramProposer) -> dict:
    """requests: (prompt ids, true greedy output ids). The prefill gives each request its
    first token; every later step verifies drafts against the true output."""
    queue = list(enumerate(requests))
    active: list[tuple[Req, list[int]]] = []
    steps = row_steps = drafted = accepted = 0
    while queue or active:
        while queue and len(active) < concurrency:
            i, (prompt, truth) = queue.pop(0)
            req = Req(f"r{i}", list(prompt), SamplingParams(max_new_tokens=len(truth), temperature=0))
            req.output_ids = truth[:1]
            active.append((req, truth))
        steps += 1
        batch = len(active)
        for req, truth in active:
            done = len(req.output_ids)
            req.draft_ids = proposer.propose(req, room=len(truth) - done - 1, batch_size=batch)
            # The model's token after each input of the row (the last token, then each draft
            # token) is the true output there; room keeps the drafts inside it.
            new = accept_greedy(req.draft_ids, truth[done : done + len(req.draft_ids) + 1])
            if req.draft_ids:
                proposer.observe(req, len(new) - 1)
            drafted += len(req.draft_ids)
            accepted += len(new) - 1
            req.output_ids.extend(new)
            row_steps += 1
        active = [(r, t) for r, t in active if len(r.output_ids) < len(t)]
    tokens = sum(len(t) - 1 for _, t in requests)
    return {
        "steps": steps,
        "row_steps": row_steps,
        "tokens_per_row_step": tokens / max(row_steps, 1),
        "drafted": drafted,
        "accepted": accepted,
    }


def generate(path: str) -> None:
    """Greedy outputs of W1-W3's prompts (bf16, the server's defaults), saved as token ids."""
    from serving_datasets import make_word_prompts

    from srt_lite import Engine

    engine = Engine(log_level="warning", speculative_algorithm="ngram")
    tokenizer = engine.tokenizer_manager.tokenizer
    saved = {}
    for name, (num, words, prefix, out_len, _) in WORKLOADS.items():
        prompts = [r.prompt for r in make_word_prompts(num, words, 0, prefix)]
        outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": out_len, "ignore_eos": True})
        saved[name] = [[tokenizer.encode(p), o["output_ids"]] for p, o in zip(prompts, outs)]
        logger.info("%s: %d requests", name, len(prompts))
    engine.shutdown()
    with open(path, "w") as f:
        json.dump(saved, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="greedy outputs (JSON written by --generate)")
    parser.add_argument("--generate", action="store_true", help="write the greedy outputs to PATH first")
    parser.add_argument("--draft-tokens", type=int, default=15)
    parser.add_argument("--min-n", type=int, default=1)
    parser.add_argument("--max-n", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.generate:
        generate(args.path)
    with open(args.path) as f:
        saved = json.load(f)
    for name, requests in saved.items():
        proposer = NgramProposer(args.draft_tokens, args.min_n, args.max_n)
        r = replay([(p, o) for p, o in requests], WORKLOADS[name][4], proposer)
        logger.info(
            "%s: %.2f tokens per row and step, %d steps, %d draft tokens, %d accepted (%.0f%%)",
            name, r["tokens_per_row_step"], r["steps"], r["drafted"], r["accepted"],
            100 * r["accepted"] / max(r["drafted"], 1),
        )


if __name__ == "__main__":
    main()
