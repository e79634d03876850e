"""Stored responses of /v1/responses: what `GET /v1/responses/{id}` returns and `previous_response_id` continues.

Each entry keeps the response object and the conversation it ended (the chat messages of its input,
earlier responses' included, and its own answer; without its `instructions`, which OpenAI does not
carry over to a follow-up). A follow-up's conversation reuses the message objects of the one it
continues, so a chain of N turns holds each message once; an entry is charged for the messages it
added and the response's JSON. The store is bounded by count and by those bytes: the least recently
used entries go first. It is used from the event loop only (no lock).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

MAX_RESPONSES = 1024
MAX_BYTES = 256 << 20


@dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    nbytes: int
    #: the request's own input, as `input_items` lists it (ids, status, content parts)
    input_items: list[dict[str, Any]] = field(default_factory=list)


class ResponseStore:
    def __init__(self, max_responses: int | None = None, max_bytes: int | None = None):
        self.max_responses = MAX_RESPONSES if max_responses is None else max_responses
        self.max_bytes = MAX_BYTES if max_bytes is None else max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        #: item id -> (the response that holds it, the item): its input and output items, which a
        #: later request may name by an `item_reference` (the newest holder of an id wins)
        self._items: dict[str, tuple[str, dict[str, Any]]] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, rid: str) -> StoredResponse | None:
        e = self._entries.get(rid)
        if e is not None:
            self._entries.move_to_end(rid)
        return e

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]], new_messages: list[dict[str, Any]],
            response_size: int | None = None, input_items: list[dict[str, Any]] | None = None) -> None:
        """Keep `response` (its "id" is the key) and its conversation, of which `new_messages` are
        the ones no earlier entry holds; `response_size`: its JSON's length, when the caller has it
        (it repeats the request's tools: a dump of 100 us for an agent's); `input_items`: the
        request's input as `input_items` lists it back."""
        if response_size is None:
            response_size = len(json.dumps(response, default=str))
        size = response_size + len(json.dumps(new_messages, default=str)) + \
            (len(json.dumps(input_items, default=str)) if input_items else 0)
        self.delete(response["id"])
        e = self._entries[response["id"]] = StoredResponse(response, conversation, size, input_items or [])
        for item in self._items_of(e):
            self._items[item["id"]] = (response["id"], item)
        self.nbytes += size
        while self._entries and (len(self._entries) > self.max_responses or self.nbytes > self.max_bytes):
            self.delete(next(iter(self._entries)))

    def delete(self, rid: str) -> bool:
        e = self._entries.pop(rid, None)
        if e is None:
            return False
        self.nbytes -= e.nbytes
        for item in self._items_of(e):
            if self._items.get(item["id"], ("",))[0] == rid:
                del self._items[item["id"]]
        return True

    def item(self, item_id: str) -> dict[str, Any] | None:
        """A stored response's input or output item by its id (an `item_reference`'s target)."""
        held = self._items.get(item_id)
        return held[1] if held is not None else None

    @staticmethod
    def _items_of(e: StoredResponse) -> list[dict[str, Any]]:
        return [i for i in e.input_items + list(e.response.get("output") or []) if isinstance(i.get("id"), str)]
