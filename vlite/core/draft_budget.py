"""How many drafts each request verifies: the count that yields the most tokens a second.

A step that verifies ``d`` drafts computes ``d`` more tokens and yields one more token per
draft kept. Whether that pays depends on the host (what a token more costs a step), on the
batch (beside many decodes a token more costs about what a decode does) and on each
request's work (copying its input, drafts are kept; writing freely, they are not).
:class:`DraftBudget` measures both as the engine runs and trims each proposal to what pays:

* **a step's cost** by the decode tokens it computes: a
  :class:`~vlite.core.step_cost.StepCostModel` of the decode-only steps run, interpolated
  between the sizes seen (``c(T)``);
* **each request's acceptance**: the chance ``p`` that a draft is kept when the drafts
  before it were, as kept / (kept + rejections) over its recent verifications (a
  rejection ends a run, so a step counts at most one), starting from a prior of
  :data:`PRIOR_KEPT` / (:data:`PRIOR_KEPT` + :data:`PRIOR_REJECTED`) and weighting older
  evidence by :data:`DECAY` per verification. The ``i``-th draft is then kept with
  probability ``p ** i``.

With ``n`` decodes in the step, drafts are taken greedily by their expected yield
``p_r ** i`` (a request's first drafts before its later ones), keeping the count that
maximizes ``(n + expected kept drafts) / c(n + drafts)``: beside one decode a draft kept
two times in three pays; beside thirty it must be kept almost surely.

A request given no drafts still has its proposal's first token compared with the token it
then gets (a *shadow* draft: the proposer ran anyway, and the check costs nothing), so its
acceptance follows its work while it decodes one token a step, and drafting resumes as
soon as it would pay. Before any decode-only step is measured every proposal is taken
whole, which measures one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from vlite.core.outputs import EngineCoreOutput
from vlite.core.step_cost import StepCostModel

#: Prior evidence of a request without verifications: ``p = 0.6``.
PRIOR_KEPT, PRIOR_REJECTED = 1.5, 1.0
#: Weight of a request's older evidence, per verification.
DECAY = 0.8


@dataclass
class Acceptance:
    """One request's evidence of kept drafts and rejections (decayed)."""

    kept: float = PRIOR_KEPT
    rejected: float = PRIOR_REJECTED

    def observe(self, num_drafts: int, num_kept: int) -> None:
        """A verification of ``num_drafts`` drafts kept ``num_kept`` of them."""
        self.kept = DECAY * self.kept + num_kept
        self.rejected = DECAY * self.rejected + (num_kept < num_drafts)

    @property
    def rate(self) -> float:
        """The chance a draft is kept when the drafts before it were."""
        return self.kept / (self.kept + self.rejected)


class DraftBudget:
    """Trims proposals to the drafts that pay; learns from each step.

    Args:
        costs: the model of decode-step costs it reads and feeds (default: its own).
    """

    def __init__(self, costs: StepCostModel | None = None) -> None:
        self.costs = costs if costs is not None else StepCostModel()
        self.acceptance: dict[str, Acceptance] = {}
        #: Request id -> the first draft proposed for it that it was not given.
        self._shadows: dict[str, int] = {}

    def observe_step(self, num_decode_tokens: int, seconds: float) -> None:
        """A decode-only step of ``num_decode_tokens`` tokens took ``seconds``."""
        self.costs.observe(num_decode_tokens, 0, seconds)

    def observe_outputs(
        self, verified: dict[str, list[int]], outputs: Iterable[EngineCoreOutput]
    ) -> None:
        """What a step's requests got: ``verified`` maps a request to the drafts it verified
        in the step; a request's new tokens are the drafts kept and one token more. A
        request that finished drafts no more: it is not counted."""
        shadows, self._shadows = self._shadows, {}
        for output in outputs:
            drafts = verified.get(output.request_id)
            shadow = shadows.get(output.request_id)
            if output.is_finished or not output.new_token_ids or (not drafts and shadow is None):
                continue
            acceptance = self.acceptance.setdefault(output.request_id, Acceptance())
            if drafts:
                acceptance.observe(len(drafts), min(len(output.new_token_ids) - 1, len(drafts)))
            else:
                acceptance.observe(1, int(output.new_token_ids[0] == shadow))

    def choose(self, proposals: dict[str, list[int]], num_decodes: int) -> dict[str, list[int]]:
        """``proposals`` (request id -> drafts), each cut to the drafts that pay in a step of
        ``num_decodes`` decodes (``>= len(proposals)``); the rest become shadow drafts."""
        gains = sorted(
            (
                (self._rate(request_id) ** position, request_id)
                for request_id, drafts in proposals.items()
                for position in range(1, len(drafts) + 1)
            ),
            key=lambda gain: -gain[0],
        )
        taken = self._drafts_that_pay([gain for gain, _ in gains], num_decodes)
        counts = Counter(request_id for _, request_id in gains[:taken])
        chosen = {}
        for request_id, drafts in proposals.items():
            chosen[request_id] = drafts[: counts[request_id]]
            if drafts and not counts[request_id]:
                self._shadows[request_id] = drafts[0]
        return chosen

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that ended."""
        for request_id in request_ids:
            self.acceptance.pop(request_id, None)
            self._shadows.pop(request_id, None)

    def _rate(self, request_id: str) -> float:
        acceptance = self.acceptance.get(request_id)
        return (acceptance or Acceptance()).rate

    def _drafts_that_pay(self, gains: list[float], num_decodes: int) -> int:
        """How many of ``gains`` (expected kept tokens, best first) to verify beside
        ``num_decodes`` decodes: the count with the most expected tokens a second."""
        base_seconds = self.costs.estimated_decode_seconds(num_decodes)
        if base_seconds is None:
            return len(gains)  # nothing measured yet: try, and measure
        best_rate, best_count = num_decodes / base_seconds, 0
        tokens = float(num_decodes)
        for count, gain in enumerate(gains, 1):
            tokens += gain
            rate = tokens / self.costs.estimated_decode_seconds(num_decodes + count)
            if rate > best_rate:
                best_rate, best_count = rate, count
        return best_count
