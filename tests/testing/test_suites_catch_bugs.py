"""The conformance suites fail on deliberately broken plugins (``broken_plugins.py``).

Each test writes a plugin author's test module with pytester (a subclass of a suite naming
a broken plugin), runs it in process, and checks that the tests meant to catch that bug
failed while the plugin itself loaded fine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def _import_everything_first() -> None:
    """Import, in this process, all the inner runs will need.

    An in-process pytester run drops the modules it imported when it ends; importing torch's
    or triton's extension modules a second time crashes the process. Running a tiny model
    end to end here imports them once, before any inner run.
    """
    import broken_plugins  # noqa: F401  (torch, the built-in plugins)

    from vlite.engine.llm import LLM
    from vlite.testing import faults  # noqa: F401
    from vlite.testing.conformance import attention, executor, sampler, scheduler  # noqa: F401
    from vlite.testing.engine_runs import cached_tiny_model, generate_tokens, mixed_prompts

    cached_tiny_model("LlamaForCausalLM", head_dim=32)
    llm = LLM(model=str(cached_tiny_model("LlamaForCausalLM")), num_kv_blocks=16, block_size=4)
    generate_tokens(llm, mixed_prompts(num_prompts=2, max_prompt_len=5, shared_prefix_len=0))


TEST_MODULE = """
import broken_plugins
from vlite.testing import {suite}


class TestBrokenPlugin({suite}):
    plugin_name = {name!r}
    extra_plugins = (broken_plugins,)
{settings}
"""


def run_suite(
    pytester: pytest.Pytester, suite: str, name: str, reports: dict | None = None, **settings
) -> dict[str, str]:
    """Run ``suite`` against broken plugin ``name``; test name -> passed/failed/skipped.

    ``reports``, when given, receives each failed test's report text.
    """
    pytester.syspathinsert(HERE)
    lines = "".join(f"    {key} = {value!r}\n" for key, value in settings.items())
    pytester.makepyfile(
        test_broken_plugin=TEST_MODULE.format(suite=suite, name=name, settings=lines)
    )
    import broken_plugins

    try:
        recorder = pytester.inline_run("-p", "no:cacheprovider")
    finally:
        broken_plugins.RELEASE.set()  # end the threads a hanging executor left
        broken_plugins.RELEASE.clear()
    outcomes: dict[str, str] = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        test_name = report.nodeid.split("::")[-1]
        if report.failed:
            outcomes[test_name] = "failed"
            if reports is not None:
                reports[test_name] = str(report.longrepr)
        else:
            outcomes.setdefault(test_name, "passed")
            if report.skipped:
                outcomes[test_name] = "skipped"
    assert outcomes, "no test ran"
    return outcomes


def assert_caught(outcomes: dict[str, str], expected_failures: set[str]) -> None:
    failed = {name for name, outcome in outcomes.items() if outcome == "failed"}
    assert outcomes["test_plugin_loads_through_a_fresh_plugin_manager"] == "passed"
    assert expected_failures <= failed, f"missed: {expected_failures - failed}; failed: {failed}"


def test_scheduler_suite_catches_a_scheduler_that_overruns_the_budget(pytester):
    outcomes = run_suite(pytester, "SchedulerConformance", "budget-overrunning")
    assert_caught(outcomes, {"test_never_exceeds_token_budget_or_max_num_seqs"})


def test_scheduler_suite_catches_a_scheduler_that_leaks_blocks_on_abort(pytester):
    outcomes = run_suite(pytester, "SchedulerConformance", "abort-leaking")
    assert_caught(outcomes, {"test_no_block_leaks_after_abort", "test_abort_is_idempotent"})
    assert outcomes["test_no_block_leaks_after_finish"] == "passed"


def test_scheduler_suite_catches_a_policy_that_names_a_victim_that_is_not_running(pytester):
    outcomes = run_suite(pytester, "SchedulerConformance", "newest-arrival-victim")
    assert_caught(outcomes, {"test_preemption_frees_blocks_and_later_restores_requests"})


def test_attention_suite_catches_a_backend_that_drops_the_last_cached_block(pytester):
    outcomes = run_suite(pytester, "AttentionBackendConformance", "last-cached-block-dropping")
    assert_caught(
        outcomes,
        {
            "test_cached_prefix_prefill",
            "test_matches_dense_attention_around_block_boundaries[hd64-gqa2-bs16]",
            "test_greedy_tokens_equal_the_reference_backend",
        },
    )
    # Sequences without a cached prefix are unaffected, and so pass.
    assert outcomes["test_matches_dense_attention_decoding_only"] == "passed"


def test_attention_suite_catches_a_backend_that_ignores_the_scale(pytester):
    outcomes = run_suite(pytester, "AttentionBackendConformance", "scale-ignoring")
    assert_caught(outcomes, {"test_uses_the_given_scale"})
    # Built with the default scale it is right, so the other shape tests pass.
    assert outcomes["test_matches_dense_attention_decoding_only"] == "passed"


def test_attention_suite_catches_a_backend_that_attends_before_the_steps_keys_are_written(
    pytester,
):
    outcomes = run_suite(pytester, "AttentionBackendConformance", "per-sequence-writing")
    assert_caught(outcomes, {"test_draft_positions_as_one_token_sequences_over_one_block_table"})
    # Sequences that own their blocks are unaffected.
    assert outcomes["test_matches_dense_attention_decoding_only"] == "passed"


def test_attention_suite_catches_a_backend_that_ignores_the_window(pytester):
    outcomes = run_suite(pytester, "AttentionBackendConformance", "window-ignoring")
    assert_caught(
        outcomes,
        {
            f"test_sliding_window_matches_dense_attention[{window}]"
            for window in ("1", "block-1", "block+3", "3blocks")
        }
        | {"test_logits_soft_cap_matches_dense_attention[5]"},
    )
    assert outcomes["test_logits_soft_cap_matches_dense_attention[None]"] == "passed"


def test_attention_suite_catches_a_graph_claiming_backend_that_reads_host_lists(pytester):
    outcomes = run_suite(pytester, "AttentionBackendConformance", "host-list-graph")
    assert_caught(outcomes, {"test_decode_replays_over_rewritten_metadata"})
    assert outcomes["test_matches_dense_attention_decoding_only"] == "passed"


def test_attention_suite_catches_a_backend_that_rounds_its_float16_keys_coarser(pytester):
    outcomes = run_suite(pytester, "AttentionBackendConformance", "keys-in-bfloat16")
    assert_caught(outcomes, {"test_kv_cache_dtypes_match_attention_over_the_rounded_keys"})
    assert outcomes["test_matches_dense_attention_decoding_only"] == "passed"


def test_attention_suite_catches_a_backend_that_ignores_the_soft_cap(pytester):
    outcomes = run_suite(pytester, "AttentionBackendConformance", "soft-cap-ignoring")
    assert_caught(
        outcomes,
        {
            "test_logits_soft_cap_matches_dense_attention[None]",
            "test_logits_soft_cap_matches_dense_attention[5]",
        },
    )
    assert outcomes["test_sliding_window_matches_dense_attention[3blocks]"] == "passed"


def test_sampler_suite_catches_a_sampler_that_ignores_top_k(pytester):
    outcomes = run_suite(pytester, "SamplerConformance", "top-k-ignoring")
    assert_caught(
        outcomes,
        {
            "test_top_k_keeps_only_the_k_most_likely[1]",
            "test_top_k_keeps_only_the_k_most_likely[3]",
            "test_each_row_follows_its_own_settings",
        },
    )
    assert outcomes["test_top_p_keeps_only_the_nucleus[0.45]"] == "passed"


def test_sampler_suite_shows_the_compared_values_of_a_failed_check(pytester):
    # The suites' asserts are rewritten by pytest: the report names the wrong dtype
    # instead of a bare AssertionError.
    reports: dict[str, str] = {}
    outcomes = run_suite(pytester, "SamplerConformance", "int32-tokens", reports)
    failed = "test_returns_one_int64_token_per_row[greedy-50]"
    assert_caught(outcomes, {failed})
    assert "torch.int32 == torch.int64" in reports[failed]


def test_executor_suite_catches_an_executor_that_returns_wrong_tokens(pytester):
    outcomes = run_suite(pytester, "ExecutorConformance", "wrong-tokens")
    assert_caught(
        outcomes, {"test_greedy_tokens_equal_uniproc", "test_seeded_sampling_equals_uniproc"}
    )


def test_executor_suite_catches_an_executor_that_hangs_on_a_failed_worker(pytester):
    outcomes = run_suite(pytester, "ExecutorConformance", "hanging", hang_timeout_s=2.0)
    assert_caught(outcomes, {"test_worker_exception_surfaces_as_an_error"})
    assert outcomes["test_greedy_tokens_equal_uniproc"] == "passed"


def test_executor_suite_catches_an_executor_that_leaks_a_thread(pytester):
    outcomes = run_suite(pytester, "ExecutorConformance", "thread-leaking", shutdown_timeout_s=0.5)
    assert_caught(outcomes, {"test_shutdown_is_clean_and_idempotent"})
