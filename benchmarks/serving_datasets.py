"""The prompts of bench_serving.py's datasets, seeded so that every engine gets the same
requests: `random-words` (the word list of shared/tools/bench_client.py, same seed, same
prompts), `random-ids` (random token ids) and `instructions` (the chat workload's natural
requests, answered at the length the model chooses)."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

# Identical to shared/tools/bench_client.py so that the same --seed gives the same prompts.
WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point government company number group problem fact river mountain ocean forest city "
         "music science history language computer garden winter summer animal market story idea").split()

# The chat workload's prompts (--dataset instructions): varied natural requests, each answered
# at the length the model chooses (EOS allowed), as users send them.
INSTRUCTIONS = [
    "Explain how a rainbow forms.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "List five tips for staying focused while studying.",
    "Write a short poem about the sea at night.",
    "Write a polite email asking my manager for a day off next Friday.",
    "What is the difference between weather and climate?",
    "Give me a recipe for a simple tomato pasta.",
    "Explain what a computer's memory does, for a ten-year-old.",
    "Describe a busy market in a few sentences.",
    "What are three benefits of regular exercise?",
    "Write a haiku about autumn leaves.",
    "How do I make a good first impression at a job interview?",
    "Explain photosynthesis in simple words.",
    "Suggest three names for a small coffee shop.",
    "Summarise why people keep pets.",
    "Write a thank-you note to a friend who helped me move.",
    "What should I pack for a weekend hiking trip?",
    "Explain how a bicycle stays upright.",
    "Give me four ideas for a rainy afternoon with kids.",
    "Write a short story about a lost key, in five sentences.",
    "What is a good way to start learning to cook?",
    "Explain what the internet is to someone from 1900.",
    "List the planets of the solar system with one fact each.",
    "Write a limerick about a cat who loves cheese.",
    "How can I save money on groceries?",
    "Explain why the sky is blue.",
    "Write a short speech for a friend's birthday dinner.",
    "What are the main causes of traffic jams?",
    "Describe your ideal weekend in a paragraph.",
    "Give three arguments for reading books every day.",
    "Write an email to a neighbour about a noisy party, kindly.",
    "Explain how vaccines help the body.",
    "Summarise the benefits of drinking water.",
    "List five common mistakes new drivers make.",
    "Write a short poem about a city waking up.",
    "How do plants know which way is up?",
    "Explain what a budget is and why it helps.",
    "Give me a plan for learning a new language in six months.",
    "Describe the taste of a lemon to someone who never had one.",
    "Write a product description for a reusable water bottle.",
    "What makes a good friend?",
    "Explain how a refrigerator keeps food cold.",
    "List four ways to reduce stress at work.",
    "Write a bedtime story about a brave little owl.",
]


@dataclass
class RequestInput:
    prompt: str | list[int]
    # Known locally only for token-id prompts; text prompts rely on the server's usage.
    prompt_len: int | None = None
    seed: int | None = None  # with --seed-per-request: this request's sampling seed


def make_word_prompts(num: int, words: int, seed: int, shared_prefix_words: int = 0) -> list[RequestInput]:
    # Same draw order as bench_client.make_prompts: the prefix first, then each body.
    rng = random.Random(seed)
    prefix = " ".join(rng.choice(WORDS) for _ in range(shared_prefix_words))
    out = []
    for _ in range(num):
        body = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(RequestInput((prefix + " " + body).strip()))
    return out


def make_id_prompts(num: int, input_len: int, seed: int, low: int, high: int) -> list[RequestInput]:
    rng = random.Random(seed)
    return [RequestInput([rng.randrange(low, high) for _ in range(input_len)], input_len) for _ in range(num)]


def make_instruction_prompts(num: int, seed: int) -> list[RequestInput]:
    """`num` of INSTRUCTIONS in a seeded order (every one before any repeats)."""
    rng = random.Random(seed)
    out: list[RequestInput] = []
    while len(out) < num:
        batch = list(INSTRUCTIONS)
        rng.shuffle(batch)
        out += [RequestInput(text) for text in batch]
    return out[:num]


def build_dataset(args: argparse.Namespace, num: int, seed: int, shared_prefix: bool = True) -> list[RequestInput]:
    if args.dataset == "random-ids":
        reqs = make_id_prompts(num, args.input_len, seed, args.min_token_id, args.max_token_id)
    elif args.dataset == "instructions":
        reqs = make_instruction_prompts(num, seed)
    else:
        reqs = make_word_prompts(num, args.input_words, seed, args.shared_prefix_words if shared_prefix else 0)
    if args.seed_per_request:
        for i, req in enumerate(reqs):
            req.seed = seed * 100_003 + i
    return reqs
