"""The scheduler's messages in and out: ZMQ sockets on rank 0, the broadcast to other ranks.

Rank 0 alone talks to the other processes. It shares what it receives with the other ranks
(`broadcast_messages`), so every rank builds the same batches; what the ranks send is the same
on each, so only rank 0's copy goes out.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from srt_lite.distributed.parallel_state import broadcast_messages
from srt_lite.managers import io_struct
from srt_lite.managers.io_struct import BatchTokenIDOut, PortArgs
from srt_lite.req import Req
from srt_lite.utils import zmq_socket

logger = logging.getLogger(__name__)

# How long an idle scheduler sleeps in one poll before it looks again, in milliseconds.
IDLE_POLL_MS = 1000


class SchedulerIO:
    def __init__(self, port_args: PortArgs, tp_rank: int, tp_size: int):
        self.tp_size = tp_size
        self.is_entry_rank = tp_rank == 0
        if self.is_entry_rank:
            ctx = zmq.Context(2)
            self.recv_from_tokenizer = zmq_socket(ctx, zmq.PULL, port_args.scheduler_input, bind=True)
            self.send_to_detokenizer = zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_input, bind=False)
            self.send_to_tokenizer = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_input, bind=False)
            self.poller = zmq.Poller()
            self.poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        self.stop_requested = False

    def request_stop(self) -> None:
        """Rank 0 adds a ShutdownReq to what it shares next (safe to call from a signal
        handler: it only sets a flag)."""
        self.stop_requested = True

    def recv(self, block: bool) -> list[Any]:
        """Every message waiting now; with `block`, first sleeps until one arrives (or the
        poll times out), so an idle scheduler does not spin."""
        raw: list[bytes] = []
        if self.is_entry_rank:
            if block:
                self.poller.poll(timeout=IDLE_POLL_MS)
            while True:
                try:
                    raw.append(self.recv_from_tokenizer.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            if self.stop_requested:
                raw.append(io_struct.encode(io_struct.ShutdownReq()))
        if self.tp_size > 1:
            raw = broadcast_messages(raw)
        msgs = []
        for data in raw:
            try:
                msgs.append(io_struct.decode(data))
            except ValueError:
                logger.warning("dropped a malformed message")
        return msgs

    def reply(self, msg: Any) -> None:
        """A control message's answer, to the TokenizerManager."""
        if self.is_entry_rank:
            self.send_to_tokenizer.send(io_struct.encode(msg))

    def send_outputs(self, reqs: list[Req]) -> None:
        """New tokens of these requests to the detokenizer: every step for a streaming
        request, once at the end for the others."""
        out = BatchTokenIDOut()
        for r in reqs:
            if not (r.finished or r.stream):
                continue
            p = r.sampling_params
            out.rids.append(r.rid)
            out.new_ids.append(r.output_ids[r.sent_len :])
            r.sent_len = len(r.output_ids)
            out.finished_reasons.append(r.finished_reason)
            out.prompt_tokens.append(len(r.origin_input_ids))
            out.completion_tokens.append(len(r.output_ids))
            out.cached_tokens.append(r.cached_tokens)
            out.logprobs.append(take_logprobs(r) if r.return_logprob else None)
            out.skip_special_tokens.append(p.skip_special_tokens)
            out.spaces_between_special_tokens.append(p.spaces_between_special_tokens)
            out.stops.append(p.stop or [])
            out.no_stop_trim.append(p.no_stop_trim)
            out.queue_times.append(r.queue_time)
            out.first_token_times.append(r.first_token_time)
            out.embeddings.append(r.embedding)
        if out.rids and self.is_entry_rank:
            self.send_to_detokenizer.send(io_struct.encode(out))


def take_logprobs(req: Req) -> dict:
    """Logprob entries not yet sent: the prompt's once, then the new output ones."""
    new = {k: v[req.logprobs_sent :] for k, v in req.output_logprobs.items()}
    req.logprobs_sent = len(req.output_logprobs.get("output_token_logprobs", []))
    if req.input_logprobs:
        new.update(req.input_logprobs)
        req.input_logprobs = {}
    return new
