"""The Responses API's store: responses kept for GET /v1/responses/{id} and for chaining with
`previous_response_id`.

Bounded three ways (ServerArgs): a number of responses, the bytes of their JSON, and a time
to live. The oldest go first when a bound is reached; an expired or evicted id is simply
unknown (404). A record keeps the response as returned, the conversation it ends (chat
messages, its own instructions left out: OpenAI does not carry them to the next turn) and
its input items.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as returned
    messages: list[dict[str, Any]]  # the conversation up to and including this response's output
    input_items: list[dict[str, Any]]  # this request's own input, each item with an id
    size: int = 0  # bytes of the above as JSON
    stored_at: float = 0.0


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, record: StoredResponse) -> None:
        record.size = len(orjson.dumps([record.response, record.messages, record.input_items]))
        record.stored_at = time.monotonic()
        self.delete(rid)
        if record.size > self.max_bytes or self.max_entries == 0:
            return  # it could never fit: kept nowhere, like an evicted one
        self._items[rid] = record
        self.bytes += record.size
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            self.delete(next(iter(self._items)))

    def get(self, rid: str) -> StoredResponse | None:
        self._expire()
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        record = self._items.pop(rid, None)
        if record is None:
            return False
        self.bytes -= record.size
        return True

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        while self._items:
            rid, oldest = next(iter(self._items.items()))
            if oldest.stored_at >= cutoff:
                break
            self.delete(rid)
