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
from srt_lite.managers.tokenizer_manager import LogprobOptions, RequestError, TokenizerManager
from srt_lite.server_args import ServerArgs
from srt_lite.utils import configure_logging

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        if not logging.getLogger().handlers:
            configure_logging(self.server_args.log_level)
        self._launch = launch_subprocesses(self.server_args)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="srt_lite-engine", daemon=True)
        self._thread.start()
        self.tokenizer_manager = TokenizerManager(
            self.server_args, self._launch.port_args, self._launch.model_dir, self._launch.info
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

    def _prepare(self, prompt, sampling_params, input_ids, stream: bool) -> tuple[list[list[int]], list, bool]:
        """Normalises single/batch inputs to lists of token ids and of SamplingParams."""
        self._check_alive()
        tm = self.tokenizer_manager
        if (prompt is None) == (input_ids is None):
            raise RequestError("give exactly one of prompt or input_ids")
        if prompt is not None:
            is_batch = isinstance(prompt, list)
            prompts = prompt if is_batch else [prompt]
            if not all(isinstance(p, str) for p in prompts):
                raise RequestError("prompt must be a string or a list of strings")
            ids = [tm.tokenize(p) for p in prompts]
        else:
            is_batch = bool(input_ids) and isinstance(input_ids[0], list)
            ids = input_ids if is_batch else [input_ids]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids):
                raise RequestError("sampling_params list must have one entry per prompt")
            params = [tm.make_sampling_params(p) for p in sampling_params]
        else:
            params = [tm.make_sampling_params(sampling_params)] * len(ids)
        if stream and (is_batch or params[0].n > 1):
            raise RequestError("stream=True takes a single prompt with n == 1")
        return ids, params, is_batch

    async def _run_all(self, ids: list[list[int]], params: list, logprobs: LogprobOptions) -> list[dict]:
        """Every prompt's n completions, flattened prompt by prompt."""
        groups = await asyncio.gather(
            *(self.tokenizer_manager.generate_n(i, p, logprobs) for i, p in zip(ids, params))
        )
        return [out for group in groups for out in group]

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
        ids, params, is_batch = self._prepare(prompt, sampling_params, input_ids, stream)
        if stream:
            return self._stream(ids[0], params[0], logprobs)
        outs = self._run(self._run_all(ids, params, logprobs))
        return outs if is_batch or params[0].n > 1 else outs[0]

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
        ids, params, is_batch = self._prepare(prompt, sampling_params, input_ids, stream)
        if stream:
            return self._async_stream(ids[0], params[0], logprobs)
        fut = asyncio.run_coroutine_threadsafe(self._run_all(ids, params, logprobs), self.loop)
        outs = await asyncio.wrap_future(fut)
        return outs if is_batch or params[0].n > 1 else outs[0]

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
