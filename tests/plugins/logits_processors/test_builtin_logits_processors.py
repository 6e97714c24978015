"""What each built-in logits processor does to a row, exactly (vLLM's meanings)."""

from __future__ import annotations

import pytest
import torch

from vlite.core.logits_processor import AddedRequest, BatchUpdate
from vlite.core.sampling_params import SamplingParams
from vlite.plugins.logits_processors.allowed_token_ids import AllowedTokenIdsLogitsProcessor
from vlite.plugins.logits_processors.bad_words import BadWordsLogitsProcessor
from vlite.plugins.logits_processors.logit_bias import LogitBiasLogitsProcessor
from vlite.plugins.logits_processors.min_tokens import MinTokensLogitsProcessor

CPU = torch.device("cpu")
VOCAB = 10
EOS = 2
PROMPT = [1, 2, 3]
INF = float("inf")


def request(request_id: str, output=(), eos_token_id=EOS, **params) -> AddedRequest:
    return AddedRequest(
        request_id, SamplingParams(**params), [*PROMPT, *output], len(PROMPT), eos_token_id
    )


def edit(cls, requests: list[AddedRequest], processor=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(before, after)``: zero logits of one row per request, and the processor's edit."""
    processor = processor or cls(None, CPU, VOCAB)
    processor.update_state(BatchUpdate(added=requests, rows=[r.request_id for r in requests]))
    before = torch.zeros(len(requests), VOCAB)
    return before, processor.apply(before.clone())


def changed(before: torch.Tensor, after: torch.Tensor) -> list[list[tuple[int, float]]]:
    """Per row, the ``(token, new value)`` pairs the edit changed."""
    return [
        [
            (t, after[row, t].item())
            for t in (before[row] != after[row]).nonzero().flatten().tolist()
        ]
        for row in range(before.shape[0])
    ]


# ---- logit_bias ---------------------------------------------------------------------------


def test_logit_bias_adds_each_bias_to_its_row_only():
    before, after = edit(
        LogitBiasLogitsProcessor,
        [
            request("a", logit_bias={3: 2.5, 7: -100.0}),
            request("plain"),
            request("b", logit_bias={3: 1.0}),
        ],
    )
    assert changed(before, after) == [[(3, 2.5), (7, -100.0)], [], [(3, 1.0)]]


def test_logit_bias_ignores_ids_outside_the_vocabulary():
    before, after = edit(LogitBiasLogitsProcessor, [request("a", logit_bias={VOCAB: 5.0, 1: 1.0})])
    assert changed(before, after) == [[(1, 1.0)]]
    before, after = edit(LogitBiasLogitsProcessor, [request("a", logit_bias={VOCAB + 3: 5.0})])
    assert after.equal(before)


def test_logit_bias_follows_its_rows_when_they_move():
    processor = LogitBiasLogitsProcessor(None, CPU, VOCAB)
    a, b = request("a", logit_bias={1: 1.0}), request("b", logit_bias={2: 2.0})
    edit(None, [a, b], processor)
    processor.update_state(BatchUpdate(rows=["plain", "b", "a"]))
    after = processor.apply(torch.zeros(3, VOCAB))
    assert changed(torch.zeros(3, VOCAB), after) == [[], [(2, 2.0)], [(1, 1.0)]]


# ---- allowed_token_ids --------------------------------------------------------------------


def test_allowed_token_ids_leaves_only_the_allowed_tokens():
    before, after = edit(
        AllowedTokenIdsLogitsProcessor,
        [request("plain"), request("a", allowed_token_ids=[1, 4, VOCAB + 5])],
    )
    assert after[0].equal(before[0])
    assert after[1].isinf().nonzero().flatten().tolist() == [0, 2, 3, 5, 6, 7, 8, 9]
    assert after[1, [1, 4]].tolist() == [0.0, 0.0]


def test_allowed_token_ids_none_of_which_is_in_the_vocabulary_constrain_nothing():
    before, after = edit(AllowedTokenIdsLogitsProcessor, [request("a", allowed_token_ids=[VOCAB])])
    assert after.equal(before)


# ---- bad_words ----------------------------------------------------------------------------


def banned(output, words, prompt_end=()) -> list[int]:
    """The tokens the bad_words processor bans after ``output``."""
    case = request("a", output=output, bad_words_token_ids=words)
    if prompt_end:
        case = AddedRequest("a", case.params, [*PROMPT, *prompt_end], len(PROMPT) + 2, EOS)
    before, after = edit(BadWordsLogitsProcessor, [case])
    assert all(value == -INF for _, value in changed(before, after)[0])
    return [t for t, _ in changed(before, after)[0]]


def test_a_one_token_bad_word_is_always_banned():
    assert banned([], [[7]]) == [7]
    assert banned([5, 6], [[7]]) == [7]


def test_a_bad_word_bans_its_last_token_where_the_output_ends_with_the_rest():
    words = [[4, 5], [9, 3, 8]]
    assert banned([], words) == []
    assert banned([1, 4], words) == [5]
    assert banned([4, 1], words) == []
    assert banned([9, 3], words) == [8]
    assert banned([9, 4], words) == [5]
    assert banned([3], words) == []  # [9, 3] must both be there


def test_bad_words_look_at_the_output_only():
    # The prompt ends with 4 (and 9, 3): no output yet, nothing banned.
    assert banned([], [[4, 5], [9, 3, 8]], prompt_end=(9, 3)) == []
    assert banned([], [[3, 5]]) == []  # PROMPT ends with 3


def test_bad_words_ending_outside_the_vocabulary_are_ignored():
    assert banned([4], [[4, VOCAB], [VOCAB + 1], [6]]) == [6]


def test_bad_words_see_tokens_appended_to_the_live_list():
    processor = BadWordsLogitsProcessor(None, CPU, VOCAB)
    case = request("a", bad_words_token_ids=[[4, 5]])
    before, after = edit(None, [case], processor)
    assert after.equal(before)
    case.token_ids.append(4)
    processor.update_state(BatchUpdate(rows=["a"]))
    assert changed(before, processor.apply(before.clone())) == [[(5, -INF)]]


# ---- min_tokens ---------------------------------------------------------------------------


def test_min_tokens_masks_the_stop_tokens_of_rows_short_of_min_tokens_only():
    before, after = edit(
        MinTokensLogitsProcessor,
        [
            request("short", output=[4, 4], min_tokens=3, stop_token_ids=[7, 9]),
            request("done", output=[4, 4, 4], min_tokens=3, stop_token_ids=[7]),
            request("plain", stop_token_ids=[7]),
            request("no-eos", min_tokens=5, stop_token_ids=[5, 99], ignore_eos=True),
            request("eos-only", min_tokens=1, eos_token_id=8),
            request("unknown-eos", min_tokens=1, eos_token_id=None, stop_token_ids=[6]),
        ],
    )
    assert changed(before, after) == [
        [(2, -INF), (7, -INF), (9, -INF)],
        [],
        [],
        [(5, -INF)],  # 99 is not a token; EOS is ignored
        [(8, -INF)],
        [(6, -INF)],
    ]


def test_min_tokens_lifts_the_mask_once_the_output_is_long_enough():
    processor = MinTokensLogitsProcessor(None, CPU, VOCAB)
    case = request("a", min_tokens=2)
    for num_output, expected in [(0, [(EOS, -INF)]), (1, [(EOS, -INF)]), (2, []), (3, [])]:
        processor.update_state(BatchUpdate(added=[case] if num_output == 0 else [], rows=["a"]))
        logits = torch.zeros(1, VOCAB)
        assert changed(torch.zeros(1, VOCAB), processor.apply(logits)) == [expected]
        case.token_ids.append(4)


@pytest.mark.parametrize(
    "params",
    [{"min_tokens": 0, "stop_token_ids": [5]}, {"min_tokens": 3, "ignore_eos": True}],
)
def test_min_tokens_without_a_token_to_mask_does_not_apply(params):
    processor = MinTokensLogitsProcessor(None, CPU, VOCAB)
    edit(None, [request("a", **params)], processor)
    assert processor.states == {} and processor.active == []


# ---- the shared bookkeeping ---------------------------------------------------------------


def test_an_id_added_again_without_being_removed_is_the_new_request():
    processor = LogitBiasLogitsProcessor(None, CPU, VOCAB)
    edit(None, [request("a", logit_bias={1: 1.0})], processor)
    before, after = edit(None, [request("a")], processor)
    assert after.equal(before) and processor.states == {}
    before, after = edit(None, [request("a", logit_bias={2: 3.0})], processor)
    assert changed(before, after) == [[(2, 3.0)]]


@pytest.mark.parametrize(
    ("cls", "old", "new", "expected"),
    [
        (LogitBiasLogitsProcessor, {"logit_bias": {1: 1.0}}, {"logit_bias": {2: 2.0}}, [(2, 2.0)]),
        (
            AllowedTokenIdsLogitsProcessor,
            {"allowed_token_ids": list(range(1, VOCAB))},
            {"allowed_token_ids": list(range(VOCAB - 1))},
            [(VOCAB - 1, -INF)],
        ),
    ],
)
def test_cached_tensors_are_rebuilt_after_an_update_without_a_step(cls, old, new, expected):
    """A processor that caches its tensors rebuilds them for a request that replaced
    another of the same id, though the update that said so had no apply after it."""
    processor = cls(None, CPU, VOCAB)
    edit(None, [request("a", **old)], processor)
    processor.update_state(BatchUpdate(added=[request("a", **new)], removed=["a"], rows=["a"]))
    processor.update_state(BatchUpdate(rows=["a"]))

    after = processor.apply(torch.zeros(1, VOCAB))

    assert changed(torch.zeros(1, VOCAB), after) == [expected]
