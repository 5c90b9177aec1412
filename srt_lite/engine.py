"""The Python Engine API: the serving stack without HTTP.

    with srt_lite.Engine() as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out["text"])

The scheduler and detokenizer run as child processes; the TokenizerManager runs in a private
event-loop thread, so the synchronous and asynchronous APIs work from any caller.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator, Iterator

from srt_lite.entrypoints.launcher import launch_subprocesses
from srt_lite.managers.tokenizer.generate_request import GenerateRequest, normalize_generate_request
from srt_lite.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt_lite.managers.validation import LogprobOptions
from srt_lite.server_args import ServerArgs
from srt_lite.utils import configure_logging

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        if self.server_args.node_rank > 0:
            raise ValueError(
                "an Engine runs on node 0; start the other nodes with "
                "`python -m srt_lite.launch_server ... --node-rank N`"
            )
        if not logging.getLogger().handlers:
            configure_logging(self.server_args.log_level)
        self._launch = launch_subprocesses(self.server_args)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="srt_lite-engine", daemon=True)
        self._thread.start()
        self.tokenizer_manager = TokenizerManager(
            self.server_args, self._launch.port_args, self._launch.model_dir, self._launch.info,
            tokenizer=self._launch.tokenizer,
        )
        self.dead: str | None = None
        self._launch.procs.watch(self._on_child_death)
        self._closed = False

    # ---- helpers ---------------------------------------------------------------------

    def _on_child_death(self, name: str, code: int | None) -> None:
        self.dead = f"{name} died unexpectedly (exit code {code})"
        logger.error(self.dead)
        self.loop.call_soon_threadsafe(self.tokenizer_manager.fail_all, self.dead)

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _prepare(self, prompt, sampling_params, input_ids, stream: bool, logprobs: LogprobOptions) -> GenerateRequest:
        """Checks the call and normalises it as POST /generate does its body."""
        self._check_alive()
        return normalize_generate_request(
            self.tokenizer_manager, text=prompt, input_ids=input_ids, sampling_params=sampling_params,
            stream=stream, logprobs=logprobs, text_field="prompt",
        )

    async def _run_all(self, req: GenerateRequest) -> list[dict]:
        """Every prompt's n completions, prompt after prompt."""
        return await self.tokenizer_manager.generate_all(req.input_ids, req.params, req.logprobs, req.choice_rids())

    # ---- public API --------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        return_text_in_logprobs: bool = False,
    ) -> dict | list[dict] | Iterator[dict]:
        """Returns a dict (one prompt, n == 1), a list of dicts (a batch, or n > 1: the n
        completions of each prompt in turn), or with stream=True an iterator of incremental
        chunks (`text` holds only the new text)."""
        logprobs = LogprobOptions(
            return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob, return_text_in_logprobs
        )
        req = self._prepare(prompt, sampling_params, input_ids, stream, logprobs)
        if stream:
            return self._stream(req.input_ids[0], req.params[0], logprobs)
        return req.shape(self._run(self._run_all(req)))

    def _stream(self, ids: list[int], params, logprobs: LogprobOptions) -> Iterator[dict]:
        agen = self.tokenizer_manager.generate(ids, params, stream=True, logprobs=logprobs)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            # Closing early (break, garbage collection) aborts the request.
            self._run(agen.aclose())

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        stream: bool = False,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
        return_text_in_logprobs: bool = False,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """The awaitable form of `generate` (same arguments and results)."""
        logprobs = LogprobOptions(
            return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob, return_text_in_logprobs
        )
        req = self._prepare(prompt, sampling_params, input_ids, stream, logprobs)
        if stream:
            return self._async_stream(req.input_ids[0], req.params[0], logprobs)
        fut = asyncio.run_coroutine_threadsafe(self._run_all(req), self.loop)
        return req.shape(await asyncio.wrap_future(fut))

    async def _async_stream(self, ids: list[int], params, logprobs: LogprobOptions) -> AsyncIterator[dict]:
        agen = self.tokenizer_manager.generate(ids, params, stream=True, logprobs=logprobs)

        def on_engine_loop(coro):
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

        try:
            while True:
                try:
                    yield await on_engine_loop(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            await on_engine_loop(agen.aclose())

    def flush_cache(self) -> bool:
        return self._run(self.tokenizer_manager.flush_cache()).success

    def get_load(self):
        return self._run(self.tokenizer_manager.get_load())

    def abort_request(self, rid: str = "") -> None:
        self._run(self.tokenizer_manager.abort(rid))

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if self.dead:
            raise RuntimeError(self.dead)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._launch.procs.shutdown()

        async def stop() -> None:
            self.tokenizer_manager.close()
            await asyncio.sleep(0)

        try:
            self._run(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
