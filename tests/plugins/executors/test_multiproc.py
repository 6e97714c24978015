"""The ``multiproc`` executor: set-up errors, worker deaths, and cleaning up on every exit path.

Token equality with ``uniproc`` (tp=1 and tp=2), shutdown and injected worker faults are
covered by the executor conformance suite (tests/testing/test_builtin_conformance.py);
the oracle against transformers at tp=2 by tests/e2e/test_tp_oracle.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from vlite import LLM, SamplingParams
from vlite.core.config import VliteConfig
from vlite.core.errors import PluginError
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.plugins.executors.multiproc import MultiprocExecutor
from vlite.plugins.executors.worker_pool import WorkerProcessError, threads_per_worker
from vlite.testing.conformance.executor import child_pids
from vlite.testing.engine_runs import cached_tiny_model, call_with_timeout
from vlite.testing.server_process import wait_until_gone

HANG_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return PluginRegistry(build_plugin_manager(load_entry_points=False))


@pytest.fixture(scope="module")
def model() -> str:
    return str(cached_tiny_model("LlamaForCausalLM"))  # 4 heads, 2 KV heads


# ---- errors before any process starts --------------------------------------------------------


def test_uniproc_still_rejects_tensor_parallel(model, registry):
    with pytest.raises(ValueError, match="executor 'uniproc' runs one worker"):
        LLM(model=model, registry=registry, tensor_parallel_size=2)


def test_a_size_the_model_cannot_split_fails_before_starting_workers(model, registry):
    children_before = child_pids()
    with pytest.raises(ValueError) as error:
        LLM(model=model, registry=registry, executor="multiproc", tensor_parallel_size=3)
    message = str(error.value)
    assert "tensor_parallel_size=3" in message
    assert "num_attention_heads=4" in message and "num_key_value_heads=2" in message
    assert "supports tensor_parallel_size in {1, 2}" in message
    assert child_pids() == children_before


def test_a_registry_that_cannot_be_pickled_is_a_clear_error(model):
    class LocalSampler:  # defined in a function: workers could not import it
        def sample(self, logits, metadata):
            return logits.argmax(dim=-1)

    class Plugin:
        @staticmethod
        def register_samplers(register):
            register("local", LocalSampler)

    from vlite.core.hookspecs import hookimpl

    Plugin.register_samplers = hookimpl(Plugin.register_samplers)
    registry = PluginRegistry(build_plugin_manager((Plugin,), load_entry_points=False))
    config = VliteConfig(model=model, executor="multiproc")
    with pytest.raises(PluginError, match="registry to its worker processes.*cannot be pickled"):
        MultiprocExecutor(config, registry)


def test_the_kv_cache_takes_the_smallest_rank_budget():
    class RecordingPool:
        def initialize_kv_cache(self, num_blocks):
            self.num_blocks = num_blocks

    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor.ranks = RecordingPool()
    executor._num_kv_blocks_per_rank = [40, 37]
    assert executor.initialize_kv_cache() == 37
    assert executor.ranks.num_blocks == 37


def test_tensor_parallel_ranks_agree_on_the_cache_and_report_their_memory(model, registry):
    # Each rank sizes its own cache (one of the two KV heads); kv_cache_tokens=40 is three
    # blocks on both, and the plan adds the ranks' bytes up to the whole model's block.
    llm = call_with_timeout(
        lambda: LLM(
            model=model,
            registry=registry,
            executor="multiproc",
            tensor_parallel_size=2,
            kv_cache_tokens=40,
        ),
        HANG_TIMEOUT_S,
        "constructing the engine",
    )
    try:
        core = llm.llm_engine.engine_core
        assert core.executor._num_kv_blocks_per_rank == [3, 3]
        assert core.kv_cache_manager.num_blocks == 3
        plan = llm.llm_engine.memory_plan
        assert plan.num_workers == 2 and plan.kv_cache_blocks == 3
        ranks = core.executor.worker_memory
        assert [rank.kv_cache_block_bytes for rank in ranks] == [2 * 16 * 1 * 16 * 2 * 4] * 2
        assert plan.kv_cache_block_bytes == sum(rank.kv_cache_block_bytes for rank in ranks)
        assert plan.weights_bytes == sum(rank.weights_bytes for rank in ranks) > 0
    finally:
        call_with_timeout(llm.llm_engine.shutdown, HANG_TIMEOUT_S, "shutdown")


def test_threads_are_shared_between_workers():
    num_cpus = len(os.sched_getaffinity(0))
    assert threads_per_worker(1) == num_cpus
    assert threads_per_worker(2) == max(1, num_cpus // 2)
    assert threads_per_worker(num_cpus * 4) == 1


# ---- a worker killed mid-run -----------------------------------------------------------------


def test_a_worker_killed_mid_run_raises_naming_the_rank(model, registry):
    llm = call_with_timeout(
        lambda: LLM(model=model, registry=registry, executor="multiproc", tensor_parallel_size=2),
        HANG_TIMEOUT_S,
        "constructing the engine",
    )
    pool = llm.llm_engine.engine_core.executor.pool
    pids = [process.pid for process in pool.processes]

    def kill_rank_one_after_three_steps(record):
        if len(kill_rank_one_after_three_steps.steps) == 2:
            os.kill(pids[1], signal.SIGKILL)
        kill_rank_one_after_three_steps.steps.append(record)

    kill_rank_one_after_three_steps.steps = []
    llm.llm_engine.add_step_observer(kill_rank_one_after_three_steps)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}] * 3
    try:
        with pytest.raises(WorkerProcessError) as error:
            call_with_timeout(lambda: llm.generate(prompts, params), HANG_TIMEOUT_S, "generate")
        message = str(error.value)
        assert message.startswith(
            f"worker rank 1 (pid {pids[1]}) failed: it was killed by signal SIGKILL"
        )
        assert len(kill_rank_one_after_three_steps.steps) == 3
        with pytest.raises(WorkerProcessError, match="failed earlier: worker rank 1"):
            llm.generate(prompts, params)
    finally:
        call_with_timeout(llm.llm_engine.shutdown, HANG_TIMEOUT_S, "shutdown")
    assert wait_until_gone(pids) == []


# ---- exits without shutdown() ----------------------------------------------------------------

_EXIT_WITHOUT_SHUTDOWN = """
    import json, sys
    from vlite import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], executor="multiproc")  # kept alive until exit
        out = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0))
        pool = llm.llm_engine.engine_core.executor.pool
        print(json.dumps([p.pid for p in pool.processes]), flush=True)
"""


def test_an_interpreter_exit_without_shutdown_stops_the_workers(model, tmp_path):
    script = tmp_path / "exit_without_shutdown.py"
    script.write_text(textwrap.dedent(_EXIT_WITHOUT_SHUTDOWN))
    completed = subprocess.run(
        [sys.executable, str(script), model], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    pids = json.loads(completed.stdout.strip().splitlines()[-1])
    assert len(pids) == 1
    assert wait_until_gone(pids) == []
