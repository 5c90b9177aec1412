"""A stand-in scheduler for tests of the TokenizerManager and the HTTP app: no model, no
child process, its sockets on the caller's event loop."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from srt_lite.managers import io_struct
from srt_lite.managers.io_struct import AbortReq, BatchStrOut, PortArgs, PrepareGrammarReq, TokenizedGenerateReqInput
from srt_lite.utils import zmq_socket


class FakeScheduler:
    """Answers every request with one token per tick, "x" as its text and its seed (or 0)
    as its id, until max_new_tokens; an abort ends a request at once. Records what came in."""

    def __init__(self, port_args: PortArgs, tick: float = 0.002):
        self.ctx = zmq.asyncio.Context()
        self.recv = zmq_socket(self.ctx, zmq.PULL, port_args.scheduler_input, bind=True)
        self.send = zmq_socket(self.ctx, zmq.PUSH, port_args.tokenizer_input, bind=False)
        self.tick = tick
        self.requests: list[TokenizedGenerateReqInput] = []
        self.aborts: list[str] = []
        self.prepares = 0  # PrepareGrammarReq received
        self.running: dict[str, list] = {}  # rid -> [request, tokens so far]

    async def run(self) -> None:
        while True:
            while await self.recv.poll(0):
                self.receive(io_struct.decode(await self.recv.recv()))
            if self.running:
                await self.step()
            await asyncio.sleep(self.tick)

    def receive(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.requests.append(msg)
            self.running[msg.rid] = [msg, 0]
        elif isinstance(msg, PrepareGrammarReq):
            self.prepares += 1
        elif isinstance(msg, AbortReq):
            self.aborts.append(msg.rid)
            for rid in [r for r in self.running if msg.rid in ("", r)]:
                del self.running[rid]

    async def step(self) -> None:
        rows = []
        for rid, entry in list(self.running.items()):
            req, done = entry
            limit = req.sampling_params["max_new_tokens"]
            new = [] if limit == 0 else [req.sampling_params.get("seed") or 0]
            entry[1] = done = done + len(new)
            finished = {"type": "length", "matched": None, "length": limit} if done >= limit else None
            rows.append((rid, "x" * len(new), new, finished, len(req.input_ids), done))
            if finished:
                del self.running[rid]
        msg = BatchStrOut(
            rids=[r[0] for r in rows], texts=[r[1] for r in rows], new_ids=[r[2] for r in rows],
            finished_reasons=[r[3] for r in rows], prompt_tokens=[r[4] for r in rows],
            completion_tokens=[r[5] for r in rows], cached_tokens=[0] * len(rows), logprobs=[None] * len(rows),
        )
        await self.send.send(io_struct.encode(msg))

    def close(self) -> None:
        self.recv.close()
        self.send.close()
        self.ctx.term()
