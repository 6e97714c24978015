"""``/metrics`` rendering: Prometheus' text format from the engine core's statistics."""

from __future__ import annotations

import re

from vlite.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vlite.core.stats import StepTotals, metric_values
from vlite.engine.core_messages import EngineCoreStats
from vlite.server.metrics import RequestHistograms, one_two_five_buckets, render_metrics

SAMPLE = re.compile(
    r'^(?P<name>[a-z_:]+)\{model_name="(?P<model>(?:[^"\\]|\\.)*)"\} (?P<value>\S+)$'
)
BUCKET = re.compile(
    r'^(?P<name>[a-z_:]+)_bucket\{le="(?P<le>[^"]+)",model_name="[^"]*"\} (?P<n>\S+)$'
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
    # Four gauges and a counter on the struct, every total, and the health gauge.
    num_totals = len(list(metric_values(StepTotals())))
    assert num_totals == 11
    # The accepted drafts per position have no series before a draft was verified.
    assert len(samples) == 5 + num_totals - 1 + 1
    assert samples["vlite:engine_healthy"] == ("gauge", "m", 1)


def test_accepted_drafts_per_position_are_one_series_per_position_as_vllm_names_them():
    one = make_stats(totals=StepTotals(num_accepted_tokens_per_pos=(3, 1)))
    other = make_stats(totals=StepTotals(num_accepted_tokens_per_pos=(2,)))
    text = render_metrics([one, other], "m")
    name = "vlite:spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{name}{{model_name="m",position="0"}} 5.0' in text  # the engines' sum
    assert f'{name}{{model_name="m",position="1"}} 1.0' in text
    assert f'{name}{{engine="1",model_name="m",position="0"}} 2.0' in text


def test_a_dead_engine_still_gives_a_valid_answer_saying_so():
    samples = parse(render_metrics(None, "m"))
    assert samples == {"vlite:engine_healthy": ("gauge", "m", 0)}


def finished(arrival, scheduled, token_times, prompt_len) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled)
    for when in token_times:
        metrics.record_tokens(when, 1)
    metrics.finished_time = token_times[-1]
    completion = CompletionOutput(0, "text", list(range(len(token_times))), "length")
    return RequestOutput("r", "p", list(range(prompt_len)), [completion], True, metrics=metrics)


def test_request_histograms_take_each_finished_request_s_timings():
    histograms = RequestHistograms("m", max_model_len=2048)
    histograms.observe(finished(10.0, 10.5, [11.0, 11.02, 11.1], prompt_len=7))
    histograms.observe(finished(20.0, 20.0, [20.004], prompt_len=30))

    text = render_metrics(None, "m", histograms)
    buckets: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        match = BUCKET.match(line)
        if match:
            buckets.setdefault(match["name"], {})[match["le"]] = float(match["n"])

    ttft = buckets["vlite:time_to_first_token_seconds"]
    assert (ttft["0.005"], ttft["0.5"], ttft["1.0"], ttft["+Inf"]) == (1, 1, 2, 2)
    itl = buckets["vlite:inter_token_latency_seconds"]  # gaps of 0.02 s and 0.08 s
    assert (itl["0.01"], itl["0.025"], itl["0.1"]) == (0, 1, 2)
    queue = buckets["vlite:request_queue_time_seconds"]  # 0.5 s and 0 s
    assert (queue["0.3"], queue["0.5"]) == (1, 2)
    prompts = buckets["vlite:request_prompt_tokens"]
    assert (prompts["5.0"], prompts["10.0"], prompts["50.0"]) == (0, 1, 2)
    generated = buckets["vlite:request_generation_tokens"]
    assert (generated["1.0"], generated["2.0"], generated["5.0"]) == (1, 1, 2)


def test_token_count_buckets_go_1_2_5_up_to_the_context():
    assert one_two_five_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert one_two_five_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
