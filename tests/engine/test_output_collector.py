"""RequestOutputCollector: a slow consumer gets merged outputs, then any error."""

from __future__ import annotations

import asyncio

import pytest

from vlite.core.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from vlite.engine.output_collector import RequestOutputCollector


def output(text: str, token_ids: list[int], finish_reason: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, text, token_ids, finish_reason)
    return RequestOutput("r", "p", [1], [completion], finished=finish_reason is not None)


def get(collector: RequestOutputCollector) -> RequestOutput:
    return asyncio.run(asyncio.wait_for(collector.get(), 5))


def test_deltas_not_yet_taken_are_merged():
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    collector.put(output("Hel", [1]))
    collector.put(output("lo", [2], "length"))

    merged = get(collector)

    assert merged.outputs[0].text == "Hello" and merged.outputs[0].token_ids == [1, 2]
    assert merged.finished and merged.outputs[0].finish_reason == "length"


def test_a_newer_cumulative_output_replaces_the_one_not_yet_taken():
    collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    collector.put(output("Hel", [1]))
    collector.put(output("Hello", [1, 2]))

    assert get(collector).outputs[0].text == "Hello"


def test_an_error_comes_after_the_outputs_before_it():
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    collector.put(output("Hi", [1]))
    collector.put_error(RuntimeError("boom"))

    assert get(collector).outputs[0].text == "Hi"
    with pytest.raises(RuntimeError, match="boom"):
        get(collector)


def test_get_waits_for_a_put():
    collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)

    async def put_later_then_get():
        asyncio.get_running_loop().call_soon(collector.put, output("late", [3]))
        return await asyncio.wait_for(collector.get(), 5)

    assert asyncio.run(put_later_then_get()).outputs[0].text == "late"


def test_deltas_of_several_samples_are_merged_by_index():
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    first = RequestOutput("r", "p", [1], [CompletionOutput(1, "b", [2])], finished=False)
    second = RequestOutput(
        "r", "p", [1], [CompletionOutput(0, "a", [1]), CompletionOutput(1, "c", [3], "stop")], False
    )
    collector.put(first)
    collector.put(second)

    merged = get(collector)

    assert [(c.index, c.text, c.token_ids) for c in merged.outputs] == [
        (0, "a", [1]),
        (1, "bc", [2, 3]),
    ]
    assert merged.outputs[1].finish_reason == "stop"
