"""A chat reply's stream deltas as the Responses API's output-item events.

The chat endpoint already knows how a reply streams (content, a forced call's arguments as
they are generated, the calls the tool-call parser settles); the Responses stream says the
same in output items: a ``message`` item (``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``) or a ``function_call`` item (``added``,
``response.function_call_arguments.delta``..., ``.done``, ``output_item.done``), each
closed before the next opens. Every event carries its ``sequence_number``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vlite.server.responses_protocol import call_id, response_id

#: ``response.created`` and ``response.in_progress`` come first (numbers 0 and 1).
NUM_OPENING_EVENTS = 2


@dataclass
class OutputItemEvents:
    """One reply's output items: the closed ones, the open one and what it holds."""

    #: The items closed so far, as ``response.output_item.done`` sent them.
    items: list[dict[str, Any]] = field(default_factory=list)
    sequence_number: int = NUM_OPENING_EVENTS
    #: The open item (``None`` when none is), its text or arguments so far, and for a
    #: function call its chat tool-call index.
    open_item: dict[str, Any] | None = None
    open_text: list[str] = field(default_factory=list)
    open_call: int | None = None

    def event(self, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` with the next sequence number."""
        payload["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return payload

    def feed(self, delta: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of one chat delta (``content`` and/or ``tool_calls``)."""
        if delta.get("content"):
            if self.open_item is None or self.open_item["type"] != "message":
                yield from self._open_message()
            self.open_text.append(delta["content"])
            yield self.event(
                {
                    "type": "response.output_text.delta",
                    **self._where(),
                    "content_index": 0,
                    "delta": delta["content"],
                    "logprobs": [],
                }
            )
        for call in delta.get("tool_calls") or []:
            function = call["function"]
            item = self.open_item
            if item is None or item["type"] != "function_call" or call["index"] != self.open_call:
                yield from self._open_call(call)
            if function.get("arguments"):
                self.open_text.append(function["arguments"])
                yield self.event(
                    {
                        "type": "response.function_call_arguments.delta",
                        **self._where(),
                        "delta": function["arguments"],
                    }
                )

    def close(self, status: str = "completed") -> Iterator[dict[str, Any]]:
        """The open item's closing events, if one is open; ``status``: its final one."""
        item = self.open_item
        if item is None:
            return
        text = "".join(self.open_text)
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            where = {**self._where(), "content_index": 0}
            yield self.event(
                {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
            )
            yield self.event({"type": "response.content_part.done", **where, "part": part})
            item = {**item, "content": [part]}
        else:
            done = "response.function_call_arguments.done"
            yield self.event({"type": done, **self._where(), "arguments": text})
            item = {**item, "arguments": text}
        item["status"] = status
        yield self.event(
            {"type": "response.output_item.done", "output_index": len(self.items), "item": item}
        )
        self.items.append(item)
        self.open_item, self.open_text, self.open_call = None, [], None

    def _where(self) -> dict[str, Any]:
        assert self.open_item is not None
        return {"item_id": self.open_item["id"], "output_index": len(self.items)}

    def _open(self, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield from self.close()
        self.open_item = item
        yield self.event(
            {"type": "response.output_item.added", "output_index": len(self.items), "item": item}
        )

    def _open_message(self) -> Iterator[dict[str, Any]]:
        item = {
            "type": "message",
            "id": response_id("msg"),
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        yield from self._open(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        where = {**self._where(), "content_index": 0}
        yield self.event({"type": "response.content_part.added", **where, "part": part})

    def _open_call(self, call: dict[str, Any]) -> Iterator[dict[str, Any]]:
        item = {
            "type": "function_call",
            "id": response_id("fc"),
            "call_id": call_id(call.get("id")),
            "name": call["function"]["name"],
            "arguments": "",
            "status": "in_progress",
        }
        yield from self._open(item)
        self.open_call = call["index"]
