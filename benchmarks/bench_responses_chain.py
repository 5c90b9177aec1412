"""Time to first token of a multi-turn conversation on the Responses API: each turn chained
with `previous_response_id` (the server re-renders the stored conversation, whose prefix is in
the radix cache) against each turn sending the whole history as input items.

    .venv/bin/python -m srt_lite.launch_server --port 30000 &
    .venv/bin/python benchmarks/bench_responses_chain.py --base-url http://127.0.0.1:30000

Each mode runs --rounds conversations of --turns turns, greedy, streaming; TTFT is the time
from sending a turn to its first `response.output_text.delta`. A third mode sends the whole
history after flushing the cache before every turn (what no prefix reuse would cost). The
modes take turns in a rotating order, and every round's conversation starts with its own system text, so no round finds
another round's turns in the cache: what a chained turn reuses is its own conversation's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

QUESTIONS = [
    "Name a country in Europe.",
    "What is its capital?",
    "What language do people speak there?",
    "Name a famous dish from there.",
    "What is a good season to visit?",
    "Name a river that flows through it.",
    "What is one museum worth seeing?",
    "Summarize our conversation in one sentence.",
]


def ttft(client: httpx.Client, body: dict) -> tuple[float, dict]:
    """(seconds to the first text delta, the final response) of one streamed turn."""
    start, first, final = time.perf_counter(), None, None
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: "):])
            if event["type"] == "response.output_text.delta" and first is None:
                first = time.perf_counter() - start
            if event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    return (first if first is not None else time.perf_counter() - start), final


def conversation(client: httpx.Client, chained: bool, turns: int, tag: int, max_tokens: int, flush: bool = False) -> list[float]:
    system = f"Conversation {tag}. You are a helpful travel assistant who answers briefly."
    history: list[dict] = []
    previous = None
    times = []
    for q in QUESTIONS[:turns]:
        body = {"instructions": system, "temperature": 0, "max_output_tokens": max_tokens}
        if chained:
            body.update(input=q, **({"previous_response_id": previous} if previous else {}))
        else:
            history.append({"role": "user", "content": q})
            body.update(input=list(history), store=False)
        if flush:
            client.post("/flush_cache").raise_for_status()
        t, final = ttft(client, body)
        times.append(t)
        previous = final["id"]
        answer = "".join(p["text"] for item in final["output"] if item["type"] == "message" for p in item["content"])
        history.append({"role": "assistant", "content": answer})
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    client = httpx.Client(base_url=args.base_url, timeout=600)
    modes = ["chained", "full history", "full history, cache flushed"]
    by_mode: dict[str, list[list[float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for k, mode in enumerate(modes[r % 3:] + modes[: r % 3]):
            tag = 3 * r + k
            by_mode[mode].append(conversation(client, mode == "chained", args.turns, tag, args.max_tokens, flush="flushed" in mode))
    print(f"TTFT per turn, median over {args.rounds} conversations (ms)")
    print("| turn | chained (previous_response_id) | full history as input | full history, cache flushed |")
    print("| --- | --- | --- | --- |")
    for t in range(args.turns):
        a, b, c = (statistics.median(conv[t] for conv in by_mode[m]) * 1e3 for m in modes)
        print(f"| {t + 1} | {a:.1f} | {b:.1f} | {c:.1f} |")


if __name__ == "__main__":
    main()
