"""OutputProcessor.process_outputs: text, finish reasons, stop strings, streaming vs final."""

from __future__ import annotations

import pytest

from vlite.core.outputs import EngineCoreOutput
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
