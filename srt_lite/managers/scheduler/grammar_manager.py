"""The grammar queue: requests whose grammar is being compiled wait here, off the loop.

Compiling a grammar against the vocabulary can take from a millisecond to seconds, so it runs
on a worker thread while the scheduler keeps stepping; the request enters the waiting queue
once its grammar is ready, or ends with the compiler's error (a 400 for the client).
Compiled grammars are cached by (kind, text): the n choices of a request, and clients that
send the same schema every time, compile once.

The backend itself is built at the first grammar request, on the same thread (vLLM builds its
own at the first structured request too): its libraries import transformers and index the
vocabulary, seconds of every start that servers without structured outputs would otherwise
pay. The TokenizerManager announces that request (PrepareGrammarReq) before it checks the
grammar, so the build starts while the HTTP process imports its own copy of the library.

With tensor parallelism every rank compiles on its own; a request leaves the queue only when
all ranks have its grammar (`tp_min`), so every rank admits it in the same step.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from srt_lite.constrained.base import GrammarBackend, GrammarError
from srt_lite.constrained.reasoning import ReasoningMatcher, ThinkTags
from srt_lite.distributed.parallel_state import tp_min
from srt_lite.req import Req

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used out first).
CACHE_SIZE = 256


class GrammarManager:
    def __init__(self, make_backend: Callable[[], GrammarBackend] | None, think_tags: ThinkTags | None):
        self.make_backend = make_backend  # None: structured outputs are off
        self.backend: GrammarBackend | None = None  # built by the first compile, or by prepare()
        self.preparing = False
        self.think_tags = think_tags
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar") if make_backend else None
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.queue: list[tuple[Req, Future]] = []

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, req: Req) -> None:
        """Queues a request that has a grammar; ready() hands it back."""
        g = req.sampling_params.grammar
        key = (g.kind, g.text)  # the same grammar from another field compiles once
        future = self.cache.get(key)
        if future is None:
            if self.make_backend is None:
                future = Future()
                future.set_exception(GrammarError("structured outputs are off on this server (--grammar-backend none)"))
            else:
                future = self.pool.submit(self._compile, *key)
            self.cache[key] = future
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        self.queue.append((req, future))

    def prepare(self) -> None:
        """Starts building the backend on the compile thread: the TokenizerManager announces
        its first grammar request before checking the grammar itself, which takes the HTTP
        process about as long as this build."""
        if self.pool is not None and not self.preparing:
            self.preparing = True
            self.pool.submit(self._build)

    def _build(self) -> GrammarBackend:
        """Runs on the pool's one thread, so the backend is built once. A build that failed
        is tried again by the next compile, which then reports the error."""
        if self.backend is None:
            self.backend = self.make_backend()
        return self.backend

    def _compile(self, kind: str, text: str) -> Any:
        return self._build().compile(kind, text)

    def ready(self) -> list[Req]:
        """Requests whose grammar is ready, in arrival order, each with its matcher; a request
        whose grammar failed comes back finished with the error."""
        done = 0
        while done < len(self.queue) and self.queue[done][1].done():
            done += 1
        done = tp_min(done)
        out = []
        for req, future in self.queue[:done]:
            kind = req.sampling_params.grammar.kind
            try:
                compiled = future.result()
                req.grammar = self.backend.matcher(compiled)
            except GrammarError as e:
                req.finish("abort", message=f"Invalid {kind}: {e}")
            except Exception as e:  # noqa: BLE001 - a compiler crash fails this request only
                logger.exception("grammar compile failed")
                req.finish("abort", message=f"Invalid {kind}: {e}")
            else:
                if req.reasoning is not None and self.think_tags is not None:
                    req.grammar = ReasoningMatcher(req.grammar, self.think_tags, req.reasoning == "forced")
            out.append(req)
        del self.queue[:done]
        return out

    def wait(self, timeout: float) -> None:
        """Sleeps until the oldest queued grammar is ready or `timeout` seconds pass (the
        scheduler has nothing else to do)."""
        if self.queue:
            concurrent.futures.wait([self.queue[0][1]], timeout=timeout)

    def abort(self, rid: str) -> list[Req]:
        """Removes the queued requests `rid` names ("" names all) and returns them."""
        gone = [req for req, _ in self.queue if rid in ("", req.rid)]
        self.queue = [(req, f) for req, f in self.queue if req not in gone]
        return gone
