"""run_workload: arrivals at engine steps, and the latencies and counts it reports."""

from __future__ import annotations

import math
import random

import pytest

from vlite.bench.percentiles import percentile
from vlite.bench.workload import Arrival, random_token_ids, run_workload
from vlite.engine.llm import LLM
from vlite.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("bench-model"), "LlamaForCausalLM")
    engine = LLM(model=str(folder), num_kv_blocks=64).llm_engine
    yield engine
    engine.shutdown()


def test_every_request_is_timed_and_counted(engine):
    rng = random.Random(0)
    arrivals = [Arrival(0, f"r{i}", random_token_ids(rng, 5 + i, 300), 4) for i in range(3)]
    finished = []

    result = run_workload(engine, arrivals, on_request_finished=lambda: finished.append(1))

    assert set(result.ttft_s) == {"r0", "r1", "r2"} and len(finished) == 3
    assert result.num_prompt_tokens == 5 + 6 + 7
    assert result.num_output_tokens == 3 * 4
    # All decode together: one step for the prompts, then three more tokens each.
    assert result.num_steps == 4
    assert all(len(gaps) == 3 for gaps in result.token_gaps_s.values())
    assert all(gap > 0 for gap in result.all_token_gaps_s())
    assert result.output_tokens_per_s == pytest.approx(12 / result.wall_s)
    assert not engine.has_unfinished_requests()


def test_a_later_arrival_joins_at_its_step(engine):
    arrivals = [Arrival(0, "early", [5, 6, 7], 6), Arrival(3, "late", [8, 9, 10], 2)]

    result = run_workload(engine, arrivals)

    # "early" runs steps 0..5; "late" is added before step 3 and is done by step 4.
    assert result.num_steps == 6
    assert result.ttft_s["late"] < result.ttft_s["early"] + result.wall_s
    assert set(result.all_token_gaps_s("la")) == set(result.token_gaps_s["late"])
    assert len(result.token_gaps_s["late"]) == 1


def test_a_gap_between_arrivals_steps_nothing_but_counts_the_step(engine):
    result = run_workload(engine, [Arrival(2, "only", [5, 6, 7], 2)])

    assert result.num_steps == 4  # two idle steps before the arrival, then two
    assert result.num_output_tokens == 2


def test_percentile_interpolates_between_order_statistics_and_is_nan_when_empty():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.5  # halfway between the 50th and 51st values
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values[::-1], 0) == 1.0 and percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_random_token_ids_stay_in_the_vocabulary_above_the_special_ids():
    ids = random_token_ids(random.Random(1), 500, vocab_size=40)
    assert len(ids) == 500 and min(ids) >= 4 and max(ids) < 40
    assert len(set(ids)) > 20
