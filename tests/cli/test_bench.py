"""``vlite bench`` on a tiny model."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from vlite.cli.main import cli
from vlite.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("bench-model"), "Qwen2ForCausalLM"))


def invoke(*args: str):
    return CliRunner().invoke(cli, ["bench", *args])


def test_bench_json_reports_the_workload_it_ran(tiny_model):
    result = invoke(
        "--model", tiny_model, "--num-prompts", "4", "--input-len", "12", "--output-len", "3",
        "--json", "--no-warmup",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["num_requests"] == 4
    assert summary["num_prompt_tokens"] == 4 * 12
    assert summary["num_output_tokens"] == 4 * 3
    assert summary["num_steps"] == 3
    assert summary["output_tokens_per_s"] > 0 and summary["ttft_ms"]["p99"] > 0
    assert summary["attention_backend"] == "cpu" and summary["scheduler"] == "fcfs"


def test_bench_with_spaced_arrivals_and_a_scheduler_prints_a_table(tiny_model):
    result = invoke(
        "--model", tiny_model, "--num-prompts", "3", "--input-len", "8", "--output-len", "2",
        "--arrive-every", "5", "--scheduler", "priority",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "3 requests of 8 prompt + 2 output tokens, arriving one every 5 steps" in result.stdout
    assert "scheduler priority" in result.stdout
    for label in ("throughput", "TTFT (ms)", "ITL (ms)"):
        assert label in result.stdout
    assert "12 steps" in result.stdout  # arrivals at steps 0, 5, 10; the last runs 2


def test_bench_rejects_a_prompt_longer_than_the_model_allows(tiny_model):
    result = invoke("--model", tiny_model, "--input-len", "600", "--max-model-len", "512")
    assert result.exit_code != 0
    assert "max_model_len=512" in result.output


def test_bench_rejects_a_non_positive_count(tiny_model):
    result = invoke("--model", tiny_model, "--num-prompts", "0")
    assert result.exit_code == 2
    assert "--num-prompts" in result.output


def test_bench_reports_speculative_decodings_acceptance(tiny_model):
    spec = '{"method": "ngram", "prompt_lookup_min": 1, "num_speculative_tokens": 3}'
    args = ["--model", tiny_model, "--num-prompts", "4", "--input-len", "24", "--output-len", "8"]
    result = invoke(*args, "--no-warmup", "--json", "--speculative-config", spec)
    assert result.exit_code == 0, result.output
    speculative = json.loads(result.stdout)["speculative"]
    assert speculative["method"] == "ngram"
    assert 0 <= speculative["num_accepted_tokens"] <= speculative["num_draft_tokens"]
    table = invoke(*args, "--no-warmup", "--speculative-config", spec)
    assert "speculative decoding (ngram):" in table.stdout
