"""The TokenizerManager: lives in the main process (the HTTP server's event loop, or the
Engine's loop thread). It tokenizes requests, sends them to the scheduler, and turns the
detokenizer's text deltas into per-request async streams."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

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
from srt_lite.sampling.sampling_params import SamplingParams
from srt_lite.server_args import PortArgs, ServerArgs
from srt_lite.utils import zmq_socket

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request that cannot be served as sent; the message is shown to the client (400)."""


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


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, model_dir: str, info: SchedulerReady):
        from transformers import AutoTokenizer

        self.server_args = server_args
        self.port_args = port_args
        self.info = info
        self.context_len = info.max_context_len
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.rid_to_state: dict[str, ReqState] = {}
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
                self._on_batch_out(msg)
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
            if msg.finished_reasons[i] is not None:
                state.finished_reason = msg.finished_reasons[i]
            state.event.set()

    async def _control(self, req: Any, reply_type: type, timeout: float = 30.0) -> Any:
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        self._control_waiters.setdefault(reply_type, []).append(fut)
        await self.send_to_scheduler.send(io_struct.encode(req))
        return await asyncio.wait_for(fut, timeout)

    # ---- public API ----------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def make_sampling_params(self, d: dict | None) -> SamplingParams:
        try:
            params = SamplingParams.from_dict(d)
            params.verify(self.info.vocab_size)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None
        return params

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        n = len(input_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        if n >= self.context_len:
            raise RequestError(
                f"The input ({n} tokens) is longer than the model's context length ({self.context_len} tokens)."
            )
        if n + params.max_new_tokens > self.context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {n + params.max_new_tokens} tokens: {n} tokens from the input "
                f"and {params.max_new_tokens} tokens for the completion. Please reduce the number of tokens "
                "in the input or the completion to fit within the limit."
            )
        vocab = self.info.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in input_ids):
            raise RequestError(f"input_ids must be integers in [0, {vocab})")

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        stream: bool = False,
        rid: str | None = None,
    ) -> AsyncIterator[dict]:
        """Yields output dicts: for a stream, one per arriving delta (`text` and `output_ids`
        hold the new part only); otherwise one dict with the whole result. Closing the
        generator early aborts the request."""
        self.validate(input_ids, params)
        self._ensure_started()
        rid = rid or uuid.uuid4().hex
        if rid in self.rid_to_state:
            raise RequestError(f"duplicate request id {rid}")
        state = ReqState(rid=rid, prompt_tokens=len(input_ids), created=time.perf_counter())
        self.rid_to_state[rid] = state
        msg = TokenizedGenerateReqInput(rid, input_ids, params.to_dict(), stream)
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
                    return
        finally:
            if self.rid_to_state.pop(rid, None) is not None and state.finished_reason is None:
                # The consumer went away (client disconnect, closed stream): free the work.
                await self.abort(rid)

    def _chunk(self, state: ReqState, incremental: bool) -> dict:
        if incremental:
            text, ids = state.text[state.text_sent :], state.output_ids[state.ids_sent :]
            state.text_sent, state.ids_sent = len(state.text), len(state.output_ids)
        else:
            text, ids = state.text, list(state.output_ids)
        return {
            "text": text,
            "output_ids": ids,
            "meta_info": {
                "id": state.rid,
                "prompt_tokens": state.prompt_tokens,
                "completion_tokens": state.completion_tokens,
                "cached_tokens": state.cached_tokens,
                "finish_reason": state.finished_reason,
                "e2e_latency": time.perf_counter() - state.created,
            },
        }

    async def abort(self, rid: str) -> None:
        self._ensure_started()
        await self.send_to_scheduler.send(io_struct.encode(AbortReq(rid)))

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
