"""``vlite plugins check NAME``: runs the matching suite and prints a pass/fail table."""

from __future__ import annotations

from click.testing import CliRunner

from vlite.cli.main import cli
from vlite.testing.suite_runs import check_table_rows as table_rows

TOP_K_IGNORING_SAMPLER = """
import dataclasses

import vlite
from vlite.plugins.samplers.default import DefaultSampler


class TopKIgnoringSampler(DefaultSampler):
    def sample(self, logits, metadata):
        return super().sample(logits, dataclasses.replace(metadata, has_top_k=False))


@vlite.hookimpl
def register_samplers(register):
    register("sloppy", TopKIgnoringSampler)
"""


def check(*args: str):
    return CliRunner().invoke(cli, ["plugins", "check", *args])


def test_check_passes_a_builtin_and_prints_the_table():
    result = check("default")
    assert result.exit_code == 0, result.output
    assert "Checking sampler 'default' (vlite " in result.stdout
    rows = table_rows(result.stdout)
    assert rows["test_plugin_loads_through_a_fresh_plugin_manager"] == "PASSED"
    assert rows["test_top_k_keeps_only_the_k_most_likely[3]"] == "PASSED"
    assert set(rows.values()) == {"PASSED"}
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith(f"PASS: SamplerConformance on sampler 'default': {len(rows)} passed")


def test_check_fails_an_installed_broken_plugin(install_plugin):
    install_plugin("sloppy-sampler", TOP_K_IGNORING_SAMPLER, version="0.3")
    result = check("sloppy")
    assert result.exit_code == 1, result.output
    assert "Checking sampler 'sloppy' (sloppy-sampler 0.3)" in result.stdout
    rows = table_rows(result.stdout)
    assert rows["test_top_k_keeps_only_the_k_most_likely[1]"] == "FAILED"
    assert rows["test_greedy_rows_pick_the_argmax"] == "PASSED"
    assert "which the settings exclude" in result.stdout  # the failure's first line
    assert result.stdout.strip().splitlines()[-1].startswith("FAIL: SamplerConformance")


def test_check_an_unknown_name_lists_the_available_ones():
    result = check("nope")
    assert result.exit_code != 0
    assert "no plugin is registered as 'nope'; available: " in result.stderr
    assert "fcfs" in result.stderr and "uniproc" in result.stderr


def test_check_a_model_runs_the_model_suite():
    result = check("LlamaForCausalLM", "-k", "loads or batch")
    assert result.exit_code == 0, result.output
    assert "Checking model 'LlamaForCausalLM' (vlite " in result.stdout
    assert "with the model conformance suite" in result.stdout
    rows = table_rows(result.stdout)
    assert rows == {
        "test_plugin_loads_through_a_fresh_plugin_manager": "PASSED",
        "test_a_batch_equals_transformers": "PASSED",
    }
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("PASS: ModelConformance on model 'LlamaForCausalLM': 2 passed")


def test_check_a_name_of_several_kinds_needs_kind(install_plugin):
    install_plugin(
        "homonym-plugin",
        """
        import vlite
        from vlite.plugins.samplers.default import DefaultSampler

        @vlite.hookimpl
        def register_samplers(register):
            register("torch", DefaultSampler)
        """,
    )
    result = check("torch")
    assert result.exit_code != 0
    assert "registered as several kinds (attention_backend, sampler); pass --kind" in (
        result.stderr
    )
    result = check("torch", "--kind", "executor")
    assert result.exit_code != 0
    assert "'torch' is registered as attention_backend, sampler, not executor" in result.stderr
