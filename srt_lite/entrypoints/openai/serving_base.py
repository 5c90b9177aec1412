"""What chat and completions serving share: model check, sampling defaults, running the
choices of a request, usage and finish-reason helpers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from srt_lite.entrypoints.http_io import anext_or_none, until_disconnected
from srt_lite.entrypoints.openai.protocol import UsageInfo, _SamplingFields
from srt_lite.entrypoints.openai.serving_models import check_model
from srt_lite.sampling.sampling_params import Grammar
from srt_lite.managers.tokenizer.choices import numbered_rids
from srt_lite.managers.tokenizer.tokenizer_manager import TokenizerManager
from srt_lite.managers.validation import LogprobOptions, RequestError
from srt_lite.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from srt_lite.entrypoints.server_state import ServerState


# OpenAI's own defaults for fields neither the request nor generation_config sets.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}


class OpenAIServingBase:
    def __init__(self, state: "ServerState"):
        self.state = state
        self.tm: TokenizerManager = state.tm
        self.defaults = {**OPENAI_DEFAULTS, **state.generation_defaults}

    def check_model(self, model: str | None) -> None:
        if model is not None:
            check_model(self.state, model)

    def sampling_params(
        self, req: _SamplingFields, max_tokens: int | None, prompt_len: int, grammar: Grammar | None = None
    ) -> SamplingParams:
        """OpenAI fields -> SamplingParams. Unset fields: generation_config, then OpenAI's
        defaults. An unset max_tokens means "up to the context length". The grammar (see
        structured.py) becomes its own key (`json_schema`, `regex` or `ebnf`)."""

        def pick(name: str, value: Any) -> Any:
            return value if value is not None else self.defaults.get(name)

        if max_tokens is None:
            max_tokens = max(self.tm.context_len - prompt_len, 0)
        d = {
            "max_new_tokens": max_tokens,
            "min_new_tokens": req.min_tokens,
            "temperature": pick("temperature", req.temperature),
            "top_p": pick("top_p", req.top_p),
            "top_k": pick("top_k", req.top_k),
            "min_p": pick("min_p", req.min_p),
            "repetition_penalty": pick("repetition_penalty", req.repetition_penalty),
            "frequency_penalty": req.frequency_penalty,
            "presence_penalty": req.presence_penalty,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens,
            "no_stop_trim": req.no_stop_trim,
            "logit_bias": req.logit_bias,
            "seed": req.seed,
            "n": req.n,
        }
        params = self.tm.make_sampling_params(d)
        params.grammar = grammar  # checked by check_grammar, named by its request field
        return params

    async def respond(
        self,
        request: Request,
        stream: bool,
        choices: AsyncIterator,
        make_stream: Callable[[Any], AsyncIterator[bytes]],
        make_collect: Callable[[], Awaitable[Response]],
    ) -> Response:
        """A streaming response, or the collected one. For a stream, the first chunk is awaited
        before the 200 goes out, so a request that fails late still gets a real error status."""
        if stream:
            first = await anext_or_none(choices)
            return StreamingResponse(make_stream(first), media_type="text/event-stream")
        return await until_disconnected(request, make_collect())

    def run_choices(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        logprobs: LogprobOptions,
        stream: bool,
        rid: str | None = None,
        reasoning: str | None = None,
    ) -> AsyncIterator[tuple[int, dict]]:
        """The n choices of every prompt as one stream of (choice index, chunk); choice
        j * n + i is sample i of prompt j. With `stream` a choice's chunks are its increments;
        without, it yields once, its whole result: the scheduler then sends a request's tokens
        once, when it ends, instead of every step (a message a token costs the decode loop
        and wakes the detokenizer, on the cores the forward runs on). A client rid names the
        only choice, or choice k as rid-k. Closing the stream early (client gone) aborts every
        choice. `reasoning`: where a grammar starts (TokenizedGenerateReqInput.reasoning)."""
        rids = numbered_rids(rid, len(prompts) * params.n)
        return self.tm.generate_choices(prompts, [params] * len(prompts), logprobs, rids, stream=stream, reasoning=reasoning)


async def collect_one(choices: AsyncIterator[tuple[int, dict]]) -> tuple[str, dict]:
    """(the whole text, the last meta_info) of a one-choice run; an abort that carries a
    message (a rejected request, a dead scheduler) raises it as a RequestError."""
    text, meta = "", {}
    async for _, chunk in choices:
        text += chunk["text"]
        meta = chunk["meta_info"]
    err = abort_error(meta)
    if err:
        raise RequestError(err)
    return text, meta


def finish_reason(meta: dict) -> tuple[str | None, Any]:
    """(OpenAI finish_reason, matched_stop) from our meta_info."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None, None
    return fr["type"], fr.get("matched")


def abort_error(meta: dict) -> str | None:
    """An abort that carries a message is an error (rejected request, dead scheduler)."""
    fr = meta.get("finish_reason")
    if fr and fr["type"] == "abort" and fr.get("message"):
        return fr["message"]
    return None


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None, reasoning: int | None = None) -> dict:
    u = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=None if cached is None else {"cached_tokens": cached},
        reasoning_tokens=reasoning,
    )
    return u.model_dump()


def token_text(tm: TokenizerManager, token_id: int) -> str:
    return tm.tokenizer.decode([token_id])
