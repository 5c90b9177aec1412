"""POST /v1/completions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from srt_lite.entrypoints.errors import stream_error
from srt_lite.entrypoints.http_io import SSE_DONE, anext_or_none, json_response, read_json, sse
from srt_lite.entrypoints.openai.fim import resolve_template
from srt_lite.entrypoints.openai.protocol import CompletionRequest, now, random_id
from srt_lite.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    abort_error,
    finish_reason,
    token_text,
    usage,
)
from srt_lite.entrypoints.openai.structured import check_grammar, request_grammar
from srt_lite.managers.validation import LogprobOptions, RequestError

if TYPE_CHECKING:
    from srt_lite.entrypoints.server_state import ServerState


async def create_completion(request: Request) -> Response:
    """POST /v1/completions"""
    serving: OpenAIServingCompletion = request.app.state.openai_completions
    return await serving.create(request, await read_json(request))


class OpenAIServingCompletion(OpenAIServingBase):
    def __init__(self, state: "ServerState"):
        super().__init__(state)
        self.fim = resolve_template(self.tm.tokenizer, self.tm.server_args.completion_template)

    def prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if req.suffix is not None:
            return [self.tm.tokenize(text) for text in self.fim_prompts(req)]
        if isinstance(p, str):
            return [self.tm.tokenize(p)]
        if all(isinstance(x, str) for x in p):
            return [self.tm.tokenize(x) for x in p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        if all(isinstance(x, list) for x in p):
            return [list(x) for x in p]
        raise RequestError("prompt must be a string, a list of strings, token ids, or lists of token ids")

    def fim_prompts(self, req: CompletionRequest) -> list[str]:
        """The fill-in-the-middle prompt of each text prompt, with the request's suffix."""
        if self.fim is None:
            raise RequestError(
                "suffix needs a model whose tokenizer has fill-in-the-middle tokens, or --completion-template"
            )
        if req.echo:
            raise RequestError("echo cannot be used with suffix")
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if not all(isinstance(t, str) for t in texts):
            raise RequestError("suffix needs the prompt as text, not token ids")
        return [self.fim.render(t, req.suffix) for t in texts]

    async def create(self, request: Request, body: Any) -> Response:
        req = CompletionRequest.model_validate(body)
        self.check_model(req.model)
        grammar = request_grammar(req)
        check_grammar(self.tm, grammar)
        prompts = self.prompts(req)
        # One set of parameters for every prompt; an unset max_tokens fits the longest one.
        params = self.sampling_params(req, req.max_tokens, max(len(ids) for ids in prompts), grammar)
        for ids in prompts:
            self.tm.validate(ids, params)
        want_lp = req.logprobs is not None
        logprobs = LogprobOptions(
            return_logprob=want_lp,
            top_logprobs_num=req.logprobs or 0,
            logprob_start_len=0 if (want_lp and req.echo) else -1,
        )
        choices = self.run_choices(prompts, params, logprobs, bool(req.stream), rid=req.rid)
        meta_id = random_id("cmpl")
        echo_texts = [self.tm.tokenizer.decode(ids) for ids in prompts] if req.echo else None
        return await self.respond(
            request, req.stream, choices,
            lambda first: self.stream(req, meta_id, first, choices, echo_texts),
            lambda: self.collect(req, meta_id, choices, echo_texts),
        )

    async def collect(self, req: CompletionRequest, meta_id: str, choices: AsyncIterator, echo_texts) -> Response:
        texts: dict[int, str] = {}
        lps: dict[int, dict] = {}
        metas: dict[int, dict] = {}
        prompt_lps: dict[int, dict] = {}  # the first chunk carries the prompt's logprobs
        async for idx, chunk in choices:
            texts[idx] = texts.get(idx, "") + chunk["text"]
            metas[idx] = chunk["meta_info"]
            if chunk["meta_info"].get("input_token_logprobs"):
                prompt_lps[idx] = chunk["meta_info"]
            if req.logprobs is not None:
                self.add_logprobs(lps.setdefault(idx, new_lp()), chunk["meta_info"], len(texts[idx]) - len(chunk["text"]))
        out, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        n = req.n
        for idx in sorted(metas):
            meta = metas[idx]
            err = abort_error(meta)
            if err:
                raise RequestError(err)
            text = texts[idx]
            lp = lps.get(idx)
            if echo_texts is not None:
                text = echo_texts[idx // n] + text
                if lp is not None:
                    shift_offsets(lp, len(echo_texts[idx // n]))
                    prepend_prompt_logprobs(lp, self, prompt_lps.get(idx, {}))
            reason, matched = finish_reason(meta)
            out.append({"index": idx, "text": text, "logprobs": lp, "finish_reason": reason, "matched_stop": matched})
            if idx % n == 0:
                prompt_tokens += meta["prompt_tokens"]
            completion_tokens += meta["completion_tokens"]
            cached += meta["cached_tokens"] if idx % n == 0 else 0
        body = {
            "id": meta_id, "object": "text_completion", "created": now(), "model": self.state.served_model_name,
            "choices": out,
            "usage": usage(prompt_tokens, completion_tokens, cached if self.state.enable_cache_report else None),
        }
        return json_response(body)

    async def stream(self, req: CompletionRequest, meta_id: str, first, choices: AsyncIterator, echo_texts) -> AsyncIterator[bytes]:
        created, model = now(), self.state.served_model_name
        completion: dict[int, int] = {}
        prompt: dict[int, int] = {}
        offsets: dict[int, int] = {}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def event(choice: dict | None, usage_obj: dict | None = None) -> bytes:
            return sse({
                "id": meta_id, "object": "text_completion", "created": created, "model": model,
                "choices": [] if choice is None else [choice], "usage": usage_obj,
            })

        def total_usage() -> dict:
            return usage(sum(prompt.values()), sum(completion.values()), None)

        try:
            item = first
            while item is not None:
                idx, chunk = item
                meta = chunk["meta_info"]
                err = abort_error(meta)
                if err:
                    yield sse(stream_error(err))
                    break
                if idx % req.n == 0:
                    prompt[idx] = meta["prompt_tokens"]
                completion[idx] = meta["completion_tokens"]
                text = chunk["text"]
                lp = None
                if idx not in offsets:  # the first chunk of this choice
                    offsets[idx] = 0
                    if echo_texts is not None:
                        text = echo_texts[idx // req.n] + text
                if req.logprobs is not None:
                    lp = new_lp()
                    if echo_texts is not None and meta.get("input_token_logprobs"):
                        prepend_prompt_logprobs(lp, self, meta)
                    self.add_logprobs(lp, meta, offsets[idx] + len(text) - len(chunk["text"]))
                offsets[idx] += len(text)
                reason, matched = finish_reason(meta)
                if text or lp or reason is not None:
                    yield event(
                        {"index": idx, "text": text, "logprobs": lp, "finish_reason": reason, "matched_stop": matched},
                        total_usage() if continuous else None,
                    )
                item = await anext_or_none(choices)
            else:
                if include_usage:
                    yield event(None, total_usage())
            yield SSE_DONE
        finally:
            await choices.aclose()

    def add_logprobs(self, lp: dict, meta: dict, text_offset: int) -> None:
        """Appends the chunk's output tokens in the completions logprobs layout."""
        tops = meta.get("output_top_logprobs") or []
        for k, (value, tid, _) in enumerate(meta.get("output_token_logprobs") or []):
            text = token_text(self.tm, tid)
            lp["tokens"].append(text)
            lp["token_logprobs"].append(value)
            top = tops[k] if k < len(tops) and tops[k] else []
            lp["top_logprobs"].append({token_text(self.tm, i): v for v, i, _ in top} if top else None)
            lp["text_offset"].append(text_offset)
            text_offset += len(text)


def new_lp() -> dict:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def shift_offsets(lp: dict, by: int) -> None:
    lp["text_offset"] = [o + by for o in lp["text_offset"]]


def prepend_prompt_logprobs(lp: dict, serving: OpenAIServingCompletion, meta: dict) -> None:
    """echo + logprobs: the prompt's tokens come first (the first one has no logprob)."""
    tokens, values, tops, offsets = [], [], [], []
    pos = 0
    top_in = meta.get("input_top_logprobs") or []
    for k, (value, tid, _) in enumerate(meta.get("input_token_logprobs") or []):
        text = token_text(serving.tm, tid)
        tokens.append(text)
        values.append(value)
        top = top_in[k] if k < len(top_in) and top_in[k] else None
        tops.append({token_text(serving.tm, i): v for v, i, _ in top} if top else None)
        offsets.append(pos)
        pos += len(text)
    lp["tokens"][:0] = tokens
    lp["token_logprobs"][:0] = values
    lp["top_logprobs"][:0] = tops
    lp["text_offset"][:0] = offsets
