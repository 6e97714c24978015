"""Speculation only where it pays: drafts stop while steps that verify them yield fewer
tokens per second than steps that do not.

A step that verifies ``k`` drafts computes ``k`` more tokens per request and yields one more
token per accepted draft: whether that is faster depends on the host (how much more a
product of ``k + 1`` rows costs than one of a single row), on the proposer (a draft model's
forwards) and on the work (how many drafts are right). :class:`SpeculationGovernor` measures
both as they happen: the seconds per yielded token of decode steps with drafts and without
(exponential moving averages; steps that compute prompt tokens are left out), and pauses
drafting for ``pause_steps`` steps when the steps with drafts are the slower, then tries
again (the work may have changed); each time in a row it measures them slower again, the
pause doubles (up to ``max_pause_steps``).

A proposer that drafts at every step (a draft model) leaves no step without drafts to
compare with: after ``probe_every`` steps with drafts since the last step without, drafting
pauses for ``probe_steps`` steps to measure them (the first probe comes after
``probe_every // 8`` steps, so a slow draft is caught early).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculationGovernor:
    """Decides, step by step, whether requests get drafts.

    Attributes:
        pause_steps: steps without drafts after speculation measured slower.
        max_pause_steps: the longest pause, after several slower measures in a row.
        smoothing: weight of the newest step in the moving averages.
        probe_every: steps with drafts after which a few steps go without, to measure them.
        probe_steps: how many steps a probe lasts.
    """

    pause_steps: int = 32
    max_pause_steps: int = 512
    smoothing: float = 0.25
    probe_every: int = 64
    probe_steps: int = 3
    #: Seconds per yielded token of decode steps with drafts, and without (``None``: none yet).
    with_drafts: float | None = None
    without_drafts: float | None = None
    #: Steps left before drafting is tried again.
    paused_for: int = 0
    #: Steps with drafts since the last step without.
    steps_since_plain: int = 0
    #: The next pause, if speculation measures slower again.
    next_pause: int = 0

    def record(self, seconds: float, num_tokens: int, had_drafts: bool) -> None:
        """A decode step took ``seconds`` and yielded ``num_tokens`` tokens."""
        if num_tokens <= 0:
            return
        per_token = seconds / num_tokens
        if had_drafts:
            self.with_drafts = self._average(self.with_drafts, per_token)
            self.steps_since_plain += 1
        else:
            self.without_drafts = self._average(self.without_drafts, per_token)
            self.steps_since_plain = 0
        if self.paused_for:
            self.paused_for -= 1
        elif had_drafts and self._drafts_are_slower():
            self.paused_for = max(self.next_pause, self.pause_steps)
            self.next_pause = min(2 * self.paused_for, self.max_pause_steps)
            self.with_drafts = None  # measured afresh when drafting resumes
        elif had_drafts and self.steps_since_plain >= self._steps_before_probe():
            self.paused_for = self.probe_steps
            self.next_pause = 0  # it measured faster through a whole stretch

    def allows_drafts(self) -> bool:
        return self.paused_for == 0

    def _steps_before_probe(self) -> int:
        if self.without_drafts is None:
            return max(self.probe_every // 8, 1)
        return self.probe_every

    def _drafts_are_slower(self) -> bool:
        if self.with_drafts is None or self.without_drafts is None:
            return False
        return self.with_drafts > self.without_drafts

    def _average(self, average: float | None, value: float) -> float:
        if average is None:
            return value
        return (1 - self.smoothing) * average + self.smoothing * value
