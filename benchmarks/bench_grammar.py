"""Micro-benchmark: what a JSON-schema grammar adds to a decode step, per backend.

    python benchmarks/bench_grammar.py [--batch-sizes 1,16] [--steps 200] [--backend both]
                                       [--decode-steps 10] [--context 200] [--compiles 5]

Grammar: B constrained rows, each with its own matcher walking token by token through a real
JSON answer of a person schema (name, age, email, employed, hobbies, address object),
tokenized with the model's tokenizer and ended by EOS; a finished row starts a fresh matcher
(untimed: that is a new request's cost) and the rows start at staggered offsets, so each
step meets the masks generation meets (keys, string contents, numbers, separators). Per step
it times what the engine runs for those rows:
  fill    allocate_bitmask + fill_bitmask of the B matchers (apply_grammars' loop)
  apply   apply_bitmask on [B, V] float32 logits (the rest of apply_grammars)
  accept  accept(token) + is_terminated() per matcher (FinishChecker.check)
Decode step: forward + sampler (default sampling parameters, no grammar) of a ModelRunner
decode step of B rows over `--context` KV tokens each, default model and dtype, as
bench_forward.py runs it. Reports the grammar's added ms per step (median, p90), the step's
median ms and their ratio; and each backend's one-off compile of the schema (compile cache
cleared each time) plus the first matcher and mask, which a new schema's first request pays.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from srt_lite.constrained import backend_class
from srt_lite.constrained.base import allocate_bitmask, apply_bitmask
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


def time_grammar(backend, compiled, seqs: list[list[int]], batch: int, steps: int, vocab: int) -> dict:
    rows = [Row(backend, compiled, seqs[i % len(seqs)], i * 11) for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    base = torch.randn(batch, vocab, generator=g) * 4.0  # [B, V] float32
    fill, apply, accept, total = [], [], [], []
    idx = list(range(batch))
    for step in range(steps + 5):
        logits = base.clone()
        t0 = time.perf_counter()
        bitmask = allocate_bitmask(batch, vocab)  # [B, ceil(V / 32)] int32
        for i, r in enumerate(rows):
            r.matcher.fill_bitmask(bitmask, i)
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask, idx)
        t2 = time.perf_counter()
        done = []
        for r in rows:
            ok = r.matcher.accept(r.tokens[r.pos])
            r.pos += 1
            if r.matcher.is_terminated():
                done.append(r)
            assert ok
        t3 = time.perf_counter()
        for r in done:  # a new request: untimed
            r.restart()
        if step >= 5:  # warm-up (llguidance builds its lexer states lazily)
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            accept.append(t3 - t2)
            total.append(t3 - t0)
    ms = 1e3
    return {
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


def time_decode(runner: ModelRunner, rows: list[int], context: int, steps: int, vocab: int, eos: set[int]) -> float:
    """Median ms of forward + sampler for one decode step of len(rows) rows."""
    r2t = runner.req_to_token_pool.req_to_token
    b = len(rows)
    reqs = [Req(f"r{i}", [1] * context, SamplingParams.from_dict({})) for i in range(b)]
    info = SamplingBatchInfo.from_reqs(reqs, vocab, runner.device, eos)
    sampler = Sampler(0, runner.device)
    times = []
    for i in range(steps + 2):
        fb = ForwardBatch.create(
            input_ids=[(j * 37) % 1000 + 1 for j in range(b)],
            req_pool_indices=rows,
            prefix_lens=[context] * b,
            extend_lens=[1] * b,
            out_cache_loc=torch.cat([r2t[row, context : context + 1].to(torch.int64) for row in rows]),
            device=runner.device,
        )
        t0 = time.perf_counter()
        out = runner.forward(fb)
        sampler(out.next_token_logits, info)
        if i >= 2:  # the first runs warm up allocator and kernels
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def int_list(values: list[str]) -> list[int]:
    return [int(x) for v in values for x in v.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", nargs="+", default=["1,16"], help="e.g. 1,16 or 1 16")
    parser.add_argument("--steps", type=int, default=200, help="grammar steps timed per batch size and backend")
    parser.add_argument("--decode-steps", type=int, default=10, help="decode steps timed per batch size")
    parser.add_argument("--context", type=int, default=200, help="KV tokens per row before the decode step")
    parser.add_argument("--compiles", type=int, default=5, help="fresh compiles timed per backend")
    parser.add_argument("--backend", default="both", choices=["xgrammar", "llguidance", "both"])
    args = parser.parse_args()
    batch_sizes = int_list(args.batch_sizes)
    logging.basicConfig(level=logging.WARNING)

    from transformers import AutoTokenizer

    path = resolve_model_path(args.model_path)
    runner = build_runner(path, args.dtype, max(batch_sizes))
    cfg = runner.model_config if hasattr(runner, "model_config") else ModelConfig.load(path, None)
    vocab, eos = cfg.vocab_size, list(cfg.eos_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(path)
    seqs = [tokenizer.encode(a, add_special_tokens=False) + [eos[0]] for a in answers()]
    schema = json.dumps(SCHEMA)
    names = ["xgrammar", "llguidance"] if args.backend == "both" else [args.backend]

    # Decode steps first, while nothing else has warmed the caches.
    pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    rows = [runner.req_to_token_pool.alloc() for _ in range(max(batch_sizes))]
    for row in rows:
        r2t[row, : args.context + 1] = pool.alloc(args.context + 1).to(torch.int32)
    decode = {b: time_decode(runner, rows[:b], args.context, args.decode_steps, vocab, set(eos)) for b in batch_sizes}

    print(f"dtype {runner.dtype}, threads {torch.get_num_threads()}, vocab {vocab}, context {args.context}, "
          f"answers {min(map(len, seqs))}-{max(map(len, seqs))} tokens")
    results, compiles = [], {}
    for name in names:
        backend = backend_class(name)(tokenizer, vocab, eos)
        compiles[name] = time_compile(backend, schema, args.compiles, vocab)
        compiled = backend.compile("json_schema", schema)
        for s in seqs:
            check_walk(backend, compiled, s, vocab)
        for b in batch_sizes:
            results.append((b, name, time_grammar(backend, compiled, seqs, b, args.steps, vocab)))

    print("| B | backend | fill ms | apply ms | accept ms | added ms p50 | added ms p90 | decode step ms | added / step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for b, name, r in results:
        print(f"| {b} | {name} | {r['fill']:.3f} | {r['apply']:.3f} | {r['accept']:.3f} | {r['p50']:.3f} | "
              f"{r['p90']:.3f} | {decode[b]:.1f} | {r['p50'] / decode[b] * 100:.1f}% |")
    for name, (comp, first) in compiles.items():
        print(f"compile {name:<10s} {comp:8.1f} ms (median of {args.compiles}, cache cleared)  "
              f"first matcher + mask {first:6.1f} ms")


if __name__ == "__main__":
    main()
