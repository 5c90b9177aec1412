"""Micro-benchmark: what a JSON-schema grammar adds to a decode step, per backend.

    python benchmarks/bench_grammar.py [--batch-sizes 1,16] [--steps 100] [--backend both]
                                       [--context 200] [--compiles 5]

B constrained rows, each with its own matcher walking token by token through a real JSON
answer of a person schema (name, age, email, employed, hobbies, address object), tokenized
with the model's tokenizer and ended by EOS; a finished row starts a fresh matcher (untimed:
that is a new request's cost) and the rows start at staggered offsets, so the steps meet the
masks generation meets (keys, string contents, numbers, separators). Each step runs a real
decode step of B rows over `--context` KV tokens (ModelRunner forward + sampler, default
sampling parameters, default model and dtype, as bench_forward.py builds it), then times what
the grammar adds to it in the engine:
  fill    allocate_bitmask + fill_bitmask of the B matchers (apply_grammars' loop)
  apply   apply_bitmask on the step's [B, V] float32 logits (the rest of apply_grammars)
  accept  accept(token) + is_terminated() of each matcher (FinishChecker.check)
Prints the added ms per step (median, p90), the decode step's median ms and their ratio; and
each backend's one-off compile of the schema (compile cache cleared each time) and the first
matcher + mask, which the first request of a new schema pays.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from srt_lite.constrained import backend_class
from srt_lite.constrained.bitmask import allocate_bitmask, apply_bitmask
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.forward_batch import ForwardBatch
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.model_loader.default_model import resolve_model_path
from srt_lite.req import Req
from srt_lite.sampling.sampler import Sampler
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo
from srt_lite.sampling.sampling_params import SamplingParams
from srt_lite.server_args import ServerArgs

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "employed": {"type": "boolean"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
                "country": {"type": "string"},
            },
            "required": ["street", "city", "zip", "country"],
        },
    },
    "required": ["name", "age", "email", "employed", "hobbies", "address"],
}

PEOPLE = [
    ("Maria Gonzalez", 34, "maria.gonzalez@example.com", True, ["rock climbing", "photography", "cooking"],
     ("12 Calle Mayor", "Madrid", "28013", "Spain")),
    ("Kenji Watanabe", 27, "kenji.w@example.jp", False, ["chess", "jazz piano"],
     ("3-14-1 Shibuya", "Tokyo", "150-0002", "Japan")),
    ("Amelia O'Connor", 51, "amelia.oconnor@example.ie", True, ["gardening", "birdwatching", "long-distance running", "knitting"],
     ("47 Harbour Road", "Cork", "T12 XY34", "Ireland")),
    ("Ludwig Schmidt", 68, "l.schmidt@example.de", False, ["woodworking"],
     ("Hauptstrasse 5", "Heidelberg", "69117", "Germany")),
]


def answers() -> list[str]:
    """Each person as the engine's compact JSON (", " and ": " separators, no newlines)."""
    out = []
    for name, age, email, employed, hobbies, (street, city, zip_code, country) in PEOPLE:
        obj = {"name": name, "age": age, "email": email, "employed": employed, "hobbies": hobbies,
               "address": {"street": street, "city": city, "zip": zip_code, "country": country}}
        out.append(json.dumps(obj))
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Row:
    """One constrained request: its matcher and where it is in its answer."""

    def __init__(self, backend, compiled, tokens: list[int], offset: int):
        self.backend, self.compiled, self.tokens = backend, compiled, tokens
        self.restart()
        for _ in range(offset % len(tokens)):  # staggered start: rows sit at different places
            assert self.matcher.accept(self.tokens[self.pos])
            self.pos += 1

    def restart(self) -> None:
        self.matcher, self.pos = self.backend.matcher(self.compiled), 0


def check_walk(backend, compiled, tokens: list[int], vocab: int) -> None:
    """Every token of the answer is allowed by the mask before it and accepted, and the
    grammar ends with EOS: the benchmark measures real masks, not a rejected walk."""
    m = backend.matcher(compiled)
    mask = allocate_bitmask(1, vocab)
    for tok in tokens:
        m.fill_bitmask(mask, 0)
        assert (int(mask[0, tok // 32]) >> (tok % 32)) & 1, f"{backend.name}: token {tok} masked"
        assert m.accept(tok), f"{backend.name}: token {tok} rejected"
    assert m.is_terminated(), f"{backend.name}: not terminated after EOS"


def time_steps(runner: ModelRunner, kv_rows: list[int], context: int, backend, compiled, seqs: list[list[int]],
               steps: int, vocab: int, eos: set[int]) -> dict:
    """`steps` decode steps of len(kv_rows) rows, each followed by the grammar's work for as
    many constrained rows: the two are timed under the same conditions (a busy host, the
    forward's weights streaming through the caches), as they follow each other in the engine."""
    b = len(kv_rows)
    r2t = runner.req_to_token_pool.req_to_token
    reqs = [Req(f"r{i}", [1] * context, SamplingParams.from_dict({})) for i in range(b)]
    info = SamplingBatchInfo.from_reqs(reqs, vocab, runner.device, eos)  # no grammar: the plain step
    sampler = Sampler(0, runner.device)
    rows = [Row(backend, compiled, seqs[i % len(seqs)], i * 11) for i in range(b)]
    idx = list(range(b))
    decode, fill, apply, accept, total = [], [], [], [], []
    warmup = 3  # allocator, kernels, llguidance's lazily built lexer states
    for step in range(steps + warmup):
        fb = ForwardBatch.create(
            input_ids=[(j * 37 + step) % 1000 + 1 for j in range(b)],
            req_pool_indices=kv_rows,
            prefix_lens=[context] * b,
            extend_lens=[1] * b,
            out_cache_loc=torch.cat([r2t[row, context : context + 1].to(torch.int64) for row in kv_rows]),
            device=runner.device,
        )
        t0 = time.perf_counter()
        out = runner.forward(fb)
        sampler(out.next_token_logits, info)
        t1 = time.perf_counter()
        logits = out.next_token_logits.float().clone()  # [B, V]: the sampler's copy
        t2 = time.perf_counter()
        bitmask = allocate_bitmask(b, vocab)  # [B, ceil(V / 32)] int32, as apply_grammars
        for i, r in enumerate(rows):
            r.matcher.fill_bitmask(bitmask, i)
        t3 = time.perf_counter()
        apply_bitmask(logits, bitmask, idx)
        t4 = time.perf_counter()
        done = []
        for r in rows:  # FinishChecker.check: the row's next answer token, not the sampled one
            ok = r.matcher.accept(r.tokens[r.pos])
            r.pos += 1
            if r.matcher.is_terminated():
                done.append(r)
            assert ok
        t5 = time.perf_counter()
        for r in done:  # a new request: untimed
            r.restart()
        if step >= warmup:
            decode.append(t1 - t0)
            fill.append(t3 - t2)
            apply.append(t4 - t3)
            accept.append(t5 - t4)
            total.append(t5 - t2)
    ms = 1e3
    return {
        "decode": statistics.median(decode) * ms,
        "fill": statistics.median(fill) * ms,
        "apply": statistics.median(apply) * ms,
        "accept": statistics.median(accept) * ms,
        "p50": statistics.median(total) * ms,
        "p90": pct(total, 0.9) * ms,
    }


def time_compile(backend, schema: str, repeats: int, vocab: int) -> tuple[float, float]:
    """Median ms of a fresh compile, and of the first matcher + first mask after it."""
    comp, first = [], []
    for _ in range(repeats):
        if hasattr(backend, "compiler"):
            backend.compiler.clear_cache()  # xgrammar's own cache; the engine's is not used here
        t0 = time.perf_counter()
        compiled = backend.compile("json_schema", schema)
        t1 = time.perf_counter()
        m = backend.matcher(compiled)
        m.fill_bitmask(allocate_bitmask(1, vocab), 0)
        t2 = time.perf_counter()
        comp.append(t1 - t0)
        first.append(t2 - t1)
    return statistics.median(comp) * 1e3, statistics.median(first) * 1e3


def build_runner(model_path: str, dtype: str, max_batch: int) -> ModelRunner:
    sargs = ServerArgs(model_path=model_path, dtype=dtype, max_total_tokens=8192, max_running_requests=max_batch + 1)
    config = ModelConfig.load(sargs.model_path, sargs.context_length)
    return ModelRunner(config, sargs)


def int_list(values: list[str]) -> list[int]:
    return [int(x) for v in values for x in v.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", nargs="+", default=["1,16"], help="e.g. 1,16 or 1 16")
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed per batch size and backend")
    parser.add_argument("--context", type=int, default=200, help="KV tokens per row before the decode step")
    parser.add_argument("--compiles", type=int, default=5, help="fresh compiles timed per backend")
    parser.add_argument("--backend", default="both", choices=["xgrammar", "llguidance", "both"])
    args = parser.parse_args()
    batch_sizes = int_list(args.batch_sizes)
    logging.basicConfig(level=logging.WARNING)

    from transformers import AutoTokenizer

    path = resolve_model_path(args.model_path)
    runner = build_runner(path, args.dtype, max(batch_sizes))
    vocab, eos = runner.model_config.vocab_size, list(runner.model_config.eos_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(path)
    seqs = [tokenizer.encode(a, add_special_tokens=False) + [eos[0]] for a in answers()]
    schema = json.dumps(SCHEMA)
    names = ["xgrammar", "llguidance"] if args.backend == "both" else [args.backend]
    # Every row gets context + 1 KV slots up front (random KV content is fine for timing).
    pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    kv_rows = [runner.req_to_token_pool.alloc() for _ in range(max(batch_sizes))]
    for row in kv_rows:
        r2t[row, : args.context + 1] = pool.alloc(args.context + 1).to(torch.int32)

    print(f"dtype {runner.dtype}, threads {torch.get_num_threads()}, vocab {vocab}, context {args.context}, "
          f"JSON answers of {min(map(len, seqs))}-{max(map(len, seqs))} tokens")
    backends, compiles = {}, {}
    for name in names:
        backend = backend_class(name)(tokenizer, vocab, eos)
        compiles[name] = time_compile(backend, schema, args.compiles, vocab)
        backends[name] = (backend, backend.compile("json_schema", schema))
        for s in seqs:
            check_walk(*backends[name], s, vocab)
    print("| B | backend | fill ms | apply ms | accept ms | added ms p50 | added ms p90 | decode step ms | added / step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for b in batch_sizes:
        for name in names:
            r = time_steps(runner, kv_rows[:b], args.context, *backends[name], seqs, args.steps, vocab, set(eos))
            print(f"| {b} | {name} | {r['fill']:.2f} | {r['apply']:.2f} | {r['accept']:.2f} | {r['p50']:.2f} | "
                  f"{r['p90']:.2f} | {r['decode']:.1f} | {r['p50'] / r['decode'] * 100:.1f}% |", flush=True)
    for name, (comp, first) in compiles.items():
        print(f"compile {name:<10s} {comp:7.1f} ms (median of {args.compiles}, cache cleared), "
              f"first matcher + mask {first:5.1f} ms")


if __name__ == "__main__":
    main()
