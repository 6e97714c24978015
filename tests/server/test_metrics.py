"""``/metrics`` rendering: Prometheus' text format from the engine core's statistics."""

from __future__ import annotations

import re

from vlite.core.stats import StepTotals
from vlite.engine.core_messages import EngineCoreStats
from vlite.server.metrics import render_metrics

SAMPLE = re.compile(
    r'^(?P<name>[a-z_:]+)\{model_name="(?P<model>(?:[^"\\]|\\.)*)"\} (?P<value>\S+)$'
)


def make_stats(**changes) -> EngineCoreStats:
    totals = StepTotals(
        num_steps=40,
        num_new_prompt_tokens=650,
        num_generation_tokens=120,
        num_prefill_tokens=700,
        num_prefix_cache_queried_tokens=640,
        num_prefix_cache_hit_tokens=256,
        num_preemptions=4,
    )
    fields = dict(
        num_kv_blocks=200,
        num_free_kv_blocks=150,
        kv_cache_usage=0.25,
        num_unfinished_requests=5,
        num_running_requests=3,
        num_waiting_requests=2,
        num_failed_steps=1,
        totals=totals,
    )
    return EngineCoreStats(**{**fields, **changes})


def parse(text: str) -> dict[str, tuple[str, str, float]]:
    """name -> (type, model label, value); checks each sample has HELP and TYPE lines."""
    lines = text.splitlines()
    samples = {}
    for index, line in enumerate(lines):
        match = SAMPLE.match(line)
        if match is None:
            assert line.startswith(("# HELP ", "# TYPE ")), line
            continue
        name = match["name"]
        assert lines[index - 2].startswith(f"# HELP {name} ")
        kind = lines[index - 1].removeprefix(f"# TYPE {name} ")
        samples[name] = (kind, match["model"], float(match["value"]))
    return samples


def test_every_statistic_is_exposed_with_its_type_and_value():
    samples = parse(render_metrics(make_stats(), "tiny"))

    assert samples["vlite:num_requests_running"] == ("gauge", "tiny", 3)
    assert samples["vlite:num_requests_waiting"] == ("gauge", "tiny", 2)
    assert samples["vlite:kv_cache_usage_perc"] == ("gauge", "tiny", 0.25)
    assert samples["vlite:engine_steps_total"] == ("counter", "tiny", 40)
    assert samples["vlite:engine_failed_steps_total"][2] == 1
    assert samples["vlite:prompt_tokens_total"][2] == 650
    assert samples["vlite:generation_tokens_total"][2] == 120
    assert samples["vlite:prefill_tokens_computed_total"][2] == 700
    assert samples["vlite:num_kv_cache_blocks"] == ("gauge", "tiny", 200)
    assert samples["vlite:prefix_cache_queries_total"][2] == 640
    assert samples["vlite:prefix_cache_hits_total"][2] == 256
    assert samples["vlite:num_preemptions_total"] == ("counter", "tiny", 4)
    assert all(
        kind == "counter" for name, (kind, _, _) in samples.items() if name.endswith("_total")
    )


def test_the_model_label_is_escaped():
    text = render_metrics(make_stats(), 'my "model"\\v1')
    model = parse(text)["vlite:engine_steps_total"][1]
    assert model == 'my \\"model\\"\\\\v1'


def test_every_annotated_statistic_is_exposed_once():
    samples = parse(render_metrics(make_stats(), "m"))
    assert len(samples) == 5 + 7  # four gauges and a counter on the struct, seven totals
