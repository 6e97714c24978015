"""Token-level stop conditions: ``check_stop`` directly, and through the scheduler."""

from __future__ import annotations

import pytest

from vlite.core.outputs import ModelRunnerOutput
from vlite.core.request import EngineCoreRequest, Request, RequestStatus
from vlite.core.sampling_params import SamplingParams
from vlite.core.stop import check_stop

EOS = 2
MAX_MODEL_LEN = 64


def running_request(prompt_len: int = 4, **params) -> Request:
    request = Request(
        EngineCoreRequest("r", list(range(10, 10 + prompt_len)), SamplingParams(**params), EOS)
    )
    request.status = RequestStatus.RUNNING
    return request


def sample(request: Request, token_id: int, max_model_len: int = MAX_MODEL_LEN) -> bool:
    request.append_output_token(token_id)
    return check_stop(request, max_model_len)


# ---- check_stop ---------------------------------------------------------------------------


def test_ordinary_token_does_not_stop():
    request = running_request(max_tokens=3)

    assert sample(request, 50) is False
    assert sample(request, 51) is False
    assert request.status is RequestStatus.RUNNING
    assert request.stop_reason is None


def test_eos_stops():
    request = running_request(max_tokens=10)
    sample(request, 50)

    assert sample(request, EOS) is True
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.status.finish_reason == "stop"
    assert request.stop_reason is None


def test_eos_is_ignored_with_ignore_eos_until_max_tokens():
    request = running_request(max_tokens=3, ignore_eos=True)

    assert [sample(request, EOS) for _ in range(3)] == [False, False, True]
    assert request.status.finish_reason == "length"


def test_eos_and_stop_tokens_do_not_stop_before_min_tokens():
    request = running_request(max_tokens=10, min_tokens=3, stop_token_ids=[60])

    assert [sample(request, t) for t in (EOS, 60)] == [False, False]
    assert sample(request, EOS) is True  # the third output token may stop
    assert request.status.finish_reason == "stop"


def test_a_stop_token_after_min_tokens_stops_with_its_reason():
    request = running_request(max_tokens=10, min_tokens=1, stop_token_ids=[60])

    assert sample(request, 60) is True
    assert request.stop_reason == 60


def test_max_tokens_still_caps_before_min_tokens_is_met_by_the_context():
    request = running_request(prompt_len=4, max_tokens=10, min_tokens=10)

    assert [sample(request, EOS, max_model_len=6) for _ in range(2)] == [False, True]
    assert request.status.finish_reason == "length"


def test_max_tokens_caps_the_length():
    request = running_request(max_tokens=2)

    assert [sample(request, 50), sample(request, 51)] == [False, True]
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.status.finish_reason == "length"


def test_stop_token_id_stops_and_is_the_stop_reason():
    request = running_request(max_tokens=10, stop_token_ids=[77, 78])
    sample(request, 50)

    assert sample(request, 78) is True
    assert request.status is RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 78


def test_stop_token_id_still_stops_with_ignore_eos():
    request = running_request(max_tokens=10, stop_token_ids=[77], ignore_eos=True)

    assert sample(request, EOS) is False
    assert sample(request, 77) is True
    assert request.stop_reason == 77


def test_eos_on_the_last_allowed_token_reports_stop():
    request = running_request(max_tokens=2)
    sample(request, 50)

    assert sample(request, EOS) is True
    assert request.status.finish_reason == "stop"


def test_max_model_len_caps_the_length():
    request = running_request(prompt_len=5, max_tokens=100)

    results = [sample(request, 50 + i, max_model_len=8) for i in range(3)]

    assert results == [False, False, True]
    assert request.num_tokens == 8
    assert request.status.finish_reason == "length"


# ---- through the scheduler -----------------------------------------------------------------


def scripted(script: dict[str, list[int]]):
    """A fake model that emits each request's scripted tokens in order."""
    return lambda request: script[request.request_id][request.num_output_tokens]


def run_and_collect(engine) -> dict[str, tuple[list[int], str | None, int | str | None]]:
    """Run to completion; per request: all new tokens, finish_reason, stop_reason."""
    engine.run()
    collected: dict[str, tuple[list[int], str | None, int | str | None]] = {}
    for step in engine.steps:
        for request_id, output in step.outputs.items():
            tokens, _, _ = collected.get(request_id, ([], None, None))
            collected[request_id] = (
                tokens + output.new_token_ids,
                output.finish_reason,
                output.stop_reason,
            )
    return collected


def test_scheduler_stops_on_eos_and_frees_blocks(make_engine):
    engine = make_engine(next_token=scripted({"a": [5, 6, EOS, 7, 8]}))
    engine.add("a", [1, 3, 4], eos_token_id=EOS, max_tokens=5)

    assert run_and_collect(engine) == {"a": ([5, 6, EOS], "stop", None)}
    assert len(engine.steps) == 3
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_scheduler_ignores_eos_with_ignore_eos(make_engine):
    engine = make_engine(next_token=scripted({"a": [EOS] * 10}))
    engine.add("a", [1, 3, 4], eos_token_id=EOS, max_tokens=4, ignore_eos=True)

    assert run_and_collect(engine) == {"a": ([EOS] * 4, "length", None)}


def test_scheduler_stops_at_max_tokens(make_engine):
    engine = make_engine()
    engine.add("a", [1, 3, 4], eos_token_id=EOS, max_tokens=6)

    assert run_and_collect(engine) == {"a": (list(range(1000, 1006)), "length", None)}


def test_scheduler_stops_on_a_stop_token_id(make_engine):
    engine = make_engine(next_token=scripted({"a": [5, 77, 6, 7]}))
    engine.add("a", [1, 3, 4], eos_token_id=EOS, max_tokens=4, stop_token_ids=[77])

    assert run_and_collect(engine) == {"a": ([5, 77], "stop", 77)}


def test_scheduler_caps_at_max_model_len(make_engine):
    engine = make_engine(max_model_len=8)
    request = engine.add("a", [1, 3, 4, 5, 6], eos_token_id=EOS, max_tokens=100)

    assert run_and_collect(engine) == {"a": ([1000, 1001, 1002], "length", None)}
    assert request.num_tokens == 8


def test_scheduler_stops_mid_list_and_drops_tokens_after_the_stop(make_engine):
    engine = make_engine()
    request = engine.add("a", [1, 3, 4], eos_token_id=EOS, max_tokens=10)
    so = engine.scheduler.schedule()

    out = engine.scheduler.update_from_output(so, ModelRunnerOutput({"a": [5, EOS, 6, 7]}))

    (output,) = out.outputs
    assert output.new_token_ids == [5, EOS]
    assert output.finish_reason == "stop"
    assert request.output_token_ids == [5, EOS]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_requests_with_different_stops_in_one_batch(make_engine, max_tokens):
    script = {"eos": [EOS, 9, 9], "tok": [9, 33, 9], "len": [9, 9, 9]}
    engine = make_engine(next_token=scripted(script))
    engine.add("eos", [1], eos_token_id=EOS, max_tokens=3)
    engine.add("tok", [1], eos_token_id=EOS, max_tokens=3, stop_token_ids=[33])
    engine.add("len", [1], eos_token_id=EOS, max_tokens=max_tokens)

    collected = run_and_collect(engine)

    assert collected["eos"] == ([EOS], "stop", None)
    assert collected["tok"] == ([9, 33], "stop", 33)
    assert collected["len"] == ([9] * max_tokens, "length", None)
