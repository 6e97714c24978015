"""The ``vlite`` CLI through click's runner and as a subprocess, on a tiny model."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from vlite.cli.main import cli
from vlite.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("cli-model"), "LlamaForCausalLM"))


def invoke(*args: str, input: str | None = None, env: dict | None = None):
    return CliRunner().invoke(cli, list(args), input=input, env=env)


def test_run_prints_each_completion_and_a_summary(tiny_model):
    result = invoke("run", "--model", tiny_model, "Hello", "The quick brown", "--max-tokens", "5")
    assert result.exit_code == 0, result.output
    assert "[0] Hello" in result.stdout
    assert "[1] The quick brown" in result.stdout
    # What "auto" picked on the CPU, and the cache a checkpoint keeps in its own dtype.
    assert "attention backend: cpu (KV cache in float32)" in result.stderr
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("2 requests, ")
    assert "10 output tokens" in summary
    assert "output tokens/s" in summary and "mean TTFT" in summary


def test_run_json_prints_one_parsable_object_per_request(tiny_model):
    result = invoke("run", "--model", tiny_model, "--json", "a", "b", "c", "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["a", "b", "c"]
    assert all(r["num_output_tokens"] == 3 and len(r["token_ids"]) == 3 for r in records)
    assert all(r["finish_reason"] in ("length", "stop") for r in records)


def test_run_reads_jsonl_with_per_request_fields(tiny_model, tmp_path):
    lines = [
        {"prompt": "one", "max_tokens": 2, "ignore_eos": True},
        {"prompt": "two", "max_tokens": 4, "ignore_eos": True, "priority": 1},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = invoke("run", "--model", tiny_model, "--input", str(path), "--json")
    assert result.exit_code == 0, result.output
    counts = [json.loads(line)["num_output_tokens"] for line in result.stdout.splitlines()]
    assert counts == [2, 4]


def test_run_sampling_flags_and_jsonl_fields_reach_the_requests(tiny_model, tmp_path):
    lines = [
        {
            "prompt": "one",
            "max_tokens": 3,
            "ignore_eos": True,
            "n": 2,
            "seed": 1,
            "temperature": 1.0,
            "min_p": 0.05,
            "presence_penalty": 0.5,
        },
        {
            "prompt": "two",
            "max_tokens": 4,
            "ignore_eos": True,
            "logprobs": 2,
            "frequency_penalty": 0.3,
            "repetition_penalty": 1.2,
            "min_tokens": 4,
        },
    ]
    path = tmp_path / "sampling.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = invoke(
        "run",
        "--model",
        tiny_model,
        "--input",
        str(path),
        "--json",
        "--logprobs",
        "1",
        "--repetition-penalty",
        "1.1",
    )
    assert result.exit_code == 0, result.output
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert [len(s["token_ids"]) for s in first["samples"]] == [3, 3]
    assert first["token_ids"] == first["samples"][0]["token_ids"]
    assert len(first["logprobs"]) == 3  # --logprobs 1 applies where the line does not say
    assert all(len(position) <= 2 for position in first["logprobs"])
    assert "samples" not in second and len(second["logprobs"]) == 4
    sampled = [position[0] for position in second["logprobs"]]
    assert [p["token_id"] for p in sampled] == second["token_ids"]
    assert abs(sum(p["logprob"] for p in sampled) - second["cumulative_logprob"]) < 1e-6


def test_run_prints_every_sample_of_n(tiny_model):
    result = invoke(
        "run", "--model", tiny_model, "--n", "2", "--temperature", "1", "--max-tokens", "3", "Hi"
    )
    assert result.exit_code == 0, result.output
    assert "--- sample 0 ---" in result.stdout and "--- sample 1 ---" in result.stdout
    assert "6 output tokens" in result.stderr


def test_run_rejects_a_bad_penalty_naming_it(tiny_model):
    result = invoke("run", "--model", tiny_model, "--presence-penalty", "3", "Hi")
    assert result.exit_code != 0
    assert "presence_penalty=3.0" in result.output


def test_run_reads_plain_lines_from_stdin(tiny_model):
    result = invoke(
        "run", "--model", tiny_model, "--json", "--max-tokens", "2", input="first\n\nsecond\n"
    )
    assert result.exit_code == 0, result.output
    prompts = [json.loads(line)["prompt"] for line in result.stdout.splitlines()]
    assert prompts == ["first", "second"]


def test_run_chat_applies_the_chat_template(tiny_model):
    result = invoke(
        "run", "--model", tiny_model, "--chat", "--json", "--max-tokens", "2", "Hi there"
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    # The tiny template wraps the message in "<|user|>\n...\n<|assistant|>\n".
    assert record["num_prompt_tokens"] > 4


def test_run_chat_generates_until_the_context_ends_without_max_tokens(tiny_model):
    # A random model rarely ends its answer: the context (200 tokens here) ends it, past
    # plain completion's default of 64 and below the chat cap.
    result = invoke(
        "run", "--model", tiny_model, "--chat", "--json", "--max-model-len", "200", "Hi there"
    )
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["finish_reason"] == "length"
    assert record["num_prompt_tokens"] + record["num_output_tokens"] == 200
    # The cache was sized for the whole context (the chat cap of 1024 is beyond it).
    assert kv_cache_blocks(result.stderr) == -(-200 // BLOCK_SIZE)


def test_run_chat_stops_at_the_stated_cap(tiny_model, monkeypatch):
    from vlite.cli import run

    monkeypatch.setattr(run, "CHAT_MAX_TOKENS", 7)
    result = invoke("run", "--model", tiny_model, "--chat", "--json", "--ignore-eos", "Hi")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_output_tokens"] == 7


def test_run_plain_completion_keeps_a_short_default(tiny_model):
    from vlite.cli.run import COMPLETION_MAX_TOKENS

    result = invoke("run", "--model", tiny_model, "--json", "--ignore-eos", "Hi")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_output_tokens"] == COMPLETION_MAX_TOKENS


BLOCK_SIZE = 16  # the default


def kv_cache_blocks(stderr: str) -> int:
    """The KV-cache blocks of the memory plan a command printed."""
    match = re.search(r"^memory: weights [\d.]+ \w+, KV cache (\d+) blocks? x ", stderr, re.M)
    assert match, stderr
    return int(match.group(1))


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def test_run_sizes_the_kv_cache_to_its_requests(tiny_model):
    prompts = ["a", "the quick brown fox jumps over the lazy dog", "hello there"]
    result = invoke("run", "--model", tiny_model, "--json", "--max-tokens", "9", *prompts)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    expected = sum(blocks_for(r["num_prompt_tokens"] + 9) for r in records)
    assert kv_cache_blocks(result.stderr) == expected
    plan = re.search(r"KV cache (\d+) blocks? x .* \((\d+) tokens\)", result.stderr)
    assert int(plan.group(2)) == expected * BLOCK_SIZE


def test_run_sizes_for_every_sample_and_at_most_max_num_seqs_at_once(tiny_model):
    prompts = ["a", "the quick brown fox jumps over the lazy dog"]
    args = ["run", "--model", tiny_model, "--json", "--max-tokens", "20", "--ignore-eos"]
    result = invoke(*args, "--n", "2", *prompts)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    per_request = [blocks_for(record["num_prompt_tokens"] + 20) for record in records]
    assert kv_cache_blocks(result.stderr) == 2 * sum(per_request)
    # One sequence at a time: the largest alone, and both requests still run.
    result = invoke(*args, "--max-num-seqs", "1", *prompts)
    assert result.exit_code == 0, result.output
    assert kv_cache_blocks(result.stderr) == max(per_request)
    counts = [json.loads(line)["num_output_tokens"] for line in result.stdout.splitlines()]
    assert counts == [20, 20]


def test_run_keeps_a_cache_size_the_user_set(tiny_model):
    result = invoke("run", "--model", tiny_model, "--num-kv-blocks", "9", "--max-tokens", "2", "x")
    assert result.exit_code == 0, result.output
    assert kv_cache_blocks(result.stderr) == 9


def test_run_refuses_a_request_larger_than_the_cache_it_was_given(tiny_model):
    # A user-set kv_cache_tokens of one block: "Hello" and 40 new tokens need three.
    result = invoke(
        "run", "--model", tiny_model, "--kv-cache-tokens", "16", "--max-tokens", "40", "Hello"
    )
    assert result.exit_code == 2, result.output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1, result.stderr
    assert "may need 3 KV-cache blocks but the cache has 1 of 16 tokens" in error_lines[0]


def test_run_help_explains_the_kv_cache_defaults():
    text = " ".join(invoke("run", "--help").output.split())
    assert "vlite run sets what its requests can use" in text
    assert "the KV cache holds what they can use" in text
    assert "2 GiB on CPU" in text


def test_run_help_states_both_max_tokens_defaults():
    from vlite.cli.run import CHAT_MAX_TOKENS, COMPLETION_MAX_TOKENS

    result = invoke("run", "--help")
    text = " ".join(result.output.split())
    assert f"Default: {COMPLETION_MAX_TOKENS} for plain completion" in text
    assert f"with --chat, until the model ends its answer, at most {CHAT_MAX_TOKENS}" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scheduler", "nope"], "unknown scheduler 'nope'; available:"),
        (["--attn", "nope"], "unknown attention_backend 'nope'; available:"),
        (["--block-size", "3"], "invalid block_size=3: must be a power of two"),
        (["--temperature", "-1"], "SamplingParams.temperature=-1.0 is invalid"),
        (["--max-model-len", "100000"], "exceeds the model's max_position_embeddings=512"),
    ],
)
def test_bad_flags_fail_with_a_one_line_error(tiny_model, args, message):
    result = invoke("run", "--model", tiny_model, *args, "x")
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr


def test_a_request_that_cannot_run_is_one_line_and_exit_status_2(tiny_model):
    # A 12-word prompt cannot fit a token budget of 8 without chunked prefill.
    prompt = "one two three four five six seven eight nine ten eleven twelve"
    result = invoke(
        "run", "--model", tiny_model, "--max-num-batched-tokens", "8", "--max-tokens", "2", prompt
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1 and "max_num_batched_tokens=8" in error_lines[0], result.stderr


def test_missing_model_folder_is_a_clear_error(tmp_path):
    result = invoke("run", "--model", str(tmp_path / "absent"), "x")
    assert result.exit_code != 0
    assert "Traceback" not in result.output


def test_run_as_a_subprocess(tiny_model):
    completed = subprocess.run(
        [sys.executable, "-m", "vlite", "run", "--model", tiny_model, "--json", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["prompt"] == "hi"


def test_bad_flag_as_a_subprocess_exits_nonzero_without_traceback(tiny_model):
    completed = subprocess.run(
        [sys.executable, "-m", "vlite", "run", "--model", tiny_model, "--tp", "0", "x"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr
    assert "tensor_parallel_size" in completed.stderr


def test_plugins_list_shows_every_builtin():
    result = invoke("plugins", "list")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.stdout.splitlines()[1:]]
    kinds_and_names = {(row[0], row[1]) for row in rows}
    assert ("scheduler", "fcfs") in kinds_and_names
    assert ("attention_backend", "torch") in kinds_and_names
    assert ("model", "Qwen3ForCausalLM") in kinds_and_names
    packages = {(row[0], row[1]): row[2] for row in rows}
    assert packages[("scheduler", "fcfs")] == packages[("sampler", "default")] == "vlite"


def show(*args: str, env: dict | None = None) -> dict[str, tuple[str, str]]:
    result = invoke("config", "show", *args, env=env)
    assert result.exit_code == 0, result.output
    values = {}
    for line in result.stdout.splitlines():
        name, value, *_ = line.split()
        values[name] = (value, line.rsplit("(", 1)[1].rstrip(")"))
    return values


def test_config_precedence_file_then_environment_then_flag(tmp_path):
    path = tmp_path / "vlite.toml"
    path.write_text("max_num_seqs = 7\nblock_size = 32\nscheduler = 'fcfs'\n")
    assert show()["max_num_seqs"] == ("256", "default")
    assert show("--config", str(path))["max_num_seqs"] == ("7", "config file")
    env = {"VLITE_MAX_NUM_SEQS": "9"}
    assert show("--config", str(path), env=env)["max_num_seqs"] == ("9", "environment")
    assert show("--config", str(path), "--max-num-seqs", "11", env=env)["max_num_seqs"] == (
        "11",
        "flag",
    )
    assert show("--config", str(path), env=env)["block_size"] == ("32", "config file")


def test_config_file_errors_name_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("max_num_seqs = \n")
    result = invoke("config", "show", "--config", str(path))
    assert result.exit_code != 0
    assert str(path) in result.stderr and "not valid TOML" in result.stderr


def test_run_with_the_default_model_prints_english():
    result = invoke("run", "The capital of France is", "--max-tokens", "6")
    assert result.exit_code == 0, result.output
    completion = result.stdout.split("\n", 1)[1]
    assert "Paris" in completion


def test_a_bug_during_model_load_keeps_its_traceback(tiny_model, monkeypatch):
    """Only vlite's own refusals become one-line errors: a plain ValueError from a bug is
    not reported as bad input."""
    from vlite.cli import run

    def buggy_build(config, tokenizer):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(run, "_build_llm", buggy_build)
    result = invoke("run", "--model", tiny_model, "--max-tokens", "2", "x")
    assert result.exit_code == 1
    assert isinstance(result.exception, ValueError)
    assert "Refused" not in result.output and "Error: an internal" not in result.stderr


def test_a_setting_the_model_cannot_run_with_is_a_config_error(tiny_model):
    from vlite import LLM
    from vlite.core.errors import ConfigError

    with pytest.raises(ConfigError, match="max_model_len=100000 exceeds"):
        LLM(model=tiny_model, max_model_len=100000)


def test_run_input_help_names_every_field_a_jsonl_line_takes():
    from vlite.core.sampling_params import SAMPLING_PARAM_NAMES

    text = "".join(invoke("run", "--help").output.split())
    for name in (*SAMPLING_PARAM_NAMES, "priority"):
        assert name.replace("_", "") in text.replace("_", ""), name


def test_run_takes_no_more_sequences_at_once_than_its_requests_have():
    from vlite import SamplingParams
    from vlite.cli.run import sized_for_requests
    from vlite.core.config import VliteConfig

    prompts = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4]}]
    params = [SamplingParams(max_tokens=8, n=2), SamplingParams(max_tokens=8)]
    config = sized_for_requests(VliteConfig(max_num_seqs=256), 2048, prompts, params)
    assert config.max_num_seqs == 3 and config.kv_cache_tokens is not None
    kept = sized_for_requests(VliteConfig(max_num_seqs=2, num_kv_blocks=9), 2048, prompts, params)
    assert kept.max_num_seqs == 2 and kept.num_kv_blocks == 9
