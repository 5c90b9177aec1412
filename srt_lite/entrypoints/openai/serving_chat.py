"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from srt_lite.entrypoints.errors import stream_error
from srt_lite.entrypoints.http_io import SSE_DONE, anext_or_none, json_response, read_json, sse
from srt_lite.entrypoints.openai.protocol import ChatCompletionRequest, now, random_id
from srt_lite.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    abort_error,
    finish_reason,
    token_text,
    usage,
)
from srt_lite.managers.validation import LogprobOptions, RequestError
from srt_lite.parser.reasoning_parser import ReasoningParser, prompt_opens_reasoning


async def create_chat_completion(request: Request) -> Response:
    """POST /v1/chat/completions"""
    serving: OpenAIServingChat = request.app.state.openai_chat
    return await serving.create(request, await read_json(request))


class OpenAIServingChat(OpenAIServingBase):
    def build_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise RequestError(str(e)) from None
        kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
        if req.continue_final_message:
            kwargs.update(add_generation_prompt=False, continue_final_message=True)
        else:
            kwargs.update(add_generation_prompt=req.add_generation_prompt)
        if self.state.chat_template is not None:
            kwargs["chat_template"] = self.state.chat_template
        try:
            text = self.tm.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation
            raise RequestError(f"the chat template cannot render these messages: {e}") from None
        return text, self.tm.tokenizer.encode(text, add_special_tokens=False)

    async def create(self, request: Request, body: Any) -> Response:
        req = ChatCompletionRequest.model_validate(body)
        self.check_model(req.model)
        prompt_text, input_ids = self.build_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, len(input_ids))
        self.tm.validate(input_ids, params)
        logprobs = LogprobOptions(return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0)
        parser_name = self.state.reasoning_parser if req.separate_reasoning else None
        force = prompt_opens_reasoning(prompt_text)

        def new_parser() -> ReasoningParser | None:
            if parser_name is None:
                return None
            return ReasoningParser(parser_name, force_reasoning=force, stream_reasoning=req.stream_reasoning)

        reasoning = None
        if parser_name is not None and params.grammar is not None:
            # The grammar constrains the answer, after the think block (SGLang's rule).
            reasoning = "forced" if force or parser_name == "deepseek-r1" else "optional"
        choices = self.run_choices([input_ids], params, logprobs, rid=req.rid, reasoning=reasoning)
        meta_id = random_id("chatcmpl")
        return await self.respond(
            request, req.stream, choices,
            lambda first: self.stream(req, meta_id, first, choices, new_parser),
            lambda: self.collect(req, meta_id, choices, new_parser),
        )

    # ---- non-streaming -------------------------------------------------------------------

    async def collect(self, req: ChatCompletionRequest, meta_id: str, choices: AsyncIterator, new_parser) -> Response:
        texts: dict[int, str] = {}
        lps: dict[int, list] = {}
        metas: dict[int, dict] = {}
        async for idx, chunk in choices:
            texts[idx] = texts.get(idx, "") + chunk["text"]
            lps.setdefault(idx, []).extend(self.logprob_items(chunk["meta_info"]) if req.logprobs else [])
            metas[idx] = chunk["meta_info"]
        out_choices = []
        prompt_tokens = completion_tokens = reasoning_tokens = 0
        cached = 0
        for idx in sorted(metas):
            meta = metas[idx]
            err = abort_error(meta)
            if err:
                raise RequestError(err)
            reasoning, content = None, texts[idx]
            parser = new_parser()
            if parser is not None:
                reasoning, content = parser.parse_non_stream(texts[idx])
                if reasoning:
                    reasoning_tokens += len(self.tm.tokenizer.encode(reasoning, add_special_tokens=False))
            reason, matched = finish_reason(meta)
            out_choices.append(
                {
                    "index": idx,
                    "message": {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": None},
                    "logprobs": {"content": lps[idx]} if req.logprobs else None,
                    "finish_reason": reason,
                    "matched_stop": matched,
                }
            )
            prompt_tokens = meta["prompt_tokens"]
            completion_tokens += meta["completion_tokens"]
            cached = max(cached, meta["cached_tokens"])
        body = {
            "id": meta_id,
            "object": "chat.completion",
            "created": now(),
            "model": self.state.served_model_name,
            "choices": out_choices,
            "usage": usage(prompt_tokens, completion_tokens, self.cached(cached), reasoning_tokens if new_parser() else None),
        }
        return json_response(body)

    # ---- streaming -----------------------------------------------------------------------

    async def stream(self, req: ChatCompletionRequest, meta_id: str, first, choices: AsyncIterator, new_parser) -> AsyncIterator[bytes]:
        created = now()
        model = self.state.served_model_name
        parsers: dict[int, ReasoningParser | None] = {}
        completion: dict[int, int] = {}
        prompt_tokens = cached = 0
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)

        def event(choice: dict | None, usage_obj: dict | None = None) -> bytes:
            body = {
                "id": meta_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [] if choice is None else [choice],
                "usage": usage_obj,
            }
            return sse(body)

        def running_usage() -> dict | None:
            if not continuous:
                return None
            done = sum(completion.values())
            return usage(prompt_tokens, done, self.cached(cached))

        try:
            for i in range(req.n):
                yield event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
            item = first
            while item is not None:
                idx, chunk = item
                meta = chunk["meta_info"]
                err = abort_error(meta)
                if err:
                    yield sse(stream_error(err))
                    break
                prompt_tokens, cached = meta["prompt_tokens"], max(cached, meta["cached_tokens"])
                completion[idx] = meta["completion_tokens"]
                if idx not in parsers:
                    parsers[idx] = new_parser()
                reason, matched = finish_reason(meta)
                delta = stream_delta(parsers[idx], chunk["text"], final=reason is not None)
                lp = self.logprob_items(meta) if req.logprobs else []
                if delta or lp:
                    yield event(
                        {"index": idx, "delta": delta, "logprobs": {"content": lp} if req.logprobs else None, "finish_reason": None},
                        running_usage(),
                    )
                if reason is not None:
                    yield event(
                        {"index": idx, "delta": {}, "logprobs": None, "finish_reason": reason, "matched_stop": matched},
                        running_usage(),
                    )
                item = await anext_or_none(choices)
            else:
                if include_usage:
                    yield event(None, usage(prompt_tokens, sum(completion.values()), self.cached(cached)))
            yield SSE_DONE
        finally:
            await choices.aclose()

    # ---- helpers -------------------------------------------------------------------------

    def cached(self, cached: int) -> int | None:
        return cached if self.state.enable_cache_report else None

    def logprob_items(self, meta: dict) -> list[dict]:
        """OpenAI chat logprobs entries for the new tokens of one chunk."""
        items = []
        tops = meta.get("output_top_logprobs") or []
        for k, (lp, tid, _) in enumerate(meta.get("output_token_logprobs") or []):
            text = token_text(self.tm, tid)
            top = [
                {"token": (t := token_text(self.tm, i)), "logprob": v, "bytes": list(t.encode())}
                for v, i, _ in (tops[k] if k < len(tops) and tops[k] else [])
            ]
            items.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top})
        return items


def stream_delta(parser: ReasoningParser | None, text: str, final: bool) -> dict[str, str]:
    """A chunk's new text as a chat delta: `content`, and `reasoning_content` with a
    reasoning parser (flushed at the choice's last chunk); empty parts are left out."""
    reasoning, content = "", text
    if parser is not None:
        reasoning, content = parser.parse_stream_chunk(text)
        if final:
            r2, c2 = parser.flush()
            reasoning, content = reasoning + r2, content + c2
    delta = {}
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    return delta
