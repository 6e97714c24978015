"""``vlite run --executor multiproc --tp 2`` prints what ``uniproc`` prints, and leaves no
worker behind although the command never calls ``shutdown()`` (the engine's garbage
collection stops the workers)."""

from __future__ import annotations

import gc

from click.testing import CliRunner

from vlite.cli.main import cli
from vlite.testing.conformance.executor import child_pids
from vlite.testing.engine_runs import cached_tiny_model

ARGS = ("--max-tokens", "12", "--temperature", "0", "The quick brown", "Hello, world!")


def run(*args: str):
    result = CliRunner().invoke(cli, ["run", *args])
    assert result.exit_code == 0, result.output
    return result


def test_run_with_tp2_prints_the_same_text_as_uniproc():
    model = str(cached_tiny_model("LlamaForCausalLM"))
    expected = run("--model", model, "--executor", "uniproc", *ARGS).stdout
    children_before = child_pids()
    result = run("--model", model, "--executor", "multiproc", "--tp", "2", *ARGS)
    assert result.stdout == expected
    assert "[0] The quick brown" in result.stdout
    gc.collect()
    assert child_pids() == children_before


def test_run_with_a_tp_the_model_cannot_split_is_a_one_line_error():
    model = str(cached_tiny_model("LlamaForCausalLM"))
    result = CliRunner().invoke(
        cli, ["run", "--model", model, "--executor", "multiproc", "--tp", "3", "x"]
    )
    assert result.exit_code != 0
    assert "tensor_parallel_size=3 does not divide num_attention_heads=4" in result.output
    assert "Traceback" not in result.output
