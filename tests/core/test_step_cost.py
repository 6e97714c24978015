"""StepCostModel: decode-step times and a prompt token's cost, learnt from finished steps."""

from __future__ import annotations

import pytest

from vlite.core.step_cost import StepCostModel


def test_it_has_no_answer_until_both_figures_are_observed():
    cost = StepCostModel()
    assert cost.prompt_tokens_within(0.05, 8) is None
    cost.observe(8, 0, 0.025)
    assert cost.prompt_tokens_within(0.05, 8) is None  # no prompt token seen yet
    cost.observe(8, 32, 0.057)
    assert cost.seconds_per_prompt_token == pytest.approx(0.001)
    assert cost.prompt_tokens_within(0.045, 8) == 20
    assert cost.prompt_tokens_within(0.020, 8) == 0  # the decodes alone exceed it


def test_a_prompt_only_step_counts_whole():
    cost = StepCostModel()
    cost.observe(0, 100, 0.2)
    assert cost.seconds_per_prompt_token == pytest.approx(0.002)


def test_a_batch_size_not_seen_reads_the_nearest_larger_then_the_largest():
    cost = StepCostModel()
    assert cost.decode_seconds(4) is None
    cost.observe(2, 0, 0.010)
    cost.observe(8, 0, 0.030)
    assert cost.decode_seconds(2) == 0.010
    assert cost.decode_seconds(3) == 0.030
    assert cost.decode_seconds(1) == 0.010
    assert cost.decode_seconds(16) == 0.030


def test_figures_are_moving_averages():
    cost = StepCostModel(smoothing=0.5)
    cost.observe(4, 0, 0.020)
    cost.observe(4, 0, 0.040)
    assert cost.decode_seconds(4) == pytest.approx(0.030)
    cost.observe(4, 10, 0.040)  # 10 tokens over the decodes' 30 ms
    cost.observe(4, 10, 0.060)
    assert cost.seconds_per_prompt_token == pytest.approx((0.001 + 0.003) / 2)


def test_empty_or_timeless_steps_are_ignored_and_bad_smoothing_is_refused():
    cost = StepCostModel()
    cost.observe(0, 0, 0.1)
    cost.observe(4, 0, 0.0)
    assert cost.decode_seconds(4) is None
    with pytest.raises(ValueError, match="smoothing=0"):
        StepCostModel(smoothing=0)


def test_the_estimate_interpolates_between_sizes_seen_and_holds_beyond_them():
    model = StepCostModel()
    assert model.estimated_decode_seconds(3) is None
    model.observe(1, 0, 0.006)
    model.observe(5, 0, 0.014)
    assert model.estimated_decode_seconds(3) == pytest.approx(0.010)
    assert model.estimated_decode_seconds(5) == pytest.approx(0.014)
    # Beyond the sizes seen: the nearest one's (a larger step is tried, then measured).
    assert model.estimated_decode_seconds(9) == pytest.approx(0.014)
    model.observe(2, 0, 0.007)
    assert model.estimated_decode_seconds(1) == pytest.approx(0.006)
    assert model.decode_seconds(3) == pytest.approx(0.014)  # the cap's reading is unchanged
