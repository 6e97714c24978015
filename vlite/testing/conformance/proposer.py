"""ProposerConformance: drafts of the right form, for the requests asked, within their
``max_drafts``, the same for the same requests whatever else is in the batch.

The suite builds the proposer as the engine does, ``cls(SpeculativeConfig(...))`` (the
fields in :attr:`ProposerConformance.speculative_config` over the defaults, ``method`` the
plugin's name), and asks it for drafts on a fixed set of contexts (:func:`draft_cases`):
ones that repeat a run of tokens, copy a run of the prompt, continue one n-gram two ways,
hold no repetition at all, are one or two tokens long, or end with tokens only another
request of the batch holds. Nothing is required of the drafts' quality except that some
request gets some (else the other checks would prove nothing); everything is required of
their form.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest

from vlite.core.proposer import DraftRequest, Proposer, SpeculativeConfig
from vlite.testing.conformance.base import PluginConformance

#: What an absent capability flag means.
PROPOSER_CAPABILITY_DEFAULTS: dict[str, bool] = {
    "is_deterministic": True,
    "learns_across_requests": False,
}


@dataclass(frozen=True)
class DraftCase:
    """A context the suite asks drafts for.

    Attributes:
        name: what it is, and its request id.
        token_ids: prompt then output.
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        max_drafts: the most drafts it may take.
    """

    name: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    max_drafts: int

    def request(self, request_id: str | None = None, max_drafts: int | None = None) -> DraftRequest:
        """A :class:`DraftRequest` for it (its tokens in a new list), under another id or
        ``max_drafts`` if given."""
        return DraftRequest(
            request_id if request_id is not None else self.name,
            list(self.token_ids),
            self.num_prompt_tokens,
            max_drafts if max_drafts is not None else self.max_drafts,
        )


def draft_cases(vocab_size: int, num_speculative_tokens: int, seed: int = 0) -> list[DraftCase]:
    """The suite's contexts: token ids below ``vocab_size``, ``max_drafts`` from 1 to
    ``num_speculative_tokens``."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.choice(vocab_size, size=n, replace=False)]

    k = num_speculative_tokens
    motif = tokens(7)
    repeats = motif * 5 + motif[:3]
    prompt = tokens(48)
    a, b, c, d, e, f, g = tokens(7)
    forked = [a, b, c, d, g, a, b, e, f, g, a, b]  # "a b" continues two ways
    echo = tokens(25)
    source = tokens(30) + echo[-3:] + tokens(6)  # the only other place echo's end occurs
    return [
        DraftCase("repeats", tuple(repeats), 20, k),
        DraftCase("repeats-one-draft", tuple(repeats), 20, 1),
        DraftCase("copies-the-prompt", tuple(prompt + prompt[10:22]), 48, k),
        DraftCase("forked", tuple(forked), 6, min(2, k)),
        DraftCase("prompt-only", tuple(motif * 3), 21, k),
        DraftCase("no-repetition", tuple(tokens(40)), 30, k),
        DraftCase("one-token", (vocab_size - 1,), 1, k),
        DraftCase("two-tokens", (3, 3), 1, k),
        DraftCase("ends-like-another", tuple(echo), 20, k),
        DraftCase("holds-the-others-end", tuple(source), 30, k),
    ]


def present(drafts: dict[str, list[int]]) -> dict[str, list[int]]:
    """``drafts`` without the empty entries (an empty list means no drafts, as absence does),
    its values as plain lists."""
    return {request_id: list(draft) for request_id, draft in drafts.items() if len(draft)}


class ProposerConformance(PluginConformance):
    """Conformance suite for ``register_proposers`` plugins.

    Capability flags (class attributes of the proposer): ``is_deterministic`` (the same
    requests get the same drafts; unset means ``True``) and ``learns_across_requests``
    (drafts may depend on requests seen before, finished or in the same batch; unset means
    ``False``: then the suite asks one instance everything, else a fresh instance for each
    comparison).

    Attributes:
        speculative_config: ``SpeculativeConfig`` fields over the defaults (``method``
            defaults to the plugin's name).
        vocab_size: every token id the suite gives is below it; every draft must be too.
        long_context_len: the length of the long context that must be answered.
        seed: the seed of the suite's contexts.
    """

    plugin_kind = "proposer"
    speculative_config: ClassVar[dict[str, Any]] = {}
    vocab_size: ClassVar[int] = 1000
    long_context_len: ClassVar[int] = 8192
    seed: ClassVar[int] = 0
    is_deterministic: ClassVar[bool | None] = None
    learns_across_requests: ClassVar[bool | None] = None
    capability_defaults: ClassVar[dict[str, bool]] = PROPOSER_CAPABILITY_DEFAULTS

    def check_interface(self, plugin_cls: Any) -> None:
        assert inspect.isclass(plugin_cls) and issubclass(plugin_cls, Proposer)
        assert not inspect.isabstract(plugin_cls), f"{plugin_cls!r} leaves propose() abstract"

    @pytest.fixture(scope="class")
    @classmethod
    def config(cls, conformance_plugin_name) -> SpeculativeConfig:
        return SpeculativeConfig(**{"method": conformance_plugin_name, **cls.speculative_config})

    @pytest.fixture(scope="class")
    @classmethod
    def cases(cls, config) -> list[DraftCase]:
        return draft_cases(cls.vocab_size, config.num_speculative_tokens, cls.seed)

    @pytest.fixture
    def new_proposer(self, plugin_cls, config):
        """``new_proposer()``: a fresh instance, as the engine builds it."""

        def new() -> Proposer:
            return plugin_cls(config)

        return new

    # ---- asking ----------------------------------------------------------------------

    def propose(self, proposer: Proposer, requests: Sequence[DraftRequest]) -> dict:
        """``proposer.propose(requests)``, checked for its form."""
        drafts = proposer.propose(requests)
        self.check_form(drafts, requests)
        return drafts

    def check_form(self, drafts: Any, requests: Sequence[DraftRequest]) -> None:
        """A dict from ids of ``requests`` to lists of Python ints in the vocabulary."""
        assert isinstance(drafts, dict), f"propose() returned {type(drafts).__name__}"
        for request_id, draft in drafts.items():
            assert isinstance(draft, list), (
                f"the drafts of {request_id!r} are a {type(draft).__name__}, not a list"
            )
            wrong = [t for t in draft if type(t) is not int]
            assert not wrong, (
                f"the drafts of {request_id!r} hold {type(wrong[0]).__name__} values "
                f"{wrong[:4]}: token ids must be Python ints"
            )
            outside = [t for t in draft if not 0 <= t < self.vocab_size]
            assert not outside, (
                f"the drafts of {request_id!r} hold token ids {outside[:4]} outside the "
                f"vocabulary [0, {self.vocab_size})"
            )

    def check_max_drafts(self, drafts: dict, requests: Sequence[DraftRequest]) -> None:
        by_id = {request.request_id: request for request in requests}
        for request_id, draft in drafts.items():
            if request_id in by_id:
                assert len(draft) <= by_id[request_id].max_drafts, (
                    f"{request_id!r} got {len(draft)} drafts {list(draft)}, more than its "
                    f"max_drafts={by_id[request_id].max_drafts}"
                )

    def check_only_asked(self, drafts: dict, requests: Sequence[DraftRequest]) -> None:
        asked = {request.request_id for request in requests}
        extra = sorted(set(drafts) - asked, key=str)
        assert not extra, f"propose() answered ids {extra[:6]} it was not asked about ({asked})"

    def fresh_for_each(self, plugin_cls: Any) -> bool:
        """Whether comparisons need a fresh instance each (a proposer that learns)."""
        return self.claims(plugin_cls, "learns_across_requests")

    # ---- form --------------------------------------------------------------------------

    def test_no_requests_give_no_drafts(self, new_proposer) -> None:
        drafts = new_proposer().propose([])
        assert drafts == {} and isinstance(drafts, dict), f"propose([]) returned {drafts!r}"

    def test_drafts_are_lists_of_python_ints_in_the_vocabulary(self, new_proposer, cases):
        proposer = new_proposer()
        self.propose(proposer, [case.request() for case in cases])
        for case in cases:
            self.propose(proposer, [case.request(f"alone-{case.name}")])

    def test_no_request_gets_more_than_its_max_drafts(self, new_proposer, cases, config):
        proposer = new_proposer()
        for max_drafts in range(1, config.num_speculative_tokens + 1):
            requests = [case.request(f"{case.name}-{max_drafts}", max_drafts) for case in cases]
            self.check_max_drafts(proposer.propose(requests), requests)
        requests = [case.request() for case in cases]  # their own, from 1 to k
        self.check_max_drafts(proposer.propose(requests), requests)

    def test_only_the_requests_asked_get_drafts(self, new_proposer, cases) -> None:
        """Ids asked about before, and ids of no request, get no answer."""
        proposer = new_proposer()
        everyone = [case.request() for case in cases]
        for requests in (everyone, everyone[::2], everyone[1::2], everyone[:1], everyone[::3]):
            self.check_only_asked(proposer.propose(requests), requests)

    def test_some_request_gets_drafts(self, new_proposer, cases) -> None:
        """Some context gets drafts (else the checks of their form prove nothing); a
        proposer that learns may need the requests to finish first."""
        proposer = new_proposer()
        requests = [case.request() for case in cases]
        if present(proposer.propose(requests)):
            return
        proposer.finish_requests([request.request_id for request in requests])
        again = [case.request(f"again-{case.name}") for case in cases]
        assert present(proposer.propose(again)), (
            "no context got a draft, even after the same contexts had finished: the suite's "
            f"contexts ({', '.join(case.name for case in cases)}) include runs that repeat"
        )

    def test_token_ids_are_left_as_given(self, new_proposer, cases) -> None:
        requests = [case.request() for case in cases]
        new_proposer().propose(requests)
        for case, request in zip(cases, requests, strict=True):
            assert list(request.token_ids) == list(case.token_ids), (
                f"propose() changed the token_ids of {case.name!r} (they are read-only)"
            )

    def test_a_long_context_is_answered(self, new_proposer, config) -> None:
        rng = np.random.default_rng(self.seed + 1)
        tokens = rng.integers(0, self.vocab_size, self.long_context_len).tolist()
        tokens[-40:] = tokens[1000:1040]  # a copied run, as an edit of a long file has
        k = config.num_speculative_tokens
        requests = [
            DraftRequest("long", tokens, self.long_context_len // 2, k),
            DraftRequest("long-one-draft", list(tokens), self.long_context_len - 1, 1),
        ]
        drafts = self.propose(new_proposer(), requests)
        self.check_only_asked(drafts, requests)
        self.check_max_drafts(drafts, requests)

    # ---- the same requests, the same drafts --------------------------------------------

    def test_the_same_requests_give_the_same_drafts(self, new_proposer, cases, plugin_cls):
        self.require(plugin_cls, "is_deterministic")
        fresh = self.fresh_for_each(plugin_cls)
        proposer = new_proposer()
        first = present(self.propose(proposer, [case.request() for case in cases]))
        for attempt in range(2):
            asked = new_proposer() if fresh else proposer
            again = present(self.propose(asked, [case.request() for case in cases]))
            assert again == first, (
                f"the same requests got other drafts (asked again, {attempt + 1}): "
                f"{self.diff(first, again)}"
            )

    @pytest.mark.parametrize("order", ["as-listed", "reversed", "rotated", "interleaved"])
    def test_a_requests_drafts_do_not_depend_on_the_batch(
        self, new_proposer, cases, plugin_cls, order
    ) -> None:
        """Each request's drafts alone equal its drafts in the batch, in any order."""
        self.require(plugin_cls, "is_deterministic")
        fresh = self.fresh_for_each(plugin_cls)
        proposer = new_proposer()
        alone: dict[str, list[int]] = {}
        for case in cases:
            asked = new_proposer() if fresh else proposer
            alone.update(present(self.propose(asked, [case.request()])))
        batch = [case.request() for case in cases]
        if order == "reversed":
            batch.reverse()
        elif order == "rotated":
            batch = batch[3:] + batch[:3]
        elif order == "interleaved":
            batch = batch[::2] + batch[1::2]
        in_batch = present(self.propose(new_proposer() if fresh else proposer, batch))
        assert in_batch == alone, (
            f"drafts in a batch ({order}) differ from each request's drafts alone: "
            f"{self.diff(alone, in_batch)}"
        )

    # ---- finishing -----------------------------------------------------------------------

    def test_finishing_unknown_or_finished_requests_is_harmless(
        self, new_proposer, cases, plugin_cls
    ) -> None:
        proposer = new_proposer()
        requests = [case.request() for case in cases]
        proposer.propose(requests)
        proposer.finish_requests([])
        proposer.finish_requests(["never-asked-about"])
        ids = [request.request_id for request in requests]
        proposer.finish_requests(ids)
        proposer.finish_requests(ids)  # twice
        proposer.finish_requests([*ids[:2], "never-asked-about"])
        assert proposer.propose([]) == {}
        # The ids come back as new requests, each with another case's tokens.
        reused = [
            cases[(index + 1) % len(cases)].request(case.name, case.max_drafts)
            for index, case in enumerate(cases)
        ]
        drafts = self.propose(proposer, reused)
        self.check_only_asked(drafts, reused)
        self.check_max_drafts(drafts, reused)
        if self.claims(plugin_cls, "is_deterministic") and not self.fresh_for_each(plugin_cls):
            expected = present(new_proposer().propose(reused))
            assert present(drafts) == expected, (
                "ids of finished requests, reused by new ones, get other drafts than a fresh "
                f"proposer gives: {self.diff(expected, present(drafts))}"
            )

    # ---- messages ------------------------------------------------------------------------

    @staticmethod
    def diff(expected: dict[str, list[int]], actual: dict[str, list[int]]) -> str:
        """The ids whose drafts differ, with both."""
        ids = sorted(set(expected) | set(actual))
        parts = [
            f"{request_id!r}: {actual.get(request_id, [])} instead of "
            f"{expected.get(request_id, [])}"
            for request_id in ids
            if expected.get(request_id, []) != actual.get(request_id, [])
        ]
        return "; ".join(parts[:6])
