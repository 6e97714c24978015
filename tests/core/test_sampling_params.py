"""SamplingParams: validation messages, normalization, and the wire round trip."""

from __future__ import annotations

import msgspec
import pytest

from vlite.core.request import EngineCoreRequest
from vlite.core.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("max_tokens", 0, "an integer >= 1"),
        ("max_tokens", -1, "an integer >= 1"),
        ("max_tokens", 1.5, "an integer >= 1"),
        ("temperature", -0.1, "a number >= 0"),
        ("temperature", "hot", "a number >= 0"),
        ("top_p", 0, "a number in (0, 1]"),
        ("top_p", 1.5, "a number in (0, 1]"),
        ("top_k", -2, "an integer >= 0, or -1"),
        ("top_k", 2.5, "an integer >= 0, or -1"),
        ("seed", "x", "None or an integer"),
        ("stop", [""], "non-empty string"),
        ("stop", "", "non-empty string"),
        ("stop", [1], "non-empty string"),
        ("stop_token_ids", [-1], "a list of integers >= 0"),
        ("stop_token_ids", [1, "2"], "a list of integers >= 0"),
        ("n", 0, "an integer >= 1"),
        ("n", 2.0, "an integer >= 1"),
        ("presence_penalty", 2.5, "a number in [-2, 2]"),
        ("presence_penalty", None, "a number in [-2, 2]"),
        ("frequency_penalty", -2.1, "a number in [-2, 2]"),
        ("repetition_penalty", 0, "a number > 0"),
        ("repetition_penalty", -1.0, "a number > 0"),
        ("min_p", -0.1, "a number in [0, 1]"),
        ("min_p", 1.1, "a number in [0, 1]"),
        ("min_tokens", -1, "an integer >= 0 and <= max_tokens (16)"),
        ("min_tokens", 17, "an integer >= 0 and <= max_tokens (16)"),
        ("logprobs", -1, "None or an integer in [0, 20]"),
        ("logprobs", 21, "None or an integer in [0, 20]"),
        ("logprobs", True, "None or an integer in [0, 20]"),
    ],
)
def test_bad_value_raises_naming_field_value_and_what_is_allowed(field, value, allowed):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})

    message = str(excinfo.value)
    assert f"{field}={value!r}" in message
    assert allowed in message


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_tokens": 1},
        {"temperature": 0},
        {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
        {"temperature": 2, "top_p": 0.01, "top_k": 1},
        {"seed": 0},
        {"seed": -5},
        {"stop": ["a", "bc"], "stop_token_ids": [0, 7]},
        {"ignore_eos": True},
        {"n": 4, "presence_penalty": -2, "frequency_penalty": 2.0, "repetition_penalty": 0.5},
        {"min_p": 1.0, "min_tokens": 16, "logprobs": 0},
        {"logprobs": 20, "min_tokens": 0, "min_p": 0},
    ],
)
def test_good_values_are_accepted_unchanged(kwargs):
    params = SamplingParams(**kwargs)

    for field, value in kwargs.items():
        assert getattr(params, field) == value


def test_defaults():
    params = SamplingParams()

    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == 0
    assert params.seed is None
    assert params.stop == []
    assert params.stop_token_ids == []
    assert params.ignore_eos is False
    assert not params.is_greedy


def test_single_stop_string_is_normalized_to_a_list():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_top_k_minus_one_is_normalized_to_zero():
    assert SamplingParams(top_k=-1).top_k == 0


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


def test_msgspec_round_trip_through_engine_core_request_preserves_everything():
    params = SamplingParams(
        max_tokens=7,
        temperature=0.3,
        top_p=0.9,
        top_k=-1,
        seed=42,
        stop="###",
        stop_token_ids=[5, 9],
        ignore_eos=True,
    )
    request = EngineCoreRequest(
        "req-1", [1, 2, 3], params, eos_token_id=2, arrival_time=12.5, priority=-3
    )

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)

    assert decoded == request
    assert decoded.sampling_params == SamplingParams(
        max_tokens=7,
        temperature=0.3,
        top_p=0.9,
        top_k=0,
        seed=42,
        stop=["###"],
        stop_token_ids=[5, 9],
        ignore_eos=True,
    )
    assert (decoded.eos_token_id, decoded.arrival_time, decoded.priority) == (2, 12.5, -3)


def test_msgspec_round_trip_with_defaults():
    request = EngineCoreRequest("r", [4], SamplingParams())

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)

    assert decoded == request
    assert decoded.eos_token_id is None


def test_invalid_params_on_the_wire_are_rejected_when_decoded():
    wire = msgspec.msgpack.encode(["r", [1], {"max_tokens": 0, "temperature": 1.0}])

    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        msgspec.msgpack.decode(wire, type=EngineCoreRequest)


def test_the_later_options_default_to_off():
    params = SamplingParams()

    assert (params.n, params.min_tokens, params.logprobs) == (1, 0, None)
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert (params.repetition_penalty, params.min_p) == (1.0, 0.0)
    assert not params.has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(presence_penalty=-0.1).has_penalties


def test_each_sample_of_n_gets_its_own_seed():
    params = SamplingParams(n=3, seed=10, temperature=0.7)

    samples = [params.for_sample(index) for index in range(3)]

    assert [s.seed for s in samples] == [10, 11, 12]
    assert all(s.n == 1 and s.temperature == 0.7 for s in samples)
    assert SamplingParams(n=2).for_sample(1).seed is None
    assert params.n == 3  # unchanged


def test_msgspec_round_trip_keeps_the_later_options():
    params = SamplingParams(
        n=2,
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.3,
        min_p=0.1,
        min_tokens=4,
        logprobs=5,
    )
    request = EngineCoreRequest("r", [4], params)

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=EngineCoreRequest)

    assert decoded.sampling_params == params
