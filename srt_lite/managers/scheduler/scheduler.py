"""The Scheduler process: continuous batching over the radix cache, one forward per step.

The Scheduler coordinates; each part of the work has its own owner:
    SchedulerIO        messages in (rank 0's sockets, broadcast to the other ranks) and out
    GrammarManager     requests whose grammar compiles, before they join the waiting queue
    PrefillManager     the waiting queue, admission into prefill steps, retraction
    RunningBatch       the requests that decode every step, with their sampling rows
    OutputProcessor    a step's tokens: append, finish checks, KV moves, outputs
    ReqKVManager       which KV slots each request holds (mem_cache/req_kv.py)
    SchedulerStats     counters, log lines, the load report
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from srt_lite import cpu_caps, envs
from srt_lite.constrained import GrammarBackend, backend_class
from srt_lite.constrained.reasoning import ThinkTags
from srt_lite.distributed.parallel_state import exit_now, exit_together, init_distributed, is_peer_lost
from srt_lite.managers.io_struct import (
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetLoadReq,
    PortArgs,
    PrepareGrammarReq,
    SchedulerReady,
    ShutdownReq,
    TokenizedGenerateReqInput,
)
from srt_lite.managers.scheduler.grammar_manager import GrammarManager
from srt_lite.managers.scheduler.output_processor import FinishChecker, OutputProcessor
from srt_lite.managers.scheduler.prefill_manager import PrefillManager
from srt_lite.managers.scheduler.running_batch import RunningBatch
from srt_lite.managers.scheduler.schedule_batch import ScheduleBatch
from srt_lite.managers.scheduler.scheduler_io import SchedulerIO
from srt_lite.managers.scheduler.scheduler_stats import SchedulerStats
from srt_lite.managers.scheduler.tp_worker import TpModelWorker
from srt_lite.managers.validation import RequestError, check_input, parse_sampling_params
from srt_lite.mem_cache.req_kv import ReqKVManager
from srt_lite.model_config import ModelConfig
from srt_lite.model_loader import tokenizer_cache
from srt_lite.req import Req
from srt_lite.sampling.sampling_batch_info import SamplingBatchInfo
from srt_lite.sampling.sampling_params import SamplingParams
from srt_lite.server_args import ServerArgs
from srt_lite.speculative.ngram import NgramProposer, no_drafts
from srt_lite.utils import configure_logging, die_of_sigterm, init_child_process, resolve_device

logger = logging.getLogger(__name__)

Step = tuple[ScheduleBatch, torch.Tensor]  # a batch and its KV slots (out_cache_loc)

# How long a node-0 rank waits after SIGTERM for rank 0's shutdown message before it just dies.
STOP_GRACE_S = 10.0
# How long an otherwise idle loop waits for a compiling grammar before it looks for messages.
GRAMMAR_POLL_S = 0.005


def grammar_backend_factory(config: ModelConfig, backend_name: str) -> Callable[[], GrammarBackend] | None:
    """What builds the grammar backend at the first grammar request (GrammarManager), with
    transformers' tokenizer, which the grammar libraries read; None with --grammar-backend
    none. A missing package is an error now, at start."""
    backend = backend_class(backend_name)
    if backend is None:
        return None

    def make() -> GrammarBackend:
        from transformers import AutoTokenizer

        return backend(AutoTokenizer.from_pretrained(config.path), config.vocab_size, config.eos_token_ids)

    return make


class Scheduler:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, tp_rank: int = 0):
        args = self.server_args = server_args
        self.tp_rank = tp_rank
        self.model_config = ModelConfig.load(args.model_path, args.context_length)
        make_grammar_backend = grammar_backend_factory(self.model_config, args.grammar_backend)
        # Reading the vocabulary is mostly Python work: done on a thread while the model loads,
        # whose reads, repacks and page faults run outside the GIL.
        text_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        text_side = text_pool.submit(tokenizer_cache.load, self.model_config.path)
        self.worker = TpModelWorker(self.model_config, args)
        runner = self.worker.model_runner
        self.device = runner.device
        self.context_len = self.model_config.context_len
        self.max_running = min(args.max_running_requests, runner.req_to_token_pool.size)
        self.chunk_size = args.chunk_size_for(self.device)
        self.drafter = None
        if args.speculative_algorithm:
            self.drafter = NgramProposer(
                args.speculative_num_draft_tokens,
                args.speculative_ngram_min_match_window_size,
                args.speculative_ngram_max_match_window_size,
            )
        if not args.skip_server_warmup:
            num_drafts = args.speculative_num_draft_tokens if self.drafter else 0
            max_decode, chunk = args.warmup_sizes(self.max_running, self.chunk_size)
            runner.warmup(max_decode, num_drafts, chunk)

        self.kv = ReqKVManager(runner.req_to_token_pool, runner.token_to_kv_pool, args.disable_radix_cache)
        self.io = SchedulerIO(port_args, tp_rank, args.tp_size)
        self.running = RunningBatch()
        self.prefill = PrefillManager(self.kv, args, self.max_running, self.chunk_size, self.plan_drafts)
        self.stats = SchedulerStats(
            self.kv, self.running, self.prefill, args.decode_log_interval, self.drafter is not None, tp_rank == 0
        )
        tokenizer = text_side.result()
        text_pool.shutdown()
        self.grammars = GrammarManager(make_grammar_backend, ThinkTags.from_tokenizer(tokenizer) if args.reasoning_parser else None)
        finish = FinishChecker(tokenizer, set(self.model_config.eos_token_ids), self.context_len)
        self.outputs = OutputProcessor(self.kv, self.running, self.io, finish, self.stats, self.drafter)
        self.crash_at_step = envs.TEST_CRASH_AT_STEP.get_int()
        self.handlers: dict[type, Callable[[Any], None]] = {
            TokenizedGenerateReqInput: self.add_request,
            AbortReq: self.abort,
            FlushCacheReq: self.flush_cache,
            GetLoadReq: lambda _: self.io.reply(self.stats.load(self.holders())),
            PrepareGrammarReq: lambda _: self.grammars.prepare(),
            ShutdownReq: self.shutdown,
        }
        self.stopped = False

    def ready_info(self) -> SchedulerReady:
        runner = self.worker.model_runner
        return SchedulerReady(
            tp_rank=self.tp_rank,
            max_total_num_tokens=self.kv.capacity,
            max_context_len=self.context_len,
            max_running_requests=self.max_running,
            vocab_size=self.model_config.vocab_size,
            device=runner.device,
            dtype=str(runner.dtype).removeprefix("torch."),
            linear_path=runner.linear_path,
            cpu=cpu_caps.get().describe(),
            gguf_formats=runner.gguf_formats,
            weight_bytes=runner.weight_bytes,
            deterministic=runner.deterministic,
            deterministic_gaps=runner.deterministic_gaps,
        )

    # ---- the loop ------------------------------------------------------------------------

    def event_loop(self) -> None:
        """Runs until a ShutdownReq arrives (every rank gets it in the same step)."""
        while not self.stopped:
            for msg in self.io.recv(block=not self.busy()):
                handler = self.handlers.get(type(msg))
                if handler is None:
                    logger.warning("ignored a %s message", type(msg).__name__)
                else:
                    handler(msg)
            if self.stopped:
                return
            step = self.next_step()
            if step is None:
                self.prefill.reserve.reset()
                continue
            self.run_step(*step)

    def busy(self) -> bool:
        return bool(self.prefill.waiting or self.running or self.prefill.chunked_req or self.grammars)

    def next_step(self) -> Step | None:
        self.process_aborts()
        if self.grammars:
            self.admit_compiled()
        step = self.prefill.schedule(self.running)
        if step is not None:
            self.stats.log_prefill(step[0])
            return step
        if self.running:
            return self.prepare_decode()
        if self.grammars:
            self.grammars.wait(GRAMMAR_POLL_S)  # nothing to run until a grammar is ready
        return None

    def admit_compiled(self) -> None:
        """Requests whose grammar is ready join the waiting queue; failed ones end."""
        for req in self.grammars.ready():
            if req.finished:
                self.io.send_outputs([req])
            else:
                self.prefill.add(req)

    def run_step(self, batch: ScheduleBatch, out_cache_loc: torch.Tensor) -> None:
        self.stats.forward_steps += 1
        if self.crash_at_step and self.stats.forward_steps >= self.crash_at_step:
            raise RuntimeError(f"injected fault at step {self.stats.forward_steps} ({envs.TEST_CRASH_AT_STEP.name})")
        nd = batch.num_decode if batch.is_prefill else len(batch.reqs)
        # Sampling rows: the running batch's info for the decode rows, a new one for the rest.
        batch.sampling = [self.running.info] if nd else []
        prefill_info = None
        if batch.is_prefill:
            prefill_info = SamplingBatchInfo.from_reqs(
                batch.reqs[nd:], self.model_config.vocab_size, self.device, self.outputs.finish.eos_ids
            )
            batch.sampling.append(prefill_info)
        result = self.worker.forward_batch_generation(batch, out_cache_loc)
        if nd:
            self.outputs.process_decode(batch.reqs[:nd], result)
        if batch.is_prefill:
            self.outputs.process_prefill(batch.reqs[nd:], result, prefill_info, nd)

    def prepare_decode(self) -> Step | None:
        """The running batch's next decode step, retracting requests if KV is short."""
        if self.kv.available() < len(self.running):
            self.prefill.retract(self.running)
            if self.kv.available() < len(self.running):
                # One request alone has filled the whole KV cache: it has reached the
                # longest sequence this server can hold, so it ends as if at its context limit.
                req = self.running.reqs[-1]
                self.running.remove([req])
                req.finish("length", length=len(req.output_ids))
                self.kv.release(req)
                self.io.send_outputs([req])
                if not self.running:
                    return None
        else:
            self.prefill.reserve.decay()
        reqs = list(self.running)
        self.plan_drafts(reqs)
        return ScheduleBatch(reqs, is_prefill=False), self.kv.alloc_extend(reqs)

    def plan_drafts(self, reqs: list[Req], reserved: int = 0) -> int:
        """Draft tokens for decoding requests (none without speculative decoding), fitting in
        free KV next to one slot per request and `reserved` slots (a mixed step's prompt)."""
        if self.drafter is None:
            no_drafts(reqs)
            return 0
        return self.drafter.plan(reqs, self.kv.available() - len(reqs) - reserved, self.context_len)

    # ---- messages ------------------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReqInput) -> None:
        try:
            params = parse_sampling_params(msg.sampling_params, self.model_config.vocab_size)
            check_input(msg.input_ids, params, self.context_len, self.model_config.vocab_size, self.kv.capacity)
        except RequestError as e:
            return self.reject(msg, str(e))
        req = Req(msg.rid, list(msg.input_ids), params, msg.stream)
        if req.sampling_params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(req.sampling_params.seed)
        req.return_logprob = bool(msg.return_logprob)
        req.logprob_start_len = msg.logprob_start_len
        req.top_logprobs_num = msg.top_logprobs_num
        req.token_ids_logprob = msg.token_ids_logprob
        if msg.embed:
            req.pooling = self.server_args.embedding_pooling
        if req.sampling_params.grammar is not None:
            req.reasoning = msg.reasoning
            self.grammars.add(req)
        else:
            self.prefill.add(req)

    def reject(self, msg: TokenizedGenerateReqInput, reason: str) -> None:
        """A request that cannot run ends at once with an abort that says why (the
        TokenizerManager's checks make this rare: it covers what only the scheduler knows,
        such as the KV capacity)."""
        logger.info("Rejected request %s: %s", msg.rid, reason)
        req = Req(msg.rid, list(msg.input_ids), SamplingParams(max_new_tokens=0), msg.stream)
        req.finish("abort", message=reason)
        self.io.send_outputs([req])

    def abort(self, msg: AbortReq) -> None:
        """Waiting requests end at once; running ones are marked and end between steps
        (never mid-forward), in process_aborts."""
        for req in self.prefill.abort_waiting(msg.rid) + self.grammars.abort(msg.rid):
            req.finish("abort")
            self.stats.aborted_reqs += 1
            self.io.send_outputs([req])
        for req in self.holders():
            if msg.rid in ("", req.rid):
                req.to_abort = True

    def process_aborts(self) -> None:
        aborted = [r for r in self.running if r.to_abort]
        chunk = self.prefill.take_aborted_chunk()
        if chunk is not None:
            aborted.append(chunk)
        self.running.remove(aborted)
        for req in aborted:
            self.kv.release(req)
            req.finish("abort")
        self.stats.aborted_reqs += len(aborted)
        if aborted:
            self.io.send_outputs(aborted)

    def shutdown(self, msg: ShutdownReq) -> None:
        self.stopped = True
        if self.tp_rank == 0:
            logger.info("Shutting down every rank")

    def flush_cache(self, msg: FlushCacheReq) -> None:
        ok = not self.busy() and self.kv.flush()
        if ok and self.drafter is not None:
            self.drafter.reset()  # drafts from earlier requests' text are a cache too
        self.io.reply(FlushCacheReqOutput(ok, "" if ok else "cannot flush the cache while requests are running"))

    def holders(self) -> list[Req]:
        """The requests that hold KV of their own."""
        chunk = self.prefill.chunked_req
        return self.running.reqs + ([chunk] if chunk else [])


def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, tp_rank: int, pipe) -> None:
    """Process entry: builds the Scheduler, reports ready (or the error) over `pipe`, loops
    until rank 0 broadcasts a shutdown (exit 0) or a failure (exit 1)."""
    init_child_process(f"srt_lite::scheduler_TP{tp_rank}", port_args.ipc_dir)
    configure_logging(server_args.log_level, prefix=f"TP{tp_rank}")
    tp = server_args.tp_size > 1
    try:
        if tp:
            if not envs.OMP_NUM_THREADS.get():
                # Share this node's cores between its ranks instead of oversubscribing them.
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // server_args.tp_size_per_node))
            local_rank = tp_rank - server_args.local_tp_ranks().start
            init_distributed(tp_rank, server_args.tp_size, resolve_device(server_args.device), port_args.dist_init_addr, local_rank)
        scheduler = Scheduler(server_args, port_args, tp_rank)
        if tp and server_args.node_rank == 0:
            stop_on_sigterm(scheduler.io, port_args.ipc_dir)
        pipe.send(("ready", scheduler.ready_info().__dict__))
        scheduler.event_loop()
        exit_together(0)
    except Exception as e:  # noqa: BLE001 - report any start-up or loop failure, then die
        if tp and is_peer_lost(e):
            logger.error("Scheduler TP%d lost contact with another rank (%s); exiting", tp_rank, first_sentence(e))
        else:
            logger.error("Scheduler TP%d failed:\n%s", tp_rank, traceback.format_exc())
        try:
            pipe.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, BrokenPipeError):
            pass
        if tp:
            exit_now(1)
        raise SystemExit(1)


def stop_on_sigterm(io: SchedulerIO, ipc_dir: str) -> None:
    """SIGTERM on node 0 under tensor parallelism: rank 0 broadcasts a shutdown at the top of
    its next loop, so every rank (other nodes' too) leaves together and exits 0; the node's
    other ranks wait for that message. A rank that did not hear it within STOP_GRACE_S (rank 0
    stuck, or gone) dies as a plain SIGTERM would have ended it."""

    def on_sigterm(signum, frame) -> None:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        io.request_stop()
        timer = threading.Timer(STOP_GRACE_S, die_of_sigterm)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, on_sigterm)


def first_sentence(e: BaseException) -> str:
    """gloo's messages start with a source location and go on for lines; the first sentence
    says what happened."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ")[0]
