"""The Scheduler process: continuous batching over the radix cache, one forward per step.

    loop:
        recv messages (blocking only when idle) -> new requests, aborts, flush, load queries
        batch = a new prefill batch if the waiting queue allows one, else decode of the
                running requests (retracting some if KV runs out)
        tokens = forward + sample
        append tokens, check finish, cache or free KV, send new ids to the detokenizer
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any

import torch
import zmq

from srt_lite import cpu_caps
from srt_lite import envs
from srt_lite.managers import io_struct
from srt_lite.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetLoadReq,
    GetLoadReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from srt_lite.managers.schedule_batch import Req, ScheduleBatch
from srt_lite.managers.schedule_policy import PrefillAdder, order_waiting_queue, waits_for_in_batch_prefix
from srt_lite.managers.tp_worker import GenerationResult, TpModelWorker
from srt_lite.mem_cache.req_kv import ReqKVManager
from srt_lite.model_config import ModelConfig
from srt_lite.parser.stop_strings import find_stop
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo
from srt_lite.sampling.sampling_params import SamplingParams
from srt_lite.server_args import PortArgs, ServerArgs
from srt_lite.speculative.ngram import NgramProposer
from srt_lite.distributed.parallel_state import broadcast_messages, init_distributed
from srt_lite.utils import configure_logging, init_child_process, resolve_device, zmq_socket

logger = logging.getLogger(__name__)

# Decode-token reserve for admission: each running request is expected to need
# new_token_ratio * (its remaining max_new_tokens, clipped) more slots. The ratio decays while
# memory is fine and jumps back after a retraction (SGLang's scheme).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP = 4096


# Decoding rows draft in a mixed step only when its prompt tokens are at most this many (a
# new request whose prompt is mostly a cached prefix, as in W3, where requests finishing at
# different times make every second or third step a mixed one): W3 with 160 prompts, two
# interleaved pairs, 128.7 / 138.1 -> 146.9 / 153.0 tok/s. Beside longer prefills they do not.
DRAFTS_BESIDE_PREFILL_MAX = 64

class Scheduler:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, tp_rank: int = 0):
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.tp_size = server_args.tp_size
        self.model_config = ModelConfig.load(server_args.model_path, server_args.context_length)
        self.worker = TpModelWorker(self.model_config, server_args)
        runner = self.worker.model_runner
        self.device = runner.device
        self.kv = ReqKVManager(runner.req_to_token_pool, runner.token_to_kv_pool, server_args.disable_radix_cache)
        self.capacity = runner.max_total_num_tokens
        self.context_len = self.model_config.context_len
        self.max_running = min(server_args.max_running_requests, runner.req_to_token_pool.size)
        self.chunk_size = server_args.chunked_prefill_size or (512 if self.device == "cpu" else 8192)
        self.drafter = None
        if server_args.speculative_algorithm:
            self.drafter = NgramProposer(
                server_args.speculative_num_draft_tokens,
                server_args.speculative_ngram_min_match_window_size,
                server_args.speculative_ngram_max_match_window_size,
            )
        if not server_args.skip_server_warmup:
            drafts = server_args.speculative_num_draft_tokens if self.drafter else 0
            # A full prefill chunk too: its first use costs ~100 ms more on the CPU.
            runner.warmup(min(self.max_running, 16), drafts, self.chunk_size if 0 < self.chunk_size <= 512 else 512)
        self.eos_ids = set(self.model_config.eos_token_ids)
        from transformers import AutoTokenizer

        # Only for stop strings: the scheduler must see them complete to stop generating.
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_config.path)

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.running_info: SamplingBatchInfo | None = None  # rows aligned with self.running
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.decode_steps = 0
        self.num_retractions = 0
        self.forward_steps = 0
        # Test hook: raise inside the loop after this many forward steps (fault tests).
        self.crash_at_step = envs.TEST_CRASH_AT_STEP.get_int()
        self.decode_tokens_since_log = 0
        # Speculative decoding since start: request-steps that verified drafts, the tokens they
        # produced; and both at the last decode log line.
        self.spec_rows_total = self.spec_tokens_total = 0
        self.spec_at_last_log = (0, 0)
        self.last_decode_log = time.monotonic()
        self.last_gen_throughput = 0.0

        # Rank 0 alone talks to the other processes; it shares what it receives with the
        # other ranks (broadcast_messages), so every rank builds the same batches.
        self.is_entry_rank = tp_rank == 0
        if self.is_entry_rank:
            ctx = zmq.Context(2)
            self.recv_from_tokenizer = zmq_socket(ctx, zmq.PULL, port_args.scheduler_input, bind=True)
            self.send_to_detokenizer = zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_input, bind=False)
            self.send_to_tokenizer = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_input, bind=False)
            self.poller = zmq.Poller()
            self.poller.register(self.recv_from_tokenizer, zmq.POLLIN)

    def ready_info(self) -> SchedulerReady:
        runner = self.worker.model_runner
        return SchedulerReady(
            tp_rank=self.tp_rank,
            max_total_num_tokens=self.capacity,
            max_context_len=self.context_len,
            max_running_requests=self.max_running,
            vocab_size=self.model_config.vocab_size,
            device=runner.device,
            dtype=str(runner.dtype).removeprefix("torch."),
            linear_path=runner.linear_path,
            cpu=cpu_caps.get().describe(),
        )

    # ---- loop --------------------------------------------------------------------------

    def event_loop(self) -> None:
        while True:
            for msg in self.recv_requests():
                self.process_message(msg)
            batch = self.get_next_batch()
            if batch is None:
                self.new_token_ratio = INIT_NEW_TOKEN_RATIO
                continue
            self.run_batch(batch)

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req)

    def recv_requests(self) -> list[Any]:
        raw: list[bytes] = []
        if self.is_entry_rank:
            if not self.busy():
                self.poller.poll(timeout=1000)  # sleep until a message arrives
            while True:
                try:
                    raw.append(self.recv_from_tokenizer.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
        if self.tp_size > 1:
            raw = broadcast_messages(raw)
        msgs = []
        for data in raw:
            try:
                msgs.append(io_struct.decode(data))
            except ValueError:
                logger.warning("dropped a malformed message")
        return msgs

    def send_to(self, socket_name: str, msg: Any) -> None:
        if self.is_entry_rank:  # the other ranks computed the same thing; one copy goes out
            getattr(self, socket_name).send(io_struct.encode(msg))

    def process_message(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            ok = not self.busy() and self.kv.flush()
            if ok and self.drafter is not None:
                self.drafter.reset()  # drafts from earlier requests' text are a cache too
            text = "" if ok else "cannot flush the cache while requests are running"
            self.send_to("send_to_tokenizer", FlushCacheReqOutput(ok, text))
        elif isinstance(msg, GetLoadReq):
            self.send_to("send_to_tokenizer", self.get_load())

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        try:
            params = SamplingParams.from_dict(msg.sampling_params)
            params.verify(self.model_config.vocab_size)
        except (TypeError, ValueError) as e:
            params = SamplingParams(max_new_tokens=0)
            req = Req(msg.rid, list(msg.input_ids), params, msg.stream)
            return self.reject(req, f"invalid sampling parameters: {e}")
        req = Req(msg.rid, list(msg.input_ids), params, msg.stream)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(params.seed)
        req.return_logprob = bool(msg.return_logprob)
        req.logprob_start_len = msg.logprob_start_len
        req.top_logprobs_num = msg.top_logprobs_num
        req.token_ids_logprob = msg.token_ids_logprob
        n = len(req.origin_input_ids)
        if n == 0:
            return self.reject(req, "the prompt is empty")
        if n >= self.context_len:
            return self.reject(
                req, f"the prompt has {n} tokens, more than the context length minus one ({self.context_len - 1})"
            )
        if n + 1 > self.capacity:
            return self.reject(req, f"the prompt has {n} tokens, more than the KV cache holds ({self.capacity})")
        if any(t < 0 or t >= self.model_config.vocab_size for t in req.origin_input_ids):
            return self.reject(req, "input_ids contain a token id outside the vocabulary")
        self.waiting.append(req)

    def reject(self, req: Req, message: str) -> None:
        logger.info("Rejected request %s: %s", req.rid, message)
        req.finish("abort", message=message)
        self.send_outputs([req])

    def abort(self, rid: str) -> None:
        for req in [r for r in self.waiting if rid in ("", r.rid)]:
            self.waiting.remove(req)
            self.kv.release(req)  # a retracted request may still hold nothing; no-op then
            req.finish("abort")
            self.send_outputs([req])
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if rid in ("", req.rid):
                req.to_abort = True

    def process_aborts(self) -> None:
        """Ends running requests marked by abort(), between steps (never mid-forward)."""
        aborted = [r for r in self.running if r.to_abort]
        if self.chunked_req is not None and self.chunked_req.to_abort:
            aborted.append(self.chunked_req)
            self.chunked_req = None
        self.remove_running(aborted)
        for req in aborted:
            self.kv.release(req)
            req.finish("abort")
        if aborted:
            self.send_outputs(aborted)

    def send_outputs(self, reqs: list[Req]) -> None:
        out = BatchTokenIDOut([], [], [], [], [], [], [], [], [], [], [])
        for r in reqs:
            if not (r.finished or r.stream):
                continue  # non-streaming requests are sent once, when they finish
            p = r.sampling_params
            out.rids.append(r.rid)
            out.new_ids.append(r.output_ids[r.sent_len :])
            r.sent_len = len(r.output_ids)
            out.finished_reasons.append(r.finished_reason)
            out.prompt_tokens.append(len(r.origin_input_ids))
            out.completion_tokens.append(len(r.output_ids))
            out.cached_tokens.append(r.cached_tokens)
            out.logprobs.append(self.take_logprobs(r) if r.return_logprob else None)
            out.skip_special_tokens.append(p.skip_special_tokens)
            out.spaces_between_special_tokens.append(p.spaces_between_special_tokens)
            out.stops.append(p.stop or [])
            out.no_stop_trim.append(p.no_stop_trim)
            out.queue_times.append(r.queue_time)
            out.first_token_times.append(r.first_token_time)
        if out.rids:
            self.send_to("send_to_detokenizer", out)

    @staticmethod
    def take_logprobs(req: Req) -> dict:
        """Logprob entries not yet sent: the prompt's once, then the new output ones."""
        new = {k: v[req.logprobs_sent :] for k, v in req.output_logprobs.items()}
        req.logprobs_sent = len(req.output_logprobs.get("output_token_logprobs", []))
        if req.input_logprobs:
            new.update(req.input_logprobs)
            req.input_logprobs = {}
        return new

    # ---- batch selection -----------------------------------------------------------------

    def get_next_batch(self) -> tuple[ScheduleBatch, torch.Tensor] | None:
        self.process_aborts()
        batch = self.get_new_prefill_batch()
        if batch is not None:
            return batch
        if self.running:
            return self.prepare_decode()
        return None

    def decode_reserve(self, req: Req) -> int:
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return int(min(max(left, 0), RESERVE_CLIP) * self.new_token_ratio)

    def get_new_prefill_batch(self) -> tuple[ScheduleBatch, torch.Tensor] | None:
        """A batch of prompt (chunks) to extend; with mixing on, the running requests decode
        their next token in the same forward, so new prompts neither wait for the running
        batch nor stall it."""
        if not self.waiting and self.chunked_req is None:
            return None
        if len(self.running) >= self.max_running and self.chunked_req is None:
            return None
        args = self.server_args
        mixed = bool(self.running) and not args.disable_mixed_chunk
        if mixed and self.kv.available() < len(self.running):
            return None  # decode alone first: it retracts to make room
        num_decode = len(self.running) if mixed else 0
        chunk = self.chunk_size if self.chunk_size > 0 else 1 << 62
        adder = PrefillAdder(
            sum(self.decode_reserve(r) for r in self.running) + num_decode,
            args.max_prefill_tokens,
            max(chunk - num_decode, 1),
            len(self.running),
        )
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            if not adder.try_add(req, self.kv.available(), self.decode_reserve(req)):
                self.chunked_req = req  # no room for the next chunk yet; decode first
                return None
        order_waiting_queue(self.waiting, args.schedule_policy, self.kv.match_len)
        for req in list(self.waiting):
            if len(self.running) + len(adder.can_run) >= self.max_running or not adder.budget_left():
                break
            if not self.kv.admit(req):
                break
            if not args.disable_radix_cache and waits_for_in_batch_prefix(req, adder.can_run):
                self.kv.release(req)  # next step its prefix is a cache hit instead of a recompute
                continue
            if not adder.try_add(req, self.kv.available(), self.decode_reserve(req)):
                self.kv.release(req)
                break
            if req.retracted == 0 and not req.output_ids:
                req.cached_tokens = req.prefix_len
            if req.queue_time is None:
                req.queue_time = time.monotonic() - req.arrival_time
            self.waiting.remove(req)
        if not adder.can_run:
            return None
        self.chunked_req = adder.chunked_req
        decoding = list(self.running) if mixed else []
        drafts = 0
        if adder.new_tokens <= DRAFTS_BESIDE_PREFILL_MAX:
            # A short prefill (a new request on a cached prefix) leaves the step decode-like.
            drafts = self.plan_drafts(decoding, reserved=adder.new_tokens)
        else:
            for r in decoding:
                # No draft tokens next to a long prefill: the step is no longer nearly free
                # per token, and drafts there cost more than they gave (W2 362 -> 401 tok/s,
                # W3 TTFT 200 -> 150 ms without them).
                r.draft_ids, r.extend_len = [], 1
        batch = ScheduleBatch(decoding + adder.can_run, is_prefill=True, num_decode=num_decode)
        out_cache_loc = self.kv.alloc(num_decode + drafts + adder.new_tokens)
        assert out_cache_loc is not None, "admission checked KV availability"
        off = 0
        for r in batch.reqs:
            self.kv.write(r, r.kv_len, out_cache_loc[off : off + r.extend_len])
            off += r.extend_len
        self.log_prefill(batch, adder.new_tokens)
        return batch, out_cache_loc

    def prepare_decode(self) -> tuple[ScheduleBatch, torch.Tensor] | None:
        if self.kv.available() < len(self.running):
            self.retract()
            if self.kv.available() < len(self.running):
                # One request alone has filled the whole KV cache: it has reached the
                # longest sequence this server can hold, so it ends as if at its context limit.
                req = self.running[-1]
                self.remove_running([req])
                req.finish("length", length=len(req.output_ids))
                self.kv.release(req)
                self.send_outputs([req])
                if not self.running:
                    return None
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        drafts = self.plan_drafts(self.running)
        out_cache_loc = self.kv.alloc(len(self.running) + drafts)
        assert out_cache_loc is not None
        off = 0
        for r in self.running:
            self.kv.write(r, r.kv_len, out_cache_loc[off : off + r.extend_len])
            off += r.extend_len
        return ScheduleBatch(list(self.running), is_prefill=False), out_cache_loc

    def plan_drafts(self, reqs: list[Req], reserved: int = 0) -> int:
        """Sets each decoding request's draft tokens (none without speculative decoding) and
        extend_len; returns the number of draft tokens, which must fit in free KV next to
        one slot per request and `reserved` slots (a mixed step's prompt tokens). Free KV
        counts evictable cache (in a long-running server the tree holds most slots);
        rejected slots return to the free list at once, so drafting evicts at most about one
        step's worth of draft tokens."""
        room_kv = self.kv.available() - len(reqs) - reserved
        total = 0
        for r in reqs:
            r.draft_ids = []
            if self.drafter is not None and room_kv - total > 0:
                left = r.sampling_params.max_new_tokens - len(r.output_ids) - 1
                # Positions up to context_len - 1 exist; the step's last is seq_len - 1 + d.
                room = min(left, self.context_len - r.seq_len, room_kv - total)
                r.draft_ids = self.drafter.propose(r, room, len(reqs))
                total += len(r.draft_ids)
            r.extend_len = 1 + len(r.draft_ids)
        return total

    def retract(self) -> None:
        """Frees KV by sending requests back to the waiting queue, fewest generated tokens
        first; they keep their output and resume from (mostly cached) prefill later."""
        order = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        retracted = []
        while self.kv.available() < len(self.running) and len(self.running) > 1:
            req = order.pop(0)
            self.remove_running([req])
            self.kv.release(req)
            req.retracted += 1
            self.num_retractions += 1
            retracted.append(req)
        # Retracted requests go first when memory allows again, oldest first.
        self.waiting[:0] = sorted(retracted, key=lambda r: r.arrival_time)
        total = sum(r.sampling_params.max_new_tokens - len(r.output_ids) for r in self.running) or 1
        self.new_token_ratio = min(1.0, (self.capacity - self.kv.available() + 0.0) / total + 0.1)
        logger.info("KV cache full: retracted %d request(s), #running-req: %d", len(retracted), len(self.running))

    # ---- running a batch ---------------------------------------------------------------

    def run_batch(self, item: tuple[ScheduleBatch, torch.Tensor]) -> None:
        batch, out_cache_loc = item
        self.forward_steps += 1
        if self.crash_at_step and self.forward_steps >= self.crash_at_step:
            raise RuntimeError(f"injected fault at step {self.forward_steps} (SRT_LITE_TEST_CRASH_AT_STEP)")
        nd = batch.num_decode if batch.is_prefill else len(batch.reqs)
        # Sampling rows: the running batch's info for the decode rows, a new one for the rest.
        infos = [self.running_info] if nd else []
        prefill_info = None
        if batch.is_prefill:
            prefill_info = SamplingBatchInfo.from_reqs(batch.reqs[nd:], self.model_config.vocab_size, self.device, self.eos_ids)
            infos.append(prefill_info)
        result = self.worker.forward_batch_generation(batch, out_cache_loc, infos)
        if nd:
            self.process_decode_result(batch.reqs[:nd], result)
        if batch.is_prefill:
            self.process_prefill_result(batch.reqs[nd:], result, prefill_info, nd)

    def process_prefill_result(self, reqs: list[Req], result: GenerationResult, info: SamplingBatchInfo, offset: int) -> None:
        """reqs are the batch's prefill rows, starting at row `offset`."""
        next_ids = result.sample.next_ids[offset : offset + len(reqs)]
        tokens = next_ids.tolist()
        done, joining = [], []
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            row = offset + i
            req.kv_len += req.extend_len
            for key, values in result.input_logprobs.get(row, {}).items():
                req.input_logprobs.setdefault(key, []).extend(values)
            if req.kv_len < req.seq_len:  # a chunk that did not reach the end of the prompt
                self.kv.cache_unfinished(req)
                continue
            if req.sampling_params.max_new_tokens == 0:
                req.finish("length", length=0)  # prefill only (e.g. to warm the cache for n > 1)
            else:
                req.output_ids.append(tok)
                if req.first_token_time is None:
                    req.first_token_time = time.time()
                self.record_logprobs(req, result, row)
                self.check_finish(req)
            if req.to_abort:
                req.finish("abort")
            if req.finished:
                self.kv.release(req)
            else:
                self.kv.cache_unfinished(req)
                joining.append(i)
            done.append(req)
        if joining:
            info.filter(joining)
            info.update(next_ids[joining])
            self.add_running([reqs[i] for i in joining], info)
        self.send_outputs(done)

    def process_decode_result(self, reqs: list[Req], result: GenerationResult) -> None:
        """reqs are the running batch (rows 0..len(reqs)-1 of the step)."""
        next_ids = result.sample.next_ids[: len(reqs)]
        tokens = next_ids.tolist()
        # Penalty counts and min_new_tokens see the first new token; rows that drafted have
        # neither (NgramProposer.eligible).
        self.running_info.update(next_ids)
        finished = []
        new_tokens = 0
        for row, (req, tok) in enumerate(zip(reqs, tokens)):
            written = req.kv_len + req.extend_len  # KV slots filled this step
            new = result.accepted.get(row, [tok])
            if req.draft_ids:
                self.drafter.observe(req, len(new) - 1)
                self.spec_rows_total += 1
                self.spec_tokens_total += len(new)
            for t in new:
                req.kv_len += 1  # the KV of the token before t is now part of the sequence
                req.output_ids.append(t)
                new_tokens += 1
                self.record_logprobs(req, result, row)
                self.check_finish(req)
                if req.finished:
                    break
            if req.kv_len < written:
                self.kv.free_tail(req, written)  # rejected draft tokens, or tokens after a stop
            req.draft_ids = []
            if req.finished:
                finished.append(req)
                self.kv.release(req)
        self.remove_running(finished)
        self.send_outputs(reqs)
        self.decode_steps += 1
        self.decode_tokens_since_log += new_tokens
        if self.decode_steps % self.server_args.decode_log_interval == 0:
            self.log_decode()

    @staticmethod
    def record_logprobs(req: Req, result: GenerationResult, row: int) -> None:
        if not req.return_logprob or result.sample.logprobs is None:
            return
        chosen, top, by_id = result.sample.logprobs[row]
        lp = req.output_logprobs
        lp.setdefault("output_token_logprobs", []).append([chosen, req.output_ids[-1]])
        lp.setdefault("output_top_logprobs", []).append([[v, t] for v, t in top])
        lp.setdefault("output_token_ids_logprobs", []).append([[v, t] for v, t in by_id] if by_id else None)

    def add_running(self, reqs: list[Req], info: SamplingBatchInfo) -> None:
        self.running.extend(reqs)
        if self.running_info is None:
            self.running_info = info
        else:
            self.running_info.merge(info)

    def remove_running(self, reqs: list[Req]) -> None:
        """Drops reqs from the running batch, keeping the sampling rows aligned."""
        gone = {id(r) for r in reqs}
        keep = [i for i, r in enumerate(self.running) if id(r) not in gone]
        if len(keep) == len(self.running):
            return
        self.running = [self.running[i] for i in keep]
        if not keep:
            self.running_info = None
        else:
            self.running_info.filter(keep)

    def check_finish(self, req: Req) -> None:
        p = req.sampling_params
        out = req.output_ids
        tok = out[-1]
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

    # ---- status ------------------------------------------------------------------------

    def holders(self) -> list[Req]:
        return self.running + ([self.chunked_req] if self.chunked_req else [])

    def get_load(self) -> GetLoadReqOutput:
        free = self.kv.token_to_kv_pool.available_size()
        cached = self.kv.tree.evictable_size()
        return GetLoadReqOutput(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_used_tokens=self.capacity - free - cached,
            kv_cached_tokens=cached,
            kv_free_tokens=free,
            kv_capacity=self.capacity,
            invariant_ok=self.kv.check(self.holders()),
            num_retractions=self.num_retractions,
            evicted_tokens=self.kv.evicted_tokens,
            gen_throughput=self.last_gen_throughput,
            spec_verified_rows=self.spec_rows_total,
            spec_new_tokens=self.spec_tokens_total,
        )

    def token_usage(self) -> float:
        return (self.capacity - self.kv.available()) / self.capacity

    def log_prefill(self, batch: ScheduleBatch, new_tokens: int) -> None:
        if not self.is_entry_rank:
            return  # every rank runs the same batches; one log line is enough
        cached = sum(r.prefix_len for r in batch.reqs if r.kv_len == r.prefix_len)
        drafts = ""
        if self.drafter is not None:  # draft tokens of the decoding rows in this (mixed) step
            drafts = f", #draft-token: {sum(len(r.draft_ids) for r in batch.reqs[: batch.num_decode])}"
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d%s",
            len(batch.reqs), new_tokens, cached, self.token_usage(), len(self.running), len(self.waiting), drafts,
        )

    def log_decode(self) -> None:
        if not self.is_entry_rank:
            return
        now = time.monotonic()
        tput = self.decode_tokens_since_log / max(now - self.last_decode_log, 1e-6)
        self.last_gen_throughput = tput
        self.decode_tokens_since_log, self.last_decode_log = 0, now
        spec = ""
        if self.drafter is not None:
            # Tokens per verified row and step (1 + accepted drafts), SGLang's "accept len".
            rows, tokens = self.spec_rows_total - self.spec_at_last_log[0], self.spec_tokens_total - self.spec_at_last_log[1]
            spec = f"accept len: {tokens / max(rows, 1):.2f}, "
            self.spec_at_last_log = (self.spec_rows_total, self.spec_tokens_total)
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, %sgen throughput (token/s): %.2f, "
            "#queue-req: %d",
            len(self.running), self.capacity - self.kv.available(), self.token_usage(), spec, tput, len(self.waiting),
        )


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, tp_rank: int, pipe) -> None:
    """Process entry: builds the Scheduler, reports ready (or the error) over `pipe`, loops."""
    init_child_process(f"srt_lite::scheduler_TP{tp_rank}", port_args.ipc_dir)
    configure_logging(server_args.log_level, prefix=f"TP{tp_rank}")
    try:
        if server_args.tp_size > 1:
            # Share the cores between ranks instead of oversubscribing them.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // server_args.tp_size))
            init_distributed(tp_rank, server_args.tp_size, resolve_device(server_args.device), port_args.dist_port)
        scheduler = Scheduler(server_args, port_args, tp_rank)
        pipe.send(("ready", scheduler.ready_info().__dict__))
        scheduler.event_loop()
    except Exception as e:  # noqa: BLE001 - report any start-up or loop failure, then die
        logger.error("Scheduler TP%d failed:\n%s", tp_rank, traceback.format_exc())
        try:
            pipe.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, BrokenPipeError):
            pass
        raise SystemExit(1)
