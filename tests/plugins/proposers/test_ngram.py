"""The built-in ``ngram`` proposer (prompt lookup): which earlier occurrence it copies from,
and how much."""

from __future__ import annotations

from vlite.core.proposer import DraftRequest, SpeculativeConfig
from vlite.plugins.proposers.ngram import NgramProposer


def drafts_for(tokens, max_drafts=4, lookup=(2, 5), **more) -> dict[str, list[int]]:
    """``ngram``'s answer for one request holding ``tokens`` (all prompt)."""
    config = SpeculativeConfig(prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1], **more)
    request = DraftRequest("r", list(tokens), len(tokens), max_drafts)
    return NgramProposer(config).propose([request])


#: "1 2 3" occurs once before the end (then 10 11); "2 3" occurs later too (then 20 21).
LONG_EARLY_SHORT_LATE = [1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3]


def test_the_longest_matching_suffix_wins_over_a_later_shorter_one():
    assert drafts_for(LONG_EARLY_SHORT_LATE, max_drafts=2, lookup=(2, 3)) == {"r": [10, 11]}


def test_prompt_lookup_max_caps_the_suffix_length():
    assert drafts_for(LONG_EARLY_SHORT_LATE, max_drafts=2, lookup=(2, 2)) == {"r": [20, 21]}


def test_prompt_lookup_min_is_the_shortest_suffix_tried():
    tokens = [7, 8, 1, 2, 9, 4, 5, 2]  # only the 1-token suffix "2" occurred before
    assert drafts_for(tokens, lookup=(2, 5)) == {}
    assert drafts_for(tokens, max_drafts=2, lookup=(1, 5)) == {"r": [9, 4]}


def test_the_latest_earlier_occurrence_is_copied():
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert drafts_for(tokens, max_drafts=2, lookup=(2, 2)) == {"r": [8, 2]}


def test_at_most_max_drafts_are_proposed():
    tokens = list(range(10, 30)) * 2 + [10, 11]
    for max_drafts in (1, 3, 7):
        assert drafts_for(tokens, max_drafts=max_drafts) == {"r": list(range(12, 12 + max_drafts))}


def test_drafts_stop_at_the_end_of_the_context():
    # The occurrence of "1 2" is followed by only 9, 1, 2 before the context ends.
    assert drafts_for([1, 2, 9, 1, 2], max_drafts=4, lookup=(2, 2)) == {"r": [9, 1, 2]}


def test_no_match_gives_no_entry():
    assert drafts_for([4, 8, 15, 16, 23, 42]) == {}


def test_a_context_no_longer_than_the_suffix_gets_nothing():
    assert drafts_for([3]) == {}
    assert drafts_for([3, 3], lookup=(2, 5)) == {}  # the suffix "3 3" has no earlier place
    assert drafts_for([3, 3, 3], lookup=(2, 5)) == {"r": [3]}
    assert drafts_for([3, 3], lookup=(1, 5)) == {"r": [3]}


def test_each_request_of_a_batch_is_looked_up_in_its_own_tokens():
    proposer = NgramProposer(SpeculativeConfig())
    requests = [
        DraftRequest("a", [1, 2, 3, 1, 2], 5, 4),
        DraftRequest("b", [7, 8, 1, 2], 2, 4),  # "1 2" occurs only in a
        DraftRequest("c", [9, 9, 5, 9, 9], 3, 1),
    ]
    assert proposer.propose(requests) == {"a": [3, 1, 2], "c": [5]}
