"""``--reasoning-parser``: the configured reasoning parser splits a chat reply into its
reasoning (``reasoning_content``) and its answer (``content``, and the only text a tool-call
parser reads), streamed or not through the same :class:`ReasoningSplit`.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlite.core.plugins import PluginRegistry
from vlite.core.reasoning_parser import ReasoningDelta, ReasoningParser, ReasoningParserEvent
from vlite.server.flag_plugins import plugin_named_by_flag

#: The ``vlite serve`` flag that names the parser.
FLAG = "--reasoning-parser"


def reasoning_parser_class(
    name: str, registry: PluginRegistry | None = None
) -> type[ReasoningParser]:
    """The reasoning parser registered as ``name`` (see :func:`plugin_named_by_flag`)."""
    return plugin_named_by_flag("reasoning_parser", FLAG, name, registry)


@dataclass
class ReasoningSplit:
    """One choice's parser; without one (no ``--reasoning-parser``) all text is answer."""

    parser: ReasoningParser | None

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, answer)`` that the reply's next ``text`` settles (the reasoning
        comes first: a parser gives no reasoning once the answer began)."""
        if self.parser is None:
            return "", text
        return _split(self.parser.feed(text))

    def finish(self) -> tuple[str, str]:
        """``(reasoning, answer)`` of what the parser held, at the reply's end."""
        if self.parser is None:
            return "", ""
        return _split(self.parser.finish())

    def whole(self, text: str) -> tuple[str, str]:
        """A whole reply's ``(reasoning, answer)``, through the same path as a stream."""
        reasoning, answer = self.feed(text)
        more_reasoning, more_answer = self.finish()
        return reasoning + more_reasoning, answer + more_answer


def _split(events: list[ReasoningParserEvent]) -> tuple[str, str]:
    reasoning = "".join(event.text for event in events if isinstance(event, ReasoningDelta))
    answer = "".join(event.text for event in events if not isinstance(event, ReasoningDelta))
    return reasoning, answer


def new_split(parser_cls: type[ReasoningParser] | None) -> ReasoningSplit:
    """A split for one choice of a reply (``parser_cls`` ``None``: no reasoning)."""
    return ReasoningSplit(parser_cls() if parser_cls is not None else None)
