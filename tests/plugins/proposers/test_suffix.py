"""The built-in ``suffix`` proposer: prompt lookup, then what finished requests wrote after
the same n-gram, in a table of bounded size; and the proposer suite on it."""

from __future__ import annotations

from pathlib import Path

import vlite
from vlite.core.config import read_toml_file
from vlite.core.proposer import DraftRequest, SpeculativeConfig
from vlite.plugins.proposers.ngram import NgramProposer
from vlite.plugins.proposers.suffix import SuffixProposer, SuffixTable
from vlite.testing import ProposerConformance

ROOT = Path(__file__).resolve().parents[3]
CONFIG = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)


def request(request_id: str, tokens, num_prompt_tokens: int, max_drafts: int = 4):
    return DraftRequest(request_id, list(tokens), num_prompt_tokens, max_drafts)


def run_to_finish(proposer, request_id: str, prompt, output) -> None:
    """Ask for drafts at every step of a request that writes ``output``, then finish it."""
    tokens = list(prompt)
    for token in output:
        tokens.append(token)  # the engine's live list grows
        proposer.propose([DraftRequest(request_id, tokens, len(prompt), 4)])
    proposer.finish_requests([request_id])


def test_a_new_request_gets_what_a_finished_request_wrote_after_its_last_tokens():
    proposer = SuffixProposer(CONFIG)
    run_to_finish(proposer, "first", [100, 101, 102], [5, 6, 7, 8, 9, 10])
    new = request("second", [200, 201, 5, 6], 2)
    assert NgramProposer(CONFIG).propose([new]) == {}  # its own tokens hold no match
    assert proposer.propose([new]) == {"second": [7, 8, 9, 10]}
    assert proposer.propose([request("third", [300, 5, 6], 1, max_drafts=2)]) == {"third": [7, 8]}


def test_it_learns_when_a_request_finishes_not_while_it_runs():
    proposer = SuffixProposer(CONFIG)
    running = request("running", [100, 101, 5, 6, 7, 8, 9], 2)
    new = request("new", [200, 201, 5, 6], 2)
    assert proposer.propose([running, new]) == {}
    assert proposer.propose([new]) == {}
    proposer.finish_requests(["running"])
    assert proposer.propose([request("newer", [200, 201, 5, 6], 2)]) == {"newer": [7, 8, 9]}


def test_the_requests_own_tokens_come_first():
    proposer = SuffixProposer(CONFIG)
    run_to_finish(proposer, "first", [100], [5, 6, 7, 8])
    own = request("own", [5, 6, 40, 41, 5, 6], 6)
    assert proposer.propose([own]) == {"own": [40, 41, 5, 6]}


def test_the_longest_suffix_in_the_table_wins_and_the_latest_continuation():
    proposer = SuffixProposer(CONFIG)
    run_to_finish(proposer, "a", [100], [4, 5, 6, 10, 11])
    run_to_finish(proposer, "b", [101], [9, 5, 6, 20, 21])
    assert proposer.propose([request("x", [300, 4, 5, 6], 1)]) == {"x": [10, 11]}
    assert proposer.propose([request("y", [300, 7, 5, 6], 1)]) == {"y": [20, 21]}
    run_to_finish(proposer, "c", [102], [8, 5, 6, 30])
    assert proposer.propose([request("z", [300, 7, 5, 6], 1)]) == {"z": [30]}


def test_only_outputs_are_learned_and_an_ngram_may_reach_into_the_prompt():
    proposer = SuffixProposer(CONFIG)
    run_to_finish(proposer, "a", [1, 2, 3, 4], [9, 8])
    assert proposer.propose([request("prompt-ngram", [50, 1, 2], 1)]) == {}
    assert proposer.propose([request("at-the-boundary", [50, 3, 4], 1)]) == {
        "at-the-boundary": [9, 8]
    }


def test_the_engines_lists_are_copied_not_held():
    proposer = SuffixProposer(CONFIG)
    tokens = [100, 101, 5, 6, 7, 8]
    proposer.propose([DraftRequest("a", tokens, 2, 4)])
    tokens.clear()  # the engine may reuse or drop its list once the step is done
    proposer.finish_requests(["a"])
    assert proposer.propose([request("b", [200, 5, 6], 1)]) == {"b": [7, 8]}


def test_a_request_never_asked_about_teaches_nothing_and_unknown_ids_are_ignored():
    proposer = SuffixProposer(CONFIG)
    proposer.finish_requests(["never-seen", "never-seen"])
    assert len(proposer.table) == 0 and proposer.seen == {}


class SmallTableSuffixProposer(SuffixProposer):
    max_table_entries = 50


def test_the_table_stays_under_its_cap_and_forgets_the_least_recent():
    proposer = SmallTableSuffixProposer(CONFIG)
    for index in range(200):
        base = 1000 + 20 * index  # every request writes n-grams of its own
        run_to_finish(proposer, f"r{index}", [base], range(base + 1, base + 11))
        assert len(proposer.table) <= 50
    assert proposer.seen == {}  # every finished request's tokens are released
    last = 1000 + 20 * 199
    assert proposer.propose([request("late", [0, last + 3, last + 4], 1)]) == {
        "late": [last + 5, last + 6, last + 7, last + 8]
    }
    first = 1000
    assert proposer.propose([request("early", [0, first + 3, first + 4], 1)]) == {}


def test_the_table_drops_the_least_recently_used_entry():
    table = SuffixTable(max_entries=2)
    table.put((1, 2), (3,))
    table.put((4, 5), (6,))
    assert table.get((1, 2)) == (3,)  # now more recent than (4, 5)
    table.put((7, 8), (9,))
    assert len(table) == 2
    assert table.get((4, 5)) is None
    assert table.get((1, 2)) == (3,) and table.get((7, 8)) == (9,)


def test_it_is_a_builtin_entry_point_of_vlite():
    entry_points = read_toml_file(ROOT / "pyproject.toml")["project"]["entry-points"]
    builtins = entry_points["vlite.builtin"]
    assert builtins["vlite.plugins.proposers.suffix"] == "vlite.plugins.proposers.suffix"


class SuffixUnderTest:
    """Registers the class under a name of its own (the installed metadata may already
    list the module as a built-in, which cannot be registered twice)."""

    @vlite.hookimpl
    def register_proposers(self, register):
        register("suffix-under-test", SuffixProposer)


class TestSuffixConformance(ProposerConformance):
    plugin_name = "suffix-under-test"
    extra_plugins = (SuffixUnderTest(),)
    load_entry_points = False


class TestSuffixConformanceWithOtherLookupLengths(TestSuffixConformance):
    speculative_config = {"num_speculative_tokens": 6, "prompt_lookup_min": 1}
