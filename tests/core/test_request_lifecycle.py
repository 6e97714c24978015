"""A request's life, step by step: status and counters, and RequestStatus's finish semantics."""

from __future__ import annotations

import pytest

from vlite.core.request import EngineCoreRequest, Request, RequestStatus
from vlite.core.sampling_params import SamplingParams

WAITING = RequestStatus.WAITING
RUNNING = RequestStatus.RUNNING
PREEMPTED = RequestStatus.PREEMPTED
LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED


def snapshot(request: Request) -> tuple[RequestStatus, int, int]:
    return (request.status, request.num_computed_tokens, request.num_tokens)


def trace(engine, requests: list[Request]) -> list[list[tuple[RequestStatus, int, int]]]:
    """Each request's (status, num_computed_tokens, num_tokens) before step 1 and after each."""
    traces = [[snapshot(request)] for request in requests]
    while engine.scheduler.has_unfinished_requests():
        engine.step()
        for request, request_trace in zip(requests, traces, strict=True):
            request_trace.append(snapshot(request))
    return traces


def test_single_request_trace(make_engine):
    engine = make_engine()
    request = engine.add("a", [1, 2, 3, 4, 5], max_tokens=3)

    (request_trace,) = trace(engine, [request])

    assert request_trace == [
        (WAITING, 0, 5),
        (RUNNING, 5, 6),  # prompt computed, first token sampled
        (RUNNING, 6, 7),
        (LENGTH_CAPPED, 7, 8),  # the last sampled token is never computed
    ]
    outputs = [(s.outputs["a"].new_token_ids, s.outputs["a"].finish_reason) for s in engine.steps]
    assert outputs == [([1000], None), ([1001], None), ([1002], "length")]
    assert request.output_token_ids == [1000, 1001, 1002]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_trace_through_preemption_and_resumption(make_engine):
    # 6 blocks of 4 slots: both requests fit at first; in step 7 a needs a 4th block and
    # b (admitted last) is preempted. In step 8 b still does not fit; a finishes. In step 9
    # b is re-admitted, reviving its 2 cached blocks (8 tokens) and recomputing 5.
    engine = make_engine(num_blocks=6, block_size=4)
    a = engine.add("a", list(range(7)), max_tokens=8)
    b = engine.add("b", list(range(100, 107)), max_tokens=8)

    a_trace, b_trace = trace(engine, [a, b])

    # a finishes in step 8; the trace goes on (unchanged) until b finishes in step 10.
    assert a_trace == (
        [(WAITING, 0, 7)]
        + [(RUNNING, 6 + k, 7 + k) for k in range(1, 8)]
        + [(LENGTH_CAPPED, 14, 15)] * 3
    )
    assert b_trace == (
        [(WAITING, 0, 7)]
        + [(RUNNING, 6 + k, 7 + k) for k in range(1, 7)]
        + [(PREEMPTED, 0, 13), (PREEMPTED, 0, 13), (RUNNING, 13, 14), (LENGTH_CAPPED, 14, 15)]
    )
    assert b.num_preemptions == 1
    assert b.num_cached_tokens == 8
    assert b.output_token_ids == list(range(1000, 1008))


def test_the_first_and_the_last_outputs_say_when_the_request_was_first_scheduled(make_engine):
    # Chunked: the first output with a token comes in step 3. A stop string may end the
    # request in the front end before its last output: the first one must carry the time.
    engine = make_engine(max_num_batched_tokens=4, enable_chunked_prefill=True)
    request = engine.add("a", list(range(10)), max_tokens=3)

    while engine.scheduler.has_unfinished_requests():
        engine.step()

    scheduled = request.first_scheduled_time
    outputs = [step.outputs.get("a") for step in engine.steps]
    assert [o.first_scheduled_time if o else "none" for o in outputs] == [
        "none",
        "none",
        scheduled,
        None,
        scheduled,
    ]
    assert scheduled is not None


# ---- RequestStatus ---------------------------------------------------------------------


def test_is_finished_is_exactly_the_four_finished_statuses():
    finished = {status for status in RequestStatus if status.is_finished}

    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
    assert not WAITING.is_finished
    assert not RUNNING.is_finished
    assert not PREEMPTED.is_finished


@pytest.mark.parametrize(
    ("status", "finish_reason"),
    [
        (RequestStatus.FINISHED_STOPPED, "stop"),
        (RequestStatus.FINISHED_LENGTH_CAPPED, "length"),
        (RequestStatus.FINISHED_ABORTED, "abort"),
        (RequestStatus.FINISHED_ERROR, "error"),
        (RequestStatus.WAITING, None),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PREEMPTED, None),
    ],
)
def test_finish_reason_mapping(status, finish_reason):
    assert status.finish_reason == finish_reason


def test_new_request_state_and_token_bookkeeping():
    request = Request(
        EngineCoreRequest("r", [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=2)
    )
    assert snapshot(request) == (WAITING, 0, 3)
    assert not request.is_finished
    assert request.max_tokens == 4
    assert request.eos_token_id == 2

    request.append_output_token(9)

    assert request.prompt_token_ids == [5, 6, 7]
    assert request.output_token_ids == [9]
    assert request.all_token_ids == [5, 6, 7, 9]
    assert request.num_prompt_tokens == 3
    assert request.num_output_tokens == 1
    assert request.num_tokens == 4
    request.status = RequestStatus.FINISHED_ABORTED
    assert request.is_finished
