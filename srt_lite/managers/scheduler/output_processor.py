"""What a step's sampled tokens do to its requests: append, check finish, move KV, report.

Prefill rows whose chunk reached the end of the prompt produce their first token and join the
running batch; decode rows append one token, or with speculative decoding every accepted one,
each through the same finish checks so a stop in the middle of a run ends the request there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from srt_lite.managers.scheduler.running_batch import RunningBatch
from srt_lite.managers.scheduler.scheduler_io import SchedulerIO
from srt_lite.managers.scheduler.scheduler_stats import SchedulerStats
from srt_lite.managers.scheduler.tp_worker import GenerationResult
from srt_lite.mem_cache.req_kv import ReqKVManager
from srt_lite.sampling.stop_strings import find_stop
from srt_lite.req import Req
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo
from srt_lite.speculative.ngram import NgramProposer

logger = logging.getLogger(__name__)


class FinishChecker:
    """Whether a request's latest token ends it: a completed grammar, max tokens, context
    limit, EOS, stop ids, stop strings. Stop strings need text, so the checker keeps a
    tokenizer of its own: the scheduler must see a stop string complete to stop generating.
    A request's grammar matcher is advanced here, once per token, so it never falls behind."""

    def __init__(self, tokenizer, eos_ids: set[int], context_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context_len = context_len

    def check(self, req: Req) -> None:
        p = req.sampling_params
        out = req.output_ids
        tok = out[-1]
        if req.grammar is not None:
            if not req.grammar.accept(tok):
                # Only a token the mask let through can get here, so this is a bug, not the
                # client's doing; the request ends rather than produce text off its grammar.
                logger.error("request %s: token %d is outside its grammar", req.rid, tok)
                return req.finish("abort", message="internal error: the output left its grammar")
            if req.grammar.is_terminated():
                return req.finish("stop", tok if tok in self.eos_ids else None)
        if len(out) >= p.max_new_tokens:
            return req.finish("length", length=p.max_new_tokens)
        if req.seq_len >= self.context_len:
            return req.finish("length", length=len(out))
        if len(out) < p.min_new_tokens:
            return
        if not p.ignore_eos and tok in self.eos_ids:
            return req.finish("stop", tok)
        if p.stop_token_ids and tok in p.stop_token_ids:
            return req.finish("stop", tok)
        if p.stop:
            # Enough trailing tokens to hold the longest stop string (a character can
            # take up to 4 byte-level tokens).
            window = 4 * max(len(s) for s in p.stop) + 1
            hit = find_stop(self.tokenizer.decode(out[-window:], skip_special_tokens=p.skip_special_tokens), p.stop)
            if hit is not None:
                req.finish("stop", hit[1])


@dataclass
class OutputProcessor:
    kv: ReqKVManager
    running: RunningBatch
    io: SchedulerIO
    finish: FinishChecker
    stats: SchedulerStats
    drafter: NgramProposer | None

    def process_prefill(self, reqs: list[Req], result: GenerationResult, info: SamplingBatchInfo, offset: int) -> None:
        """reqs are the step's prefill rows, starting at row `offset`; info holds their rows."""
        next_ids = result.sample.next_ids[offset : offset + len(reqs)]  # [len(reqs)]
        done, joining = [], []
        for i, (req, tok) in enumerate(zip(reqs, next_ids.tolist())):
            row = offset + i
            req.kv_len += req.extend_len
            for key, values in result.input_logprobs.get(row, {}).items():
                req.input_logprobs.setdefault(key, []).extend(values)
            if req.pooling == "mean":
                part = result.pooled[row]  # [hidden]
                req.hidden_sum = part if req.hidden_sum is None else req.hidden_sum + part
            if req.kv_len < req.seq_len:  # a chunk that did not reach the end of the prompt
                self.kv.cache_unfinished(req)
                continue
            if req.pooling is not None:
                pooled = req.hidden_sum / req.seq_len if req.pooling == "mean" else result.pooled[row]
                req.embedding = F.normalize(pooled, dim=0).tolist()
            if req.sampling_params.max_new_tokens == 0:
                req.finish("length", length=0)  # prefill only (e.g. to warm the cache for n > 1)
            else:
                req.output_ids.append(tok)
                if req.first_token_time is None:
                    req.first_token_time = time.time()
                record_logprobs(req, result, row)
                self.finish.check(req)
            if req.to_abort and not req.finished:
                req.finish("abort")
                self.stats.aborted_reqs += 1
            if req.finished:
                self.kv.release(req)
            else:
                self.kv.cache_unfinished(req)
                joining.append(i)
            done.append(req)
        if joining:
            info.filter(joining)
            info.update(next_ids[joining])
            self.running.add([reqs[i] for i in joining], info)
        self.io.send_outputs(done)

    def process_decode(self, reqs: list[Req], result: GenerationResult) -> None:
        """reqs are the running batch: rows 0..len(reqs)-1 of the step."""
        next_ids: torch.Tensor = result.sample.next_ids[: len(reqs)]  # [len(reqs)]
        tokens = next_ids.tolist()
        # Penalty counts and min_new_tokens see the first new token; rows that drafted have
        # neither (NgramProposer.eligible).
        self.running.info.update(next_ids)
        finished = []
        new_tokens = 0
        for row, (req, tok) in enumerate(zip(reqs, tokens)):
            written = req.kv_len + req.extend_len  # KV slots filled this step
            new = result.accepted.get(row, [tok])
            if req.draft_ids:
                self.drafter.observe(req, len(new) - 1)
                self.stats.count_verified(len(new))
            for t in new:
                req.kv_len += 1  # the KV of the token before t is now part of the sequence
                req.output_ids.append(t)
                new_tokens += 1
                record_logprobs(req, result, row)
                self.finish.check(req)
                if req.finished:
                    break
            if req.kv_len < written:
                self.kv.free_tail(req, written)  # rejected draft tokens, or tokens after a stop
            req.draft_ids = []
            if req.finished:
                finished.append(req)
                self.kv.release(req)
        self.running.remove(finished)
        self.io.send_outputs(reqs)
        self.stats.count_decode_step(new_tokens)


def record_logprobs(req: Req, result: GenerationResult, row: int) -> None:
    if not req.return_logprob or result.sample.logprobs is None:
        return
    chosen, top, by_id = result.sample.logprobs[row]
    lp = req.output_logprobs
    lp.setdefault("output_token_logprobs", []).append([chosen, req.output_ids[-1]])
    lp.setdefault("output_top_logprobs", []).append([[v, t] for v, t in top])
    lp.setdefault("output_token_ids_logprobs", []).append([[v, t] for v, t in by_id] if by_id else None)
