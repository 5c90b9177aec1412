"""POST /v1/chat/completions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator

from starlette.requests import Request
from starlette.responses import Response

from srt_lite.entrypoints.errors import stream_error
from srt_lite.entrypoints.http_io import SSE_DONE, anext_or_none, json_response, read_json, sse
from srt_lite.entrypoints.openai.chat_output import ChoiceOutput
from srt_lite.entrypoints.openai.protocol import ChatCompletionRequest, now, random_id
from srt_lite.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    abort_error,
    finish_reason,
    token_text,
    usage,
)
from srt_lite.entrypoints.openai.structured import check_grammar, request_grammar
from srt_lite.entrypoints.openai.tool_prompt import render_inputs, template_source, template_supports_tools
from srt_lite.entrypoints.openai.tools import ToolPlan, plan_tools
from srt_lite.managers.validation import LogprobOptions, RequestError
from srt_lite.parser.reasoning_parser import ReasoningParser, prompt_opens_reasoning
from srt_lite.parser.tool_call_parser import detect_tool_call_format
from srt_lite.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from srt_lite.entrypoints.server_state import ServerState


@dataclass
class ChatRun:
    """A validated chat request, ready to run: see OpenAIServingChat.plan."""

    input_ids: list[int]
    params: SamplingParams
    logprobs: LogprobOptions
    new_output: Callable[[], ChoiceOutput]  # one output parser per choice
    grammar_after: str | None  # where a grammar starts (TokenizedGenerateReqInput.reasoning)
    parses_reasoning: bool  # a reasoning parser splits the output


async def create_chat_completion(request: Request) -> Response:
    """POST /v1/chat/completions"""
    serving: OpenAIServingChat = request.app.state.openai_chat
    return await serving.create(request, await read_json(request))


class OpenAIServingChat(OpenAIServingBase):
    def __init__(self, state: "ServerState"):
        super().__init__(state)
        source = template_source(self.tm.tokenizer, state.chat_template)
        self.native_tools = template_supports_tools(source)
        # The parser of tool_choice "auto": the flag, else the template's own format, else
        # Hermes (the format the preamble asks for).
        self.tool_format = state.tool_call_parser or detect_tool_call_format(source) or "hermes"

    def build_prompt(self, req: ChatCompletionRequest, tools: ToolPlan) -> tuple[str, list[int]]:
        messages, kwargs = render_inputs(req.messages, tools, self.native_tools)
        kwargs.update(req.chat_template_kwargs or {})
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

    def plan(self, req: ChatCompletionRequest) -> "ChatRun":
        """Everything a chat request needs before it runs: its prompt, sampling parameters,
        grammar and output parsers (400 on anything invalid). The Responses and Anthropic
        Messages endpoints translate their requests into a ChatCompletionRequest and run it
        the same way."""
        self.check_model(req.model)
        tools = plan_tools(req)
        grammar = request_grammar(req, tools.grammar())
        check_grammar(self.tm, grammar)
        prompt_text, input_ids = self.build_prompt(req, tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, max_tokens, len(input_ids), grammar)
        self.tm.validate(input_ids, params)
        logprobs = LogprobOptions(return_logprob=req.logprobs, top_logprobs_num=req.top_logprobs or 0)
        reasoning_parser = self.state.reasoning_parser if req.separate_reasoning else None
        force = prompt_opens_reasoning(prompt_text)
        tool_format = tools.parser_format(self.tool_format)

        def new_output() -> ChoiceOutput:
            reasoning = None
            if reasoning_parser is not None:
                reasoning = ReasoningParser(reasoning_parser, force_reasoning=force, stream_reasoning=req.stream_reasoning)
            return ChoiceOutput(reasoning, tool_format, tools.names, tools.named)

        grammar_after = None
        if reasoning_parser is not None and grammar is not None:
            # The grammar constrains the answer, after the think block (SGLang's rule).
            grammar_after = "forced" if force or reasoning_parser == "deepseek-r1" else "optional"
        return ChatRun(input_ids, params, logprobs, new_output, grammar_after, reasoning_parser is not None)

    def start(self, run: "ChatRun", stream: bool, rid: str | None = None) -> AsyncIterator[tuple[int, dict]]:
        """The run's choices as one stream of (choice index, chunk): increments with `stream`,
        else each choice's whole result once (run_choices)."""
        return self.run_choices([run.input_ids], run.params, run.logprobs, stream, rid=rid, reasoning=run.grammar_after)

    async def create(self, request: Request, body: Any) -> Response:
        req = ChatCompletionRequest.model_validate(body)
        run = self.plan(req)
        choices = self.start(run, bool(req.stream), req.rid)
        meta_id = random_id("chatcmpl")
        return await self.respond(
            request, req.stream, choices,
            lambda first: self.stream(req, meta_id, first, choices, run.new_output),
            lambda: self.collect(req, meta_id, choices, run.new_output, run.parses_reasoning),
        )

    # ---- non-streaming -------------------------------------------------------------------

    async def collect(
        self, req: ChatCompletionRequest, meta_id: str, choices: AsyncIterator, new_output: Callable[[], ChoiceOutput],
        count_reasoning: bool,
    ) -> Response:
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
            msg = new_output().parse(texts[idx])
            if msg.reasoning:
                reasoning_tokens += len(self.tm.tokenizer.encode(msg.reasoning, add_special_tokens=False))
            reason, matched = finish_reason(meta)
            if msg.tool_calls and reason == "stop":
                reason = "tool_calls"
            out_choices.append(
                {
                    "index": idx,
                    "message": {
                        "role": "assistant", "content": msg.content, "reasoning_content": msg.reasoning,
                        "tool_calls": msg.tool_calls,
                    },
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
            "usage": usage(prompt_tokens, completion_tokens, self.cached(cached), reasoning_tokens if count_reasoning else None),
        }
        return json_response(body)

    # ---- streaming -----------------------------------------------------------------------

    async def stream(
        self, req: ChatCompletionRequest, meta_id: str, first, choices: AsyncIterator, new_output: Callable[[], ChoiceOutput]
    ) -> AsyncIterator[bytes]:
        created = now()
        model = self.state.served_model_name
        outputs: dict[int, ChoiceOutput] = {}
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
                if idx not in outputs:
                    outputs[idx] = new_output()
                for choice in self.choice_deltas(req, idx, chunk, outputs[idx]):
                    yield event(choice, running_usage())
                item = await anext_or_none(choices)
            else:
                if include_usage:
                    yield event(None, usage(prompt_tokens, sum(completion.values()), self.cached(cached)))
            yield SSE_DONE
        finally:
            await choices.aclose()

    def choice_deltas(self, req: ChatCompletionRequest, idx: int, chunk: dict, out: ChoiceOutput) -> Iterator[dict]:
        """The stream's choice objects for one output chunk of choice `idx`: its deltas, then
        the finishing one when the chunk ends the choice."""
        meta = chunk["meta_info"]
        reason, matched = finish_reason(meta)
        deltas = out.feed(chunk["text"], final=reason is not None)
        lp = self.logprob_items(meta) if req.logprobs else []
        if lp and not deltas:
            deltas = [{}]
        for k, delta in enumerate(deltas):
            # The chunk's logprobs ride on its first delta.
            lps = ({"content": lp} if k == 0 else {"content": []}) if req.logprobs else None
            yield {"index": idx, "delta": delta, "logprobs": lps, "finish_reason": None}
        if reason == "stop" and out.made_calls:
            reason = "tool_calls"
        if reason is not None:
            yield {"index": idx, "delta": {}, "logprobs": None, "finish_reason": reason, "matched_stop": matched}

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
