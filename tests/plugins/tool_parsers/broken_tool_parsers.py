"""Deliberately broken tool parsers: ToolParserConformance must fail on each.

Each is a small change to the built-in ``hermes`` parser, of the kind a parser author could
make by mistake. ``test_tool_parser_suite_catches_bugs.py`` runs the suite on them.
"""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.core.tool_parser import ContentDelta, ToolCallStart
from vlite.plugins.tool_parsers import hermes
from vlite.plugins.tool_parsers.hermes import HermesToolParser


class LeaksSplitMarkersParser(HermesToolParser):
    """Looks for ``<tool_call>`` only in each delta as it comes: a marker split across two
    deltas is sent as content, and so is the call after it."""

    def _content_step(self):
        start = self._held.find(hermes.OPEN)
        if start >= 0:
            return super()._content_step()
        content, self._held = self._held, ""
        return [ContentDelta(content)] if content else None


class DropsContentAfterCallsParser(HermesToolParser):
    """Stops sending content once a call was read (it forgets the text after the last
    ``</tool_call>``)."""

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self._called = False

    def feed(self, delta_text):
        return self._drop_after_calls(super().feed(delta_text))

    def finish(self):
        return self._drop_after_calls(super().finish())

    def _drop_after_calls(self, events):
        kept = []
        for event in events:
            self._called = self._called or isinstance(event, ToolCallStart)
            if not (self._called and isinstance(event, ContentDelta)):
                kept.append(event)
        return kept


@hookimpl
def register_tool_parsers(register):
    register("leaks-split-markers", LeaksSplitMarkersParser)
    register("drops-content-after-calls", DropsContentAfterCallsParser)
