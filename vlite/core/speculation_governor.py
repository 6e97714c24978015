"""Speculation only where it pays: drafts stop while steps that verify them yield fewer
tokens per second than steps that do not.

A step that verifies ``k`` drafts computes ``k`` more tokens per request and yields one more
token per accepted draft: whether that is faster depends on the host (how much more a
product of ``k + 1`` rows costs than one of a single row) and on the work (how many drafts
are right). :class:`SpeculationGovernor` measures both as they happen: the seconds per
yielded token of decode steps with drafts and without (exponential moving averages; steps
that compute prompt tokens are left out), and pauses drafting for ``pause_steps`` steps when
the steps with drafts are the slower, then tries again (the work may have changed).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculationGovernor:
    """Decides, step by step, whether requests get drafts.

    Attributes:
        pause_steps: steps without drafts after speculation measured slower.
        smoothing: weight of the newest step in the moving averages.
    """

    pause_steps: int = 32
    smoothing: float = 0.25
    #: Seconds per yielded token of decode steps with drafts, and without (``None``: none yet).
    with_drafts: float | None = None
    without_drafts: float | None = None
    #: Steps left before drafting is tried again.
    paused_for: int = 0

    def record(self, seconds: float, num_tokens: int, had_drafts: bool) -> None:
        """A decode step took ``seconds`` and yielded ``num_tokens`` tokens."""
        if num_tokens <= 0:
            return
        per_token = seconds / num_tokens
        if had_drafts:
            self.with_drafts = self._average(self.with_drafts, per_token)
        else:
            self.without_drafts = self._average(self.without_drafts, per_token)
        if self.paused_for:
            self.paused_for -= 1
        elif had_drafts and self._drafts_are_slower():
            self.paused_for = self.pause_steps
            self.with_drafts = None  # measured afresh when drafting resumes

    def allows_drafts(self) -> bool:
        return self.paused_for == 0

    def _drafts_are_slower(self) -> bool:
        if self.with_drafts is None or self.without_drafts is None:
            return False
        return self.with_drafts > self.without_drafts

    def _average(self, average: float | None, value: float) -> float:
        if average is None:
            return value
        return (1 - self.smoothing) * average + self.smoothing * value
