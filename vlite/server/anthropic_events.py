"""A chat reply's stream deltas as Anthropic's content-block events.

The chat endpoint already knows how a reply streams (content, a forced call's arguments
as they are generated, the calls the tool-call parser settles); Anthropic's stream says
the same in blocks: ``content_block_start`` opens a ``text`` or ``tool_use`` block,
``content_block_delta`` carries its ``text_delta`` or ``input_json_delta``, and
``content_block_stop`` closes it before the next one opens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vlite.server.anthropic_protocol import anthropic_id


@dataclass
class ContentBlockEvents:
    """One reply's blocks: which one is open, and how many came before it."""

    num_blocks: int = 0
    #: ``"text"``, ``"tool_use"`` or ``None`` when no block is open.
    open_type: str | None = None
    #: The chat tool-call index of the open ``tool_use`` block.
    open_call: int | None = None

    def feed(self, delta: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of one chat delta (``content`` and/or ``tool_calls``)."""
        if delta.get("content"):
            if self.open_type != "text":
                yield from self._open({"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            function = call["function"]
            if self.open_type != "tool_use" or call["index"] != self.open_call:
                block = {
                    "type": "tool_use",
                    "id": anthropic_id("toolu"),
                    "name": function["name"],
                    "input": {},
                }
                yield from self._open(block, call["index"])
            if function.get("arguments"):
                yield self._delta(
                    {"type": "input_json_delta", "partial_json": function["arguments"]}
                )

    def close(self) -> Iterator[dict[str, Any]]:
        """The open block's ``content_block_stop``, if one is open."""
        if self.open_type is not None:
            yield {"type": "content_block_stop", "index": self.num_blocks - 1}
        self.open_type = self.open_call = None

    def _open(self, block: dict[str, Any], call: int | None = None) -> Iterator[dict[str, Any]]:
        yield from self.close()
        yield {"type": "content_block_start", "index": self.num_blocks, "content_block": block}
        self.num_blocks += 1
        self.open_type, self.open_call = block["type"], call

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.num_blocks - 1, "delta": delta}
