"""LogitsProcessorPipeline: the model runner's processors, built from the registry, told
of arrivals and departures, and run in registry order."""

from __future__ import annotations

import torch

import vlite
from vlite.core.config import VliteConfig
from vlite.core.logits_processor import AddedRequest, BatchUpdate, LogitsProcessor
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.sampling_params import SamplingParams
from vlite.testing.conformance.logits_processor import TensorWorkRecorder
from vlite.worker.logits_processors import LogitsProcessorPipeline

CPU = torch.device("cpu")
INF = float("inf")
BUILTIN_ORDER = ["allowed_token_ids", "bad_words", "logit_bias", "min_tokens"]


class RecordingProcessor(LogitsProcessor):
    """Records every update and adds 1 to column 0 of every row."""

    def __init__(self, config, device, vocab_size):
        super().__init__(config, device, vocab_size)
        self.updates: list[BatchUpdate] = []

    def update_state(self, batch_update):
        self.updates.append(batch_update)

    def apply(self, logits):
        logits[:, 0] += 1
        return logits


class RecordingPlugin:
    @vlite.hookimpl
    def register_logits_processors(self, register):
        register("recording", RecordingProcessor)


def added(request_id: str, **params) -> AddedRequest:
    return AddedRequest(request_id, SamplingParams(**params), [1, 2], 2)


def test_from_registry_builds_every_processor_in_registry_order():
    registry = PluginRegistry(
        build_plugin_manager(extra_plugins=(RecordingPlugin(),), load_entry_points=False)
    )
    config = VliteConfig()

    pipeline = LogitsProcessorPipeline.from_registry(registry, config, CPU, 32)

    expected = [registry.get("logits_processor", n) for n in [*BUILTIN_ORDER, "recording"]]
    assert [type(p) for p in pipeline.processors] == expected
    recording = pipeline.processors[-1]
    assert (recording.config, recording.device, recording.vocab_size) == (config, CPU, 32)


def test_changes_reach_the_processors_once_with_the_rows():
    recording = RecordingProcessor(None, CPU, 8)
    pipeline = LogitsProcessorPipeline([recording])
    a, b = added("a"), added("b")
    pipeline.add_request(a)
    pipeline.add_request(b)

    logits = pipeline.apply(torch.zeros(2, 8), ["b", "a"])
    pipeline.apply(logits, ["a", "b"])

    first, second = recording.updates
    assert (first.added, first.removed, first.rows) == ([a, b], [], ["b", "a"])
    assert (second.added, second.removed, second.rows) == ([], [], ["a", "b"])
    assert logits[:, 0].tolist() == [2.0, 2.0]


def test_a_request_gone_before_a_step_is_never_announced():
    recording = RecordingProcessor(None, CPU, 8)
    pipeline = LogitsProcessorPipeline([recording])
    pipeline.add_request(added("short-lived"))
    pipeline.remove_request("short-lived")
    assert pipeline.has_pending_changes  # the removal is still news (harmless if unknown)

    pipeline.update_state([])

    assert recording.updates[0].added == [] and recording.updates[0].removed == ["short-lived"]
    assert not pipeline.has_pending_changes


def test_an_id_reused_between_steps_comes_as_removed_then_added():
    recording = RecordingProcessor(None, CPU, 8)
    pipeline = LogitsProcessorPipeline([recording])
    pipeline.add_request(added("a"))
    pipeline.update_state(["a"])
    again = added("a", temperature=0.5)
    pipeline.remove_request("a")
    pipeline.add_request(again)

    pipeline.update_state(["a"])

    assert recording.updates[1].removed == ["a"] and recording.updates[1].added == [again]


def test_a_pipeline_without_processors_keeps_nothing():
    pipeline = LogitsProcessorPipeline([])
    pipeline.add_request(added("a"))
    pipeline.remove_request("b")
    assert not pipeline.has_pending_changes


def test_requests_that_use_no_builtin_cost_no_tensor_work():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    pipeline = LogitsProcessorPipeline.from_registry(registry, VliteConfig(), CPU, 64)
    plain = [
        added("plain"),
        added("sampled", temperature=0.7, top_p=0.9, seed=3, stop_token_ids=[5]),
        added("min-tokens-without-stop-ids", min_tokens=4, ignore_eos=True),
    ]
    for request in plain:
        pipeline.add_request(request)
    first, second = torch.randn(3, 64), torch.randn(2, 64)
    expected = [first.clone(), second.clone()]

    with TensorWorkRecorder() as recorder:
        returned = [pipeline.apply(first, [r.request_id for r in plain])]
        pipeline.remove_request("plain")
        returned.append(pipeline.apply(second, [r.request_id for r in plain[1:]]))

    assert recorder.ops == []
    assert returned[0] is first and returned[1] is second
    assert first.equal(expected[0]) and second.equal(expected[1])


def test_builtins_compose_in_one_step():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    pipeline = LogitsProcessorPipeline.from_registry(registry, VliteConfig(), CPU, 8)
    pipeline.add_request(
        AddedRequest(
            "a",
            SamplingParams(
                allowed_token_ids=[1, 2, 3, 5],
                bad_words_token_ids=[[5]],
                logit_bias={1: 4.0, 6: 9.0},
                min_tokens=1,
            ),
            [7, 7],
            2,
            eos_token_id=3,
        )
    )

    logits = pipeline.apply(torch.zeros(1, 8), ["a"])

    assert logits[0].tolist() == [-INF, 4.0, 0.0, -INF, -INF, -INF, -INF, -INF]
