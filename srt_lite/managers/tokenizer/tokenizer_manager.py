"""The TokenizerManager: lives in the main process (the HTTP server's event loop, or the
Engine's loop thread). It tokenizes requests, sends them to the scheduler, and turns the
detokenizer's text deltas into per-request async streams.

The HTTP layer and the Engine use only its public methods and read-only properties; the
request table, the sockets and the shutdown state are its own."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

import zmq
import zmq.asyncio

from srt_lite.constrained import GrammarError, backend_class
from srt_lite.managers import io_struct
from srt_lite.managers.tokenizer.choices import merge_streams, split_choices
from srt_lite.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetLoadReq,
    GetLoadReqOutput,
    PortArgs,
    PrepareGrammarReq,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from srt_lite.managers.tokenizer.req_state import ReqState
from srt_lite.managers.validation import NO_LOGPROBS, LogprobOptions, RequestError, check_input, parse_sampling_params
from srt_lite.model_loader import tokenizer_cache
from srt_lite.sampling.sampling_params import SamplingParams
from srt_lite.server_args import ServerArgs
from srt_lite.utils import zmq_socket

if TYPE_CHECKING:
    from srt_lite.managers.tokenizer.metrics import MetricsCollector

# Callers import the request vocabulary from here as well as from validation.
__all__ = ["LogprobOptions", "Overloaded", "RequestError", "TokenizerManager"]

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """Too many requests in flight, or shutting down; the client should retry later (HTTP 503)."""


class TokenizerManager:
    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        model_dir: str,
        info: SchedulerReady,
        metrics: MetricsCollector | None = None,
        tokenizer: Any = None,
    ):
        self.server_args = server_args
        self.port_args = port_args
        self.info = info
        self.context_len = info.max_context_len
        # transformers' tokenizer (chat templates, offsets); launch_subprocesses loads it while
        # the children start.
        self.tokenizer = tokenizer or tokenizer_cache.load_transformers(model_dir)
        self.metrics = metrics  # request metrics are recorded only when a collector is given
        self.grammar_backend = backend_class(server_args.grammar_backend)
        self._valid_grammars: dict[tuple[str, str], None] = {}  # checked already (bounded)
        self._grammars_announced = False  # PrepareGrammarReq sent
        self._rid_to_state: dict[str, ReqState] = {}
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._draining = False
        self._started = False
        self._control_waiters: dict[type, list[asyncio.Future]] = {}

    # ---- state the serving layer reads ---------------------------------------------------

    @property
    def default_seed(self) -> int | None:
        """The seed of sampled requests that give none: deterministic inference samples them
        reproducibly too (as SGLang's sampling_seed), else None."""
        return self.server_args.sampling_seed if self.server_args.enable_deterministic_inference else None

    @property
    def started(self) -> bool:
        """Whether the sockets exist (they are made on first use, in the loop that uses them)."""
        return self._started

    @property
    def draining(self) -> bool:
        """Set by `drain()`: new requests are refused."""
        return self._draining

    def num_in_flight(self) -> int:
        return len(self._rid_to_state)

    def drain(self) -> None:
        """Refuses new requests from now on (Overloaded); those in flight carry on."""
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Waits until no request is in flight; False if some still are after `timeout` s."""
        if self._idle.is_set():
            return True  # wait_for with timeout 0 would time out even on a set event
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # ---- sockets and the receive loop -----------------------------------------------------

    def _ensure_started(self) -> None:
        if self._started:
            return
        self._ctx = ctx = zmq.asyncio.Context(2)
        self.send_to_scheduler = zmq_socket(ctx, zmq.PUSH, self.port_args.scheduler_input, bind=False)
        self.recv_from_detokenizer = zmq_socket(ctx, zmq.PULL, self.port_args.tokenizer_input, bind=True)
        self._recv_task = asyncio.get_running_loop().create_task(self._handle_loop())
        self._started = True

    async def _handle_loop(self) -> None:
        while True:
            data = await self.recv_from_detokenizer.recv()
            try:
                msg = io_struct.decode(data)
            except ValueError:
                logger.warning("dropped a malformed message")
                continue
            if isinstance(msg, BatchStrOut):
                try:
                    self._on_batch_out(msg)
                except Exception:  # noqa: BLE001 - one bad message must not stop every stream
                    logger.exception("failed to handle a detokenizer message")
            else:
                waiters = self._control_waiters.get(type(msg), [])
                if waiters:
                    fut = waiters.pop(0)
                    if not fut.done():
                        fut.set_result(msg)

    def _on_batch_out(self, msg: BatchStrOut) -> None:
        for i, rid in enumerate(msg.rids):
            state = self._rid_to_state.get(rid)
            if state is not None:  # else the client aborted it already
                state.apply(msg, i, self.metrics)

    async def _control(self, req: Any, reply_type: type, timeout: float = 30.0) -> Any:
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        self._control_waiters.setdefault(reply_type, []).append(fut)
        await self.send_to_scheduler.send(io_struct.encode(req))
        return await asyncio.wait_for(fut, timeout)

    # ---- requests ------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def make_sampling_params(self, d: dict | None) -> SamplingParams:
        return parse_sampling_params(d, self.info.vocab_size)

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        check_input(input_ids, params, self.context_len, self.info.vocab_size)
        if params.grammar is not None:
            g = params.grammar
            self.check_grammar(g.kind, g.text, field=g.field)

    def check_grammar(self, kind: str, text: str, field: str) -> None:
        """Raises RequestError naming `field` unless `text` is a valid grammar of `kind`
        (json_schema, regex, ebnf, structural_tag) for this server's backend."""
        if self.grammar_backend is None:
            raise RequestError(f"{field}: structured outputs are off on this server (--grammar-backend none)")
        if (kind, text) in self._valid_grammars:
            return
        self._announce_grammars()
        try:
            self.grammar_backend.check(kind, text)
        except GrammarError as e:
            raise RequestError(f"Invalid {field}: {e}") from None
        if len(self._valid_grammars) >= 1024:
            self._valid_grammars.clear()
        self._valid_grammars[(kind, text)] = None

    def _announce_grammars(self) -> None:
        """Once: tells the scheduler that grammar requests have begun, so that it builds its
        grammar backend while the check above imports this process's copy of the library
        (each takes seconds on a first request). Only from the event loop, which owns the
        sockets; a check without one (a unit test) announces nothing."""
        if self._grammars_announced:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._grammars_announced = True
        self._ensure_started()
        self.send_to_scheduler.send(io_struct.encode(PrepareGrammarReq()), zmq.NOBLOCK)

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        stream: bool = False,
        rid: str | None = None,
        logprobs: LogprobOptions = NO_LOGPROBS,
        internal: bool = False,
        reasoning: str | None = None,
        embed: bool = False,
    ) -> AsyncIterator[dict]:
        """Yields output dicts: for a stream, one per arriving delta (`text` and `output_ids`
        hold the new part only); otherwise one dict with the whole result. Closing the
        generator early aborts the request. `embed`: an embedding request (see
        TokenizedGenerateReqInput.embed); its vector is meta_info["embedding"]."""
        if params.seed is None and self.default_seed is not None:
            params = dataclasses.replace(params, seed=self.default_seed)
        state = self._admit(input_ids, params, rid, logprobs, internal)
        msg = TokenizedGenerateReqInput(
            state.rid, input_ids, params.to_dict(), stream,
            return_logprob=logprobs.return_logprob,
            logprob_start_len=logprobs.logprob_start_len,
            top_logprobs_num=logprobs.top_logprobs_num,
            token_ids_logprob=logprobs.token_ids_logprob,
            reasoning=reasoning,
            embed=embed,
        )
        try:
            await self.send_to_scheduler.send(io_struct.encode(msg))
            while True:
                await state.event.wait()
                state.event.clear()
                finished = state.finished_reason is not None
                if stream or finished:
                    yield state.output(incremental=stream, tokenizer=self.tokenizer)
                if finished:
                    if self.server_args.log_requests:
                        logger.info(
                            "Request %s: prompt %r -> output %r (%s)", state.rid,
                            self.tokenizer.decode(input_ids), state.text, state.finished_reason,
                        )
                    return
        finally:
            if state.finished_reason is None:
                # The consumer went away (client disconnect, closed stream): the abort goes
                # out first, so the scheduler frees the request's KV within a step.
                self._abort_nowait(state.rid)
            self._rid_to_state.pop(state.rid, None)
            if not self._rid_to_state:
                self._idle.set()

    def _admit(
        self, input_ids: list[int], params: SamplingParams, rid: str | None, logprobs: LogprobOptions, internal: bool
    ) -> ReqState:
        """Checks a request and enters it in the table, or raises before anything is sent."""
        self.validate(input_ids, params)
        self._ensure_started()
        if self._draining:
            raise Overloaded("the server is shutting down")
        limit = self.server_args.max_running_requests + self.server_args.max_queued_requests
        if len(self._rid_to_state) >= limit:
            # Bounded memory instead of an ever-growing queue.
            raise Overloaded(f"the server is at its limit of {limit} requests in flight; retry later")
        rid = rid or uuid.uuid4().hex
        if rid in self._rid_to_state:
            raise RequestError(f"duplicate request id {rid}")
        logprobs.verify(self.info.vocab_size)
        state = ReqState(rid=rid, prompt_tokens=len(input_ids), logprob_opts=logprobs, internal=internal)
        self._rid_to_state[rid] = state
        self._idle.clear()
        return state

    async def generate_choices(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        logprobs: LogprobOptions = NO_LOGPROBS,
        rids: Sequence[str | None] | None = None,
        stream: bool = True,
        reasoning: str | None = None,
    ) -> AsyncIterator[tuple[int, dict]]:
        """The n choices of every prompt (`params[j]` for prompt j) as one stream of (choice
        index, output), choices numbered prompt after prompt (`split_choices`). A prompt with
        n > 1 is prefilled once first, so its choices start from its cached KV. Without
        `stream` each choice yields once, its whole result. Closing this generator early
        aborts every unfinished choice. `reasoning`: see TokenizedGenerateReqInput."""
        await asyncio.gather(*(self._prefill(ids, p) for ids, p in zip(prompts, params) if p.n > 1))
        gens = [
            self.generate(c.input_ids, c.params, stream=stream, rid=c.rid, logprobs=logprobs, reasoning=reasoning)
            for c in split_choices(prompts, params, rids, self.default_seed)
        ]
        merged = merge_streams(gens)
        try:
            async for item in merged:
                yield item
        finally:
            await merged.aclose()

    async def generate_all(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        logprobs: LogprobOptions = NO_LOGPROBS,
        rids: Sequence[str | None] | None = None,
    ) -> list[dict]:
        """Every choice's whole result, in choice order (see `generate_choices`)."""
        outs: dict[int, dict] = {}
        async for i, out in self.generate_choices(prompts, params, logprobs, rids, stream=False):
            outs[i] = out
        return [outs[i] for i in sorted(outs)]

    async def _prefill(self, input_ids: list[int], params: SamplingParams) -> None:
        """Puts a prompt's KV in the radix cache without generating, so that the n choices
        sampled next share one prefill. Not counted as a request in the metrics."""
        warm = dataclasses.replace(params, n=1, max_new_tokens=0, min_new_tokens=0)
        async for _ in self.generate(input_ids, warm, internal=True):
            pass

    async def abort(self, rid: str) -> None:
        """Aborts request `rid`; "" aborts every request."""
        self._ensure_started()
        self._abort_nowait(rid)

    def _abort_nowait(self, rid: str) -> None:
        """Sends the abort without awaiting: it must go out even from a cancelled task."""
        self.send_to_scheduler.send(io_struct.encode(AbortReq(rid)), zmq.NOBLOCK)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._control(FlushCacheReq(), FlushCacheReqOutput)

    async def get_load(self) -> GetLoadReqOutput:
        return await self._control(GetLoadReq(), GetLoadReqOutput)

    async def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition text and its content type, scheduler gauges fresh."""
        if self.metrics is None:
            raise RuntimeError("this TokenizerManager was made without a metrics collector")
        return self.metrics.render(await self.get_load())

    # ---- shutdown ------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the receive loop and closes the sockets (call in this manager's loop).
        An unclosed socket would make the zmq context block interpreter exit."""
        if self._started:
            self._started = False
            self._recv_task.cancel()
            self.send_to_scheduler.close(linger=0)
            self.recv_from_detokenizer.close(linger=0)
            self._ctx.term()

    def fail_all(self, message: str) -> None:
        """Ends every pending request with an abort carrying `message` (a child process died).
        Must run in this manager's event loop."""
        for state in list(self._rid_to_state.values()):
            state.finish_with_abort(message)
