"""The TokenizerManager: lives in the main process (the HTTP server's event loop, or the
Engine's loop thread). It tokenizes requests, sends them to the scheduler, and turns the
detokenizer's text deltas into per-request async streams."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

import zmq
import zmq.asyncio

from srt_lite.managers import io_struct
from srt_lite.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetLoadReq,
    GetLoadReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from srt_lite.managers.validation import NO_LOGPROBS, LogprobOptions, RequestError, check_input, parse_sampling_params
from srt_lite.sampling.sampling_params import SamplingParams
from srt_lite.server_args import PortArgs, ServerArgs
from srt_lite.utils import zmq_socket

if TYPE_CHECKING:
    from srt_lite.metrics import MetricsCollector

logger = logging.getLogger(__name__)


class Overloaded(Exception):
    """Too many requests in flight; the client should retry later (HTTP 503)."""


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    created: float
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    text_sent: int = 0  # characters already yielded (streaming)
    ids_sent: int = 0
    finished_reason: dict | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: dict[str, list] = field(default_factory=dict)
    logprobs_sent: dict[str, int] = field(default_factory=dict)
    # metrics: wall-clock times (comparable with the scheduler's stamps)
    created_wall: float = field(default_factory=time.time)
    last_tokens_wall: float | None = None
    itl_observed: bool = False
    queue_time: float | None = None
    first_token_time: float | None = None
    internal: bool = False  # the server's own request (n > 1 warm-up, health probe): not counted
    logprob_opts: LogprobOptions = NO_LOGPROBS


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, model_dir: str, info: SchedulerReady):
        from transformers import AutoTokenizer

        self.server_args = server_args
        self.port_args = port_args
        self.info = info
        self.context_len = info.max_context_len
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.rid_to_state: dict[str, ReqState] = {}
        self.draining = False  # set at shutdown: no new requests
        self.metrics: MetricsCollector | None = None  # set by the HTTP server under --enable-metrics
        self._started = False
        self._control_waiters: dict[type, list[asyncio.Future]] = {}

    # ---- sockets and the receive loop -----------------------------------------------------

    def _ensure_started(self) -> None:
        """Sockets are created in the loop that uses them (uvicorn's, or the Engine thread's)."""
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
            state = self.rid_to_state.get(rid)
            if state is None:
                continue  # aborted by the client already
            state.text += msg.texts[i]
            state.output_ids.extend(msg.new_ids[i])
            state.completion_tokens = msg.completion_tokens[i]
            state.cached_tokens = msg.cached_tokens[i]
            if msg.logprobs[i]:
                for key, values in msg.logprobs[i].items():
                    state.logprobs.setdefault(key, []).extend(values)
            if self.metrics is not None and not state.internal:
                self._record_metrics(state, msg, i)
            if msg.finished_reasons[i] is not None:
                state.finished_reason = msg.finished_reasons[i]
            state.event.set()

    def _record_metrics(self, state: ReqState, msg: BatchStrOut, i: int) -> None:
        if msg.queue_times:
            state.queue_time = msg.queue_times[i]
            state.first_token_time = msg.first_token_times[i]
        now = time.time()
        n_new = len(msg.new_ids[i])
        if n_new and state.last_tokens_wall is not None:
            self.metrics.on_stream_tokens(now - state.last_tokens_wall, n_new)
            state.itl_observed = True
        if n_new:
            state.last_tokens_wall = now
        finished = msg.finished_reasons[i]
        if finished is not None:
            self.metrics.on_finish(
                created_wall=state.created_wall,
                prompt_tokens=state.prompt_tokens,
                completion_tokens=state.completion_tokens,
                cached_tokens=state.cached_tokens,
                aborted=finished.get("type") == "abort",
                queue_time=state.queue_time,
                first_token_time=state.first_token_time,
                itl_observed=state.itl_observed,
            )

    async def _control(self, req: Any, reply_type: type, timeout: float = 30.0) -> Any:
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        self._control_waiters.setdefault(reply_type, []).append(fut)
        await self.send_to_scheduler.send(io_struct.encode(req))
        return await asyncio.wait_for(fut, timeout)

    # ---- public API ----------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def make_sampling_params(self, d: dict | None) -> SamplingParams:
        return parse_sampling_params(d, self.info.vocab_size)

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        check_input(input_ids, params, self.context_len, self.info.vocab_size)

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        stream: bool = False,
        rid: str | None = None,
        logprobs: LogprobOptions = NO_LOGPROBS,
        internal: bool = False,
    ) -> AsyncIterator[dict]:
        """Yields output dicts: for a stream, one per arriving delta (`text` and `output_ids`
        hold the new part only); otherwise one dict with the whole result. Closing the
        generator early aborts the request."""
        self.validate(input_ids, params)
        self._ensure_started()
        if self.draining:
            raise Overloaded("the server is shutting down")
        limit = self.server_args.max_running_requests + self.server_args.max_queued_requests
        if len(self.rid_to_state) >= limit:
            # Bounded memory instead of an ever-growing queue.
            raise Overloaded(f"the server is at its limit of {limit} requests in flight; retry later")
        rid = rid or uuid.uuid4().hex
        if rid in self.rid_to_state:
            raise RequestError(f"duplicate request id {rid}")
        logprobs.verify(self.info.vocab_size)
        state = ReqState(
            rid=rid, prompt_tokens=len(input_ids), created=time.perf_counter(), logprob_opts=logprobs, internal=internal
        )
        self.rid_to_state[rid] = state
        msg = TokenizedGenerateReqInput(
            rid, input_ids, params.to_dict(), stream,
            return_logprob=logprobs.return_logprob,
            logprob_start_len=logprobs.logprob_start_len,
            top_logprobs_num=logprobs.top_logprobs_num,
            token_ids_logprob=logprobs.token_ids_logprob,
        )
        try:
            await self.send_to_scheduler.send(io_struct.encode(msg))
            while True:
                await state.event.wait()
                state.event.clear()
                finished = state.finished_reason is not None
                if stream:
                    yield self._chunk(state, incremental=True)
                elif finished:
                    yield self._chunk(state, incremental=False)
                if finished:
                    if self.server_args.log_requests:
                        logger.info(
                            "Request %s: prompt %r -> output %r (%s)", rid,
                            self.tokenizer.decode(input_ids), state.text, state.finished_reason,
                        )
                    return
        finally:
            if state.finished_reason is None:
                # The consumer went away (client disconnect, closed stream): the abort goes
                # out first, so the scheduler frees the request's KV within a step.
                self._abort_nowait(rid)
            self.rid_to_state.pop(rid, None)

    def _chunk(self, state: ReqState, incremental: bool) -> dict:
        if incremental:
            text, ids = state.text[state.text_sent :], state.output_ids[state.ids_sent :]
            state.text_sent, state.ids_sent = len(state.text), len(state.output_ids)
        else:
            text, ids = state.text, list(state.output_ids)
        meta = {
            "id": state.rid,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": state.completion_tokens,
            "cached_tokens": state.cached_tokens,
            "finish_reason": state.finished_reason,
            "e2e_latency": time.perf_counter() - state.created,
        }
        if state.logprob_opts.return_logprob:
            meta.update(self._logprob_fields(state, incremental))
        return {"text": text, "output_ids": ids, "meta_info": meta}

    _LOGPROB_KEYS = (
        "input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs",
        "output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs",
    )

    def _logprob_fields(self, state: ReqState, incremental: bool) -> dict[str, list]:
        """SGLang's layout: entries are (logprob, token_id, text or None); top / token-id
        entries are lists of those (or None where a position has none)."""
        with_text = state.logprob_opts.return_text_in_logprobs
        out = {}
        for key in self._LOGPROB_KEYS:
            values = state.logprobs.get(key, [])
            if incremental:
                start = state.logprobs_sent.get(key, 0)
                state.logprobs_sent[key] = len(values)
                values = values[start:]
            if key.endswith("token_logprobs"):
                out[key] = [self._lp_entry(e, with_text) for e in values]
            else:
                out[key] = [None if e is None else [self._lp_entry(x, with_text) for x in e] for e in values]
        return out

    def _lp_entry(self, entry: list, with_text: bool) -> tuple:
        logprob, tid = entry
        return (logprob, tid, self.tokenizer.decode([tid]) if with_text else None)

    async def generate_n(
        self, input_ids: list[int], params: SamplingParams, logprobs: LogprobOptions = NO_LOGPROBS
    ) -> list[dict]:
        """The `n` completions of one prompt. For n > 1 the prompt is prefilled once first
        (max_new_tokens=0), so every completion starts from its cached KV. With a seed,
        completion i uses seed + i (distinct, reproducible samples)."""
        n = params.n
        if n > 1:
            await self.prefill_only(input_ids, params)

        async def one(i: int) -> dict:
            p = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            out = None
            async for out in self.generate(input_ids, p, logprobs=logprobs):
                pass
            return out

        return list(await asyncio.gather(*(one(i) for i in range(n))))

    async def prefill_only(self, input_ids: list[int], params: SamplingParams) -> None:
        """Puts a prompt's KV in the radix cache without generating, so that the n choices
        sampled next share one prefill. Not counted as a request in the metrics."""
        warm = dataclasses.replace(params, n=1, max_new_tokens=0, min_new_tokens=0)
        async for _ in self.generate(input_ids, warm, internal=True):
            pass

    async def abort(self, rid: str) -> None:
        self._ensure_started()
        self._abort_nowait(rid)

    def _abort_nowait(self, rid: str) -> None:
        """Sends the abort without awaiting: it must go out even from a cancelled task."""
        self.send_to_scheduler.send(io_struct.encode(AbortReq(rid)), zmq.NOBLOCK)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._control(FlushCacheReq(), FlushCacheReqOutput)

    async def get_load(self) -> GetLoadReqOutput:
        return await self._control(GetLoadReq(), GetLoadReqOutput)

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
        for state in list(self.rid_to_state.values()):
            if state.finished_reason is None:
                state.finished_reason = {"type": "abort", "matched": None, "message": message}
                state.event.set()
