"""The DetokenizerManager process: token ids in, text deltas out.

Per request it keeps an incremental detokenizer (never emits half a UTF-8 character) and a
stop-string matcher (holds back text that could be the start of a stop string). Its state is
dropped as soon as the request's final message passes through.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

import zmq

from srt_lite.managers import io_struct
from srt_lite.managers.io_struct import BatchStrOut, BatchTokenIDOut, PortArgs
from srt_lite.managers.detokenizer.incremental_detokenizer import IncrementalDetokenizer
from srt_lite.model_loader import tokenizer_cache
from srt_lite.sampling.stop_strings import StopStringMatcher
from srt_lite.server_args import ServerArgs
from srt_lite.utils import configure_logging, init_child_process, zmq_socket

logger = logging.getLogger(__name__)


@dataclass
class DecodeState:
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher


class DetokenizerManager:
    def __init__(self, tokenizer, port_args: PortArgs | None = None):
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}
        if port_args is not None:
            ctx = zmq.Context(2)
            self.recv_from_scheduler = zmq_socket(ctx, zmq.PULL, port_args.detokenizer_input, bind=True)
            self.send_to_tokenizer = zmq_socket(ctx, zmq.PUSH, port_args.tokenizer_input, bind=False)

    def handle(self, msg: BatchTokenIDOut) -> BatchStrOut:
        out = BatchStrOut(
            rids=msg.rids,
            texts=[],
            new_ids=msg.new_ids,
            finished_reasons=msg.finished_reasons,
            prompt_tokens=msg.prompt_tokens,
            completion_tokens=msg.completion_tokens,
            cached_tokens=msg.cached_tokens,
            logprobs=msg.logprobs,
            queue_times=msg.queue_times,
            first_token_times=msg.first_token_times,
            embeddings=msg.embeddings,
        )
        for i, rid in enumerate(msg.rids):
            state = self.states.get(rid)
            if state is None:
                state = DecodeState(
                    IncrementalDetokenizer(
                        self.tokenizer,
                        skip_special_tokens=msg.skip_special_tokens[i],
                        spaces_between_special_tokens=msg.spaces_between_special_tokens[i],
                    ),
                    StopStringMatcher(msg.stops[i], no_stop_trim=msg.no_stop_trim[i]),
                )
                self.states[rid] = state
            finished = msg.finished_reasons[i] is not None
            delta = state.detok.step(msg.new_ids[i])
            if finished:
                delta += state.detok.flush()
            text, matched = state.matcher.feed(delta)
            if finished:
                if matched is None:
                    text += state.matcher.flush()
                del self.states[rid]
            out.texts.append(text)
        return out

    def event_loop(self) -> None:
        while True:
            msg = io_struct.decode(self.recv_from_scheduler.recv())
            if isinstance(msg, BatchTokenIDOut):
                self.send_to_tokenizer.send(io_struct.encode(self.handle(msg)))


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs, model_dir: str, pipe) -> None:
    init_child_process("srt_lite::detokenizer", port_args.ipc_dir)
    configure_logging(server_args.log_level, prefix="detokenizer")
    try:
        manager = DetokenizerManager(tokenizer_cache.load(model_dir), port_args)
        pipe.send(("ready", {}))
        manager.event_loop()
    except Exception as e:  # noqa: BLE001
        logger.error("Detokenizer failed:\n%s", traceback.format_exc())
        try:
            pipe.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, BrokenPipeError):
            pass
        raise SystemExit(1)
