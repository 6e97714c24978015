"""OutputProcessor.process_outputs: text, finish reasons, stop strings, streaming vs final."""

from __future__ import annotations

import pytest

from vlite.core.outputs import EngineCoreOutput, RequestOutputKind
from vlite.core.request import EngineCoreRequest
from vlite.core.sampling_params import SamplingParams
from vlite.engine.output_processor import OutputProcessor

TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture
def processor(tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer)


def add(processor, encode, request_id: str, prompt: str = "Tell me", **params) -> None:
    core_request = EngineCoreRequest(request_id, encode(prompt), SamplingParams(**params))
    processor.add_request(core_request, prompt)


def test_core_finish_reason_passes_through(processor, encode):
    add(processor, encode, "a")
    token_ids = encode(TEXT)

    processed = processor.process_outputs(
        [EngineCoreOutput("a", token_ids, finish_reason="length", num_cached_tokens=16)]
    )

    (output,) = processed.request_outputs
    assert processed.request_ids_to_stop == []
    assert output.request_id == "a"
    assert output.finished
    assert output.prompt == "Tell me"
    assert output.prompt_token_ids == encode("Tell me")
    assert output.num_cached_tokens == 16
    (completion,) = output.outputs
    assert completion.text == TEXT
    assert completion.token_ids == token_ids
    assert completion.finish_reason == "length"
    assert completion.stop_reason is None
    assert not processor.has_unfinished_requests()


def test_core_stop_token_reason_passes_through(processor, encode):
    add(processor, encode, "a", stop_token_ids=[17])

    processed = processor.process_outputs(
        [EngineCoreOutput("a", encode("Hi."), finish_reason="stop", stop_reason=17)]
    )

    completion = processed.request_outputs[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", 17)
    assert processed.request_ids_to_stop == []


def test_streaming_outputs_grow_step_by_step(processor, encode):
    add(processor, encode, "a")
    token_ids = encode(TEXT)

    first = processor.process_outputs([EngineCoreOutput("a", token_ids[:3])])
    assert processor.has_unfinished_requests()
    second = processor.process_outputs(
        [EngineCoreOutput("a", token_ids[3:], finish_reason="length")]
    )

    (partial,) = first.request_outputs
    assert not partial.finished
    assert partial.outputs[0].finish_reason is None
    assert partial.outputs[0].text == "The q"
    assert partial.outputs[0].token_ids == token_ids[:3]
    (final,) = second.request_outputs
    assert final.finished
    assert final.outputs[0].text == TEXT
    assert final.outputs[0].token_ids == token_ids
    metrics = final.metrics
    assert metrics.first_token_time is not None
    assert metrics.finished_time >= metrics.first_token_time


def test_stop_string_finishes_the_request_and_asks_the_core_to_stop_it(
    processor, tokenizer, encode
):
    add(processor, encode, "a", stop=["brown"])
    add(processor, encode, "b")
    token_ids = encode(TEXT)

    results = [
        processor.process_outputs(
            [EngineCoreOutput("a", [token_id]), EngineCoreOutput("b", [token_id])]
        )
        for token_id in token_ids
    ]

    stop_step = next(i for i, r in enumerate(results) if r.request_ids_to_stop)
    assert tokenizer.decode(token_ids[:stop_step]) == "The quick brow"  # "n" completes it
    for earlier in results[:stop_step]:
        assert not earlier.request_outputs[0].finished
    processed = results[stop_step]
    assert processed.request_ids_to_stop == ["a"]
    a_output, b_output = processed.request_outputs
    assert a_output.finished
    assert a_output.outputs[0].finish_reason == "stop"
    assert a_output.outputs[0].stop_reason == "brown"
    assert a_output.outputs[0].text == "The quick "
    assert a_output.outputs[0].token_ids == token_ids[: stop_step + 1]
    assert not b_output.finished
    # Later outputs for the stopped request (already in flight) are ignored.
    for later in results[stop_step + 1 :]:
        assert [o.request_id for o in later.request_outputs] == ["b"]
        assert later.request_ids_to_stop == []


def test_emit_unfinished_false_emits_only_finished_requests(processor, encode):
    add(processor, encode, "a")
    add(processor, encode, "b")
    token_ids = encode(TEXT)

    first = processor.process_outputs(
        [EngineCoreOutput("a", token_ids[:4]), EngineCoreOutput("b", token_ids[:4])],
        emit_unfinished=False,
    )
    second = processor.process_outputs(
        [
            EngineCoreOutput("a", token_ids[4:], finish_reason="length"),
            EngineCoreOutput("b", token_ids[4:6]),
        ],
        emit_unfinished=False,
    )

    assert first.request_outputs == []
    assert [o.request_id for o in second.request_outputs] == ["a"]
    assert second.request_outputs[0].outputs[0].text == TEXT
    assert second.request_outputs[0].outputs[0].token_ids == token_ids
    assert processor.has_unfinished_requests()  # b is still going


def test_aborted_request_outputs_are_dropped(processor, encode):
    add(processor, encode, "a")

    processor.abort_requests(["a", "never-added"])
    processed = processor.process_outputs([EngineCoreOutput("a", encode("Hi"))])

    assert processed.request_outputs == []
    assert not processor.has_unfinished_requests()


def test_stop_string_in_the_last_token_of_a_length_capped_request_reports_stop(processor, encode):
    """As in vLLM: text cut at a stop string is reported as finish_reason "stop"."""
    add(processor, encode, "a", stop=["fox"])
    token_ids = encode("The quick brown fox")

    processed = processor.process_outputs(
        [EngineCoreOutput("a", token_ids, finish_reason="length")]
    )

    completion = processed.request_outputs[0].outputs[0]
    assert completion.text == "The quick brown "
    assert processed.request_ids_to_stop == []  # the core has already finished it
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "fox")


def test_delta_outputs_carry_only_what_is_new(processor, encode):
    add_kind(processor, encode, "a", RequestOutputKind.DELTA)
    token_ids = encode(TEXT)

    outputs = [
        processor.process_outputs([EngineCoreOutput("a", token_ids[i : i + 3])]).request_outputs[0]
        for i in range(0, len(token_ids) - 3, 3)
    ]
    last = processor.process_outputs(
        [EngineCoreOutput("a", token_ids[len(outputs) * 3 :], finish_reason="length")]
    ).request_outputs[0]

    deltas = [*outputs, last]
    assert "".join(o.outputs[0].text for o in deltas) == TEXT
    assert sum((o.outputs[0].token_ids for o in deltas), []) == token_ids
    assert [o.finished for o in deltas] == [False] * len(outputs) + [True]


def test_streamed_text_holds_back_what_a_stop_string_could_still_claim(processor, encode):
    """Without the hold-back, "The quick b" would be shown and then cut to "The quick "."""
    add_kind(processor, encode, "a", RequestOutputKind.CUMULATIVE, stop=["brown"])
    add_kind(processor, encode, "d", RequestOutputKind.DELTA, stop=["brown"])
    token_ids = encode(TEXT)

    cumulative, deltas = [], []
    for token_id in token_ids:
        step = processor.process_outputs(
            [EngineCoreOutput("a", [token_id]), EngineCoreOutput("d", [token_id])]
        ).request_outputs
        cumulative += [o for o in step if o.request_id == "a"]
        deltas += [o for o in step if o.request_id == "d"]
        if not processor.has_unfinished_requests():
            break

    texts = [o.outputs[0].text for o in cumulative]
    assert texts[-1] == "The quick " and cumulative[-1].outputs[0].stop_reason == "brown"
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert all(len(text) <= len("The quick ") for text in texts)
    assert "".join(o.outputs[0].text for o in deltas) == "The quick "


def test_final_only_requests_get_one_output(processor, encode):
    add_kind(processor, encode, "a", RequestOutputKind.FINAL_ONLY)
    token_ids = encode(TEXT)

    first = processor.process_outputs([EngineCoreOutput("a", token_ids[:3])])
    last = processor.process_outputs([EngineCoreOutput("a", token_ids[3:], finish_reason="length")])

    assert first.request_outputs == []
    assert last.request_outputs[0].outputs[0].text == TEXT


def test_aborting_returns_a_final_abort_output_for_known_requests(processor, encode):
    add(processor, encode, "a")
    processor.process_outputs([EngineCoreOutput("a", encode("Hi"))])

    (output,) = processor.abort_requests(["a", "unknown"])

    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert output.outputs[0].text == "Hi"


def test_a_request_id_in_use_is_refused(processor, encode):
    add(processor, encode, "a")
    with pytest.raises(ValueError, match="already in use"):
        add(processor, encode, "a")


def add_kind(processor, encode, request_id: str, kind: RequestOutputKind, **params) -> None:
    core_request = EngineCoreRequest(request_id, encode("Tell me"), SamplingParams(**params))
    processor.add_request(core_request, "Tell me", kind)


# ---- n > 1 and logprobs --------------------------------------------------------------------


def add_parent(processor, encode, request_id: str, kind=RequestOutputKind.CUMULATIVE, **params):
    core_request = EngineCoreRequest(request_id, encode("Tell me"), SamplingParams(**params))
    return processor.add_request(core_request, "Tell me", kind)


def test_n_fans_out_into_children_with_their_own_seeds(processor, encode):
    children = add_parent(processor, encode, "p", n=3, seed=5)

    assert [c.request_id for c in children] == ["0_p", "1_p", "2_p"]
    assert [c.sampling_params.seed for c in children] == [5, 6, 7]
    assert all(c.sampling_params.n == 1 for c in children)
    assert processor.core_request_ids(["p", "x"]) == ["0_p", "1_p", "2_p", "x"]
    assert processor.caller_request_ids(["1_p", "2_p", "x"]) == ["p", "x"]
    with pytest.raises(ValueError, match="already in use"):
        add_parent(processor, encode, "p", n=2)


def test_offline_parent_output_comes_once_with_every_sample(processor, encode):
    add_parent(processor, encode, "p", n=2)
    ids = encode(TEXT)

    first = processor.process_outputs(
        [
            EngineCoreOutput("1_p", ids[:3], finish_reason="length"),
            EngineCoreOutput("0_p", ids[:2]),
        ],
        emit_unfinished=False,
    )
    last = processor.process_outputs(
        [EngineCoreOutput("0_p", ids[2:4], finish_reason="length")], emit_unfinished=False
    )

    assert first.request_outputs == []
    (output,) = last.request_outputs
    assert output.request_id == "p" and output.finished
    assert [(c.index, c.token_ids) for c in output.outputs] == [(0, ids[:4]), (1, ids[:3])]
    assert not processor.has_unfinished_requests()


def test_streamed_delta_parent_outputs_carry_only_the_changed_sample(processor, encode):
    add_parent(processor, encode, "p", RequestOutputKind.DELTA, n=2)
    ids = encode(TEXT)

    step = processor.process_outputs([EngineCoreOutput("1_p", ids[:2])])

    (output,) = step.request_outputs
    assert not output.finished
    assert [(c.index, c.token_ids) for c in output.outputs] == [(1, ids[:2])]


def test_aborting_a_parent_aborts_each_unfinished_sample(processor, encode):
    add_parent(processor, encode, "p", n=2)
    processor.process_outputs([EngineCoreOutput("0_p", [5], finish_reason="length")])

    (output,) = processor.abort_requests(["p"])

    assert output.finished
    assert [c.finish_reason for c in output.outputs] == ["length", "abort"]
    assert not processor.has_unfinished_requests()


def test_logprobs_follow_the_tokens_in_delta_outputs(processor, encode, tokenizer):
    from vlite.core.outputs import SampledLogprobs

    core_request = EngineCoreRequest("a", encode("Tell me"), SamplingParams(logprobs=1))
    processor.add_request(core_request, "Tell me", RequestOutputKind.DELTA)
    ids = encode(TEXT)[:3]
    entries = [SampledLogprobs([t, 9], [-0.5 * (i + 1), -0.1], [2, 1]) for i, t in enumerate(ids)]

    first = processor.process_outputs([EngineCoreOutput("a", ids[:2], new_logprobs=entries[:2])])
    last = processor.process_outputs(
        [EngineCoreOutput("a", ids[2:], "length", new_logprobs=entries[2:])]
    )

    a, b = first.request_outputs[0].outputs[0], last.request_outputs[0].outputs[0]
    assert [list(p) for p in a.logprobs] == [[ids[0], 9], [ids[1], 9]]
    assert [list(p) for p in b.logprobs] == [[ids[2], 9]]
    assert b.logprobs[0][ids[2]].decoded_token == tokenizer.decode([ids[2]])
    assert (a.cumulative_logprob, b.cumulative_logprob) == (-1.5, -3.0)
