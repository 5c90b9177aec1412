"""TpModelWorker: one rank's forward pass plus batched sampling."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import orjson
import torch

from srt_lite import envs
from srt_lite.distributed.parallel_state import tp_broadcast_from_first

from srt_lite.managers.scheduler.schedule_batch import ScheduleBatch
from srt_lite.req import Req
from srt_lite.model_config import ModelConfig
from srt_lite.model_executor.model_runner import ModelRunner
from srt_lite.sampling.sampler import LogprobRequest, Sampler, SampleOutput, gather_logprobs
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo
from srt_lite.server_args import ServerArgs
from srt_lite.speculative.ngram import accept_greedy


@dataclass
class GenerationResult:
    sample: SampleOutput  # one token per request: the one after its last input token
    # row -> prompt logprob entries computed in this step (prefill with logprob_start_len)
    input_logprobs: dict[int, dict[str, list]]
    # Speculative decoding: row -> the new tokens of a request that had draft tokens
    # (the accepted draft prefix plus the model's token after it).
    accepted: dict[int, list[int]] = field(default_factory=dict)
    pooled: torch.Tensor | None = None  # [B, hidden] float32 for a batch with embedding requests


class TpModelWorker:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs):
        self.model_runner = ModelRunner(model_config, server_args)
        self.device = self.model_runner.device
        self.vocab_size = model_config.vocab_size
        self.sampler = Sampler(server_args.random_seed, self.device)
        # Every rank samples the same logits with the same generators, which gives the same
        # tokens on one machine. Across machines, CPUs that differ (AVX2 and AVX-512, say) may
        # round differently and pick different tokens; the ranks' batches would then diverge,
        # so with several nodes rank 0's tokens are broadcast each step.
        self.sync_sampled = server_args.nnodes > 1
        # benchmarks/replay_steps.py: each forward's rows appended to this file (JSON lines),
        # so a server run's steps can be replayed in one process to compare code variants.
        self.record_steps = envs.RECORD_STEPS.get()

    def forward_batch_generation(self, batch: ScheduleBatch, out_cache_loc: torch.Tensor) -> GenerationResult:
        """Runs the batch and samples one token per request (meaningless for a request whose
        prefill chunk does not reach the end of its prompt) with the batch's sampling rows."""
        prompt_rows = [i for i, r in enumerate(batch.reqs) if batch.is_prefill and wants_input_logprobs(r)]
        fb = batch.to_forward_batch(out_cache_loc, self.device, return_all_logits=bool(prompt_rows))
        start = time.perf_counter()
        out = self.model_runner.forward(fb)
        if self.record_steps:
            self._record_step(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, time.perf_counter() - start)
        accepted = {}
        if fb.logit_index is None:
            sample = self.sample(out.next_token_logits, batch.reqs, batch.sampling_parts())
        else:
            sample, accepted = self.verify(out.next_token_logits, batch)
        input_logprobs = {}
        if prompt_rows:
            input_logprobs = self.input_logprobs(batch, prompt_rows, out.all_logits)
        return GenerationResult(sample, input_logprobs, accepted, out.pooled)

    def verify(self, logits: torch.Tensor, batch: ScheduleBatch) -> tuple[SampleOutput, dict[int, list[int]]]:
        """Samples every logits row (a request with d draft tokens has 1 + d of them, in
        order) with its request's parameters, then accepts each draft's matching prefix.
        Only greedy requests draft (NgramProposer.eligible), so sampling a draft position
        on its own is exact."""
        reqs = batch.reqs
        counts = [1 + len(r.draft_ids) for r in reqs]
        flat_reqs = [r for r, c in zip(reqs, counts) for _ in range(c)]
        flat = self.sample(logits, flat_reqs, batch.sampling_parts(counts))
        first = [0, *itertools.accumulate(counts)][:-1]  # logits row of each request's first position
        ids = flat.next_ids.tolist()
        accepted = {
            b: accept_greedy(r.draft_ids, ids[first[b] : first[b] + counts[b]])
            for b, r in enumerate(reqs)
            if r.draft_ids
        }
        # Requests with logprobs never draft, so their one row is at first[b].
        logprobs = {b: flat.logprobs[first[b]] for b in range(len(reqs)) if flat.logprobs and first[b] in flat.logprobs}
        index = torch.tensor(first, dtype=torch.int64, device=flat.next_ids.device)
        return SampleOutput(flat.next_ids.index_select(0, index), logprobs or None), accepted

    def _record_step(self, prefix_lens: list[int], extend_lens: list[int], seconds: float) -> None:
        """One line per forward: [prefix lengths, new-token counts, forward ms]."""
        with open(self.record_steps, "ab") as f:
            f.write(orjson.dumps([list(prefix_lens), list(extend_lens), round(seconds * 1e3, 2)]) + b"\n")

    def sample(
        self, logits: torch.Tensor, reqs: list[Req], parts: list[tuple[int, int, SamplingBatchInfo]]
    ) -> SampleOutput:
        """Samples each part's logits rows (ScheduleBatch.sampling_parts) with its info; `reqs`
        has one entry per logits row."""
        if len(parts) == 1:
            out = self.sampler(logits, parts[0][2], logprob_request(reqs))
        else:
            ids, logprobs = [], {}
            for start, end, info in parts:
                part = self.sampler(logits[start:end], info, logprob_request(reqs[start:end]))
                ids.append(part.next_ids)
                logprobs.update({start + row: v for row, v in (part.logprobs or {}).items()})
            out = SampleOutput(torch.cat(ids), logprobs or None)
        if self.sync_sampled:
            tp_broadcast_from_first(out.next_ids)
        return out

    @staticmethod
    def input_logprobs(batch: ScheduleBatch, rows: list[int], all_logits: torch.Tensor) -> dict[int, dict[str, list]]:
        """Logprob of each prompt token given the tokens before it: the token at position t
        is scored by the logits at position t - 1 (so position 0 has none)."""
        starts = [0]
        for r in batch.reqs:
            starts.append(starts[-1] + r.extend_len)
        result = {}
        for row in rows:
            req = batch.reqs[row]
            n_prompt = len(req.origin_input_ids)
            first = max(req.logprob_start_len, 1)  # first scored prompt position
            # This chunk's logits score positions kv_len + 1 .. kv_len + extend_len.
            lo = max(first, req.kv_len + 1)
            hi = min(n_prompt, req.kv_len + req.extend_len + 1)
            entry: dict[str, list] = {"input_token_logprobs": [], "input_top_logprobs": [], "input_token_ids_logprobs": []}
            if req.logprob_start_len == 0 and req.kv_len == 0:
                entry["input_token_logprobs"].append([None, req.origin_input_ids[0]])
                entry["input_top_logprobs"].append(None)
                entry["input_token_ids_logprobs"].append(None)
            if lo < hi:
                logprobs = torch.log_softmax(all_logits[starts[row] + lo - 1 - req.kv_len : starts[row] + hi - 1 - req.kv_len], -1)
                targets = torch.tensor(req.origin_input_ids[lo:hi], device=logprobs.device)
                lreq = LogprobRequest(
                    list(range(hi - lo)), [req.top_logprobs_num] * (hi - lo), [req.token_ids_logprob] * (hi - lo)
                )
                for j, (chosen, top, by_id) in sorted(gather_logprobs(logprobs, targets, lreq).items()):
                    entry["input_token_logprobs"].append([chosen, req.origin_input_ids[lo + j]])
                    entry["input_top_logprobs"].append([[v, t] for v, t in top])
                    entry["input_token_ids_logprobs"].append([[v, t] for v, t in by_id] if by_id else None)
            result[row] = entry
        return result


def wants_input_logprobs(req: Req) -> bool:
    return req.return_logprob and 0 <= req.logprob_start_len < len(req.origin_input_ids) and not req.output_ids


def logprob_request(reqs: list[Req]) -> LogprobRequest | None:
    rows = [i for i, r in enumerate(reqs) if r.return_logprob]
    if not rows:
        return None
    return LogprobRequest(rows, [reqs[i].top_logprobs_num for i in rows], [reqs[i].token_ids_logprob for i in rows])
