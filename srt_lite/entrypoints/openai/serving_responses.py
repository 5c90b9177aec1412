"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, and
GET /v1/responses/{id}/input_items.

A request is translated into a chat request (responses_protocol.py) and runs through the chat
machinery: template, tools, grammars, reasoning and tool-call parsers. Its parsed output
becomes output items: a `reasoning` item (reasoning models), a `message` with one
`output_text` part, and a `function_call` item per call. Stored responses (response_store.py)
hold the conversation, so a request with `previous_response_id` re-renders the same prefix and
finds it in the radix cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from srt_lite.entrypoints.errors import NotFound
from srt_lite.entrypoints.http_io import anext_or_none, json_response, read_json, sse_event
from srt_lite.entrypoints.openai.chat_output import ChoiceOutput, ParsedMessage
from srt_lite.entrypoints.openai.protocol import now
from srt_lite.entrypoints.openai.response_store import ResponseStore, StoredResponse
from srt_lite.entrypoints.openai.responses_protocol import ResponsesRequest, input_items, item_id, to_chat
from srt_lite.entrypoints.openai.serving_base import abort_error, collect_one, finish_reason
from srt_lite.entrypoints.openai.serving_chat import ChatRun, OpenAIServingChat
from srt_lite.managers.validation import RequestError

if TYPE_CHECKING:
    from srt_lite.entrypoints.server_state import ServerState


def _serving(request: Request) -> "OpenAIServingResponses":
    return request.app.state.openai_responses


async def create_response(request: Request) -> Response:
    """POST /v1/responses"""
    return await _serving(request).create(request, await read_json(request))


async def retrieve_response(request: Request) -> Response:
    """GET /v1/responses/{response_id}"""
    return json_response(_serving(request).stored(request.path_params["response_id"]).response)


async def delete_response(request: Request) -> Response:
    """DELETE /v1/responses/{response_id}"""
    rid = request.path_params["response_id"]
    serving = _serving(request)
    serving.stored(rid)
    serving.store.delete(rid)
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def list_input_items(request: Request) -> Response:
    """GET /v1/responses/{response_id}/input_items: `order` (desc by default), `limit` (1-100,
    20), `after` (an item id), as OpenAI pages them."""
    items = list(_serving(request).stored(request.path_params["response_id"]).input_items)
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise RequestError('order must be "asc" or "desc"')
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise RequestError("limit must be an integer") from None
    if not 1 <= limit <= 100:
        raise RequestError("limit must be between 1 and 100")
    if order == "desc":
        items.reverse()
    after = q.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise RequestError(f"after: no input item {after!r} in this response")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return json_response({
        "object": "list", "data": page, "has_more": len(items) > limit,
        "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
    })


class OpenAIServingResponses:
    def __init__(self, state: "ServerState", chat: OpenAIServingChat):
        self.state = state
        self.chat = chat
        args = state.tm.server_args
        self.store = ResponseStore(args.response_store_max_entries, args.response_store_max_bytes, args.response_store_ttl)

    def stored(self, rid: str, param: str | None = None) -> StoredResponse:
        record = self.store.get(rid)
        if record is None:
            raise NotFound(f"No response found with id {rid!r} (unknown, deleted, or no longer stored).", param)
        return record

    async def create(self, request: Request, body: Any) -> Response:
        req = ResponsesRequest.model_validate(body)
        history = self.stored(req.previous_response_id, "previous_response_id").messages if req.previous_response_id else []
        items = input_items(req)
        chat_req, conversation = to_chat(req, history, items)
        run = self.chat.plan(chat_req)
        turn = Turn(self, req, run, items, conversation)
        choices = self.chat.start(run, bool(req.stream))
        return await self.chat.respond(
            request, req.stream, choices, lambda first: turn.stream(first, choices), lambda: turn.collect(choices)
        )


class Turn:
    """One response being made: its request, its output items, and what is stored at the end."""

    def __init__(self, serving: OpenAIServingResponses, req: ResponsesRequest, run: ChatRun,
                 items: list[dict[str, Any]], conversation: list[dict[str, Any]]):
        self.serving = serving
        self.req = req
        self.run = run
        self.items = items
        self.conversation = conversation
        self.id = item_id("resp")
        self.created = now()
        self.output: list[dict[str, Any]] = []
        self.reasoning_text = ""

    # ---- the response object ----------------------------------------------------------------

    def response(self, status: str, meta: dict | None = None) -> dict[str, Any]:
        req, params = self.req, self.run.params
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.serving.state.served_model_name,
            "output": self.output, "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id, "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": req.store, "temperature": params.temperature, "text": {"format": fmt},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "top_p": params.top_p, "truncation": "disabled", "usage": self.usage(meta) if meta else None,
            "user": req.user, "metadata": req.metadata or {},
        }

    def usage(self, meta: dict) -> dict[str, Any]:
        tokenizer = self.serving.state.tm.tokenizer
        reasoning = len(tokenizer.encode(self.reasoning_text, add_special_tokens=False)) if self.reasoning_text else 0
        prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
        return {
            "input_tokens": prompt, "input_tokens_details": {"cached_tokens": meta["cached_tokens"]},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion,
        }

    def finish(self, meta: dict) -> dict[str, Any]:
        """The final response object; stored if the request asks for it."""
        reason, _ = finish_reason(meta)
        body = self.response("incomplete" if reason == "length" else "completed", meta)
        if self.req.store:
            self.serving.store.put(self.id, StoredResponse(body, self.conversation + [self.assistant_message()], self.items))
        return body

    def assistant_message(self) -> dict[str, Any]:
        """This turn's output as the chat message a chained request replays."""
        text = "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])
        calls = [
            {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            for item in self.output if item["type"] == "function_call"
        ]
        return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}

    # ---- whole response ---------------------------------------------------------------------

    async def collect(self, choices: AsyncIterator) -> Response:
        text, meta = await collect_one(choices)
        msg: ParsedMessage = self.run.new_output().parse(text)
        if msg.reasoning:
            self.reasoning_text = msg.reasoning
            self.output.append(reasoning_item(item_id("rs"), msg.reasoning))
        if msg.content:
            self.output.append(message_item(item_id("msg"), msg.content, "completed"))
        for call in msg.tool_calls or []:
            fn = call["function"]
            self.output.append(function_call_item(item_id("fc"), call["id"], fn["name"], fn["arguments"], "completed"))
        return json_response(self.finish(meta))

    # ---- streaming --------------------------------------------------------------------------

    async def stream(self, first, choices: AsyncIterator) -> AsyncIterator[bytes]:
        events = EventWriter()
        out: ChoiceOutput = self.run.new_output()
        try:
            yield events.emit("response.created", response=self.response("in_progress"))
            yield events.emit("response.in_progress", response=self.response("in_progress"))
            item = first
            meta: dict = {}
            while item is not None:
                _, chunk = item
                meta = chunk["meta_info"]
                err = abort_error(meta)
                if err:
                    yield events.emit("error", code="invalid_request_error", message=err, param=None)
                    return
                reason, _ = finish_reason(meta)
                for delta in out.feed(chunk["text"], final=reason is not None):
                    for event in self.delta_events(events, delta):
                        yield event
                item = await anext_or_none(choices)
            for event in self.close_item(events):
                yield event
            body = self.finish(meta)
            yield events.emit("response.incomplete" if body["status"] == "incomplete" else "response.completed", response=body)
        finally:
            await choices.aclose()

    def delta_events(self, events: "EventWriter", delta: dict[str, Any]) -> list[bytes]:
        """Events for one chat delta of ChoiceOutput.feed: reasoning text, answer text, a new
        tool call, or a call's argument fragment. A change of kind closes the open item."""
        out: list[bytes] = []
        if delta.get("reasoning_content"):
            out += self.open_item(events, "reasoning")
            self.reasoning_text += delta["reasoning_content"]
            self.output[-1]["content"][0]["text"] += delta["reasoning_content"]
            out.append(events.emit("response.reasoning_text.delta", **self.at(), content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content"):
            out += self.open_item(events, "message")
            self.output[-1]["content"][0]["text"] += delta["content"]
            out.append(events.emit("response.output_text.delta", **self.at(), content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                out += self.close_item(events)
                item = function_call_item(item_id("fc"), call["id"], call["function"]["name"], "", "in_progress")
                self.output.append(item)
                out.append(events.emit("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
            fragment = call["function"].get("arguments")
            if fragment:
                self.output[-1]["arguments"] += fragment
                out.append(events.emit("response.function_call_arguments.delta", **self.at(), delta=fragment))
        return out

    def at(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def open_item(self, events: "EventWriter", kind: str) -> list[bytes]:
        """Makes the last output item a `kind` item in progress (closing another kind)."""
        last = self.output[-1] if self.output else None
        if last is not None and last["type"] == kind and last["status"] == "in_progress":
            return []
        out = self.close_item(events)
        if kind == "reasoning":
            item, part = reasoning_item(item_id("rs"), ""), {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(item_id("msg"), "", "in_progress"), {"type": "output_text", "text": "", "annotations": []}
        item["status"] = "in_progress"
        self.output.append(item)
        added = {**item, "content": []}
        out.append(events.emit("response.output_item.added", output_index=len(self.output) - 1, item=added))
        out.append(events.emit("response.content_part.added", **self.at(), content_index=0, part=part))
        return out

    def close_item(self, events: "EventWriter") -> list[bytes]:
        """The done events of the item in progress, if any."""
        last = self.output[-1] if self.output else None
        if last is None or last["status"] != "in_progress":
            return []
        last["status"] = "completed"
        out = []
        if last["type"] == "function_call":
            out.append(events.emit("response.function_call_arguments.done", **self.at(), name=last["name"], arguments=last["arguments"]))
        else:
            part = last["content"][0]
            if last["type"] == "reasoning":
                out.append(events.emit("response.reasoning_text.done", **self.at(), content_index=0, text=part["text"]))
            else:
                out.append(events.emit("response.output_text.done", **self.at(), content_index=0, text=part["text"], logprobs=[]))
            out.append(events.emit("response.content_part.done", **self.at(), content_index=0, part=dict(part)))
        out.append(events.emit("response.output_item.done", output_index=len(self.output) - 1, item=last))
        return out


class EventWriter:
    """Numbers a stream's events (`sequence_number`, from 0) and writes them as SSE."""

    def __init__(self) -> None:
        self.seq = 0

    def emit(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(kind, body)


def reasoning_item(iid: str, text: str) -> dict[str, Any]:
    return {"id": iid, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def message_item(iid: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": iid, "type": "message", "role": "assistant", "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def function_call_item(iid: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": iid, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": status}
