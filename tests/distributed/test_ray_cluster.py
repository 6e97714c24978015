"""The ``ray`` executor on a two-node Ray cluster (two raylets on this machine).

Each node holds one ``vlite_slot`` resource and every rank's bundle asks for one, so the two
tensor-parallel ranks land on different nodes and meet over TCP. Checked: transformers'
greedy tokens across the nodes; a rank's actor killed, and the worker node lost, each become
an error naming the rank and its node within 2 s; nothing is left in the cluster after
shutdown, and the cluster itself shuts down. The same for two data-parallel engine cores as
Ray actors, one on each node.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import time
from pathlib import Path
from types import ModuleType

import pytest

from vlite import LLM, SamplingParams
from vlite.core.config import VliteConfig
from vlite.engine.async_llm import AsyncLLM
from vlite.engine.exceptions import EngineDeadError
from vlite.plugins.executors.ray.failures import RayWorkerError
from vlite.testing.engine_runs import call_with_timeout
from vlite.testing.tiny_models import make_tiny_model

HANG_TIMEOUT_S = 120.0
#: The issue's bound on noticing a lost rank; measured well under it (see the report).
DETECTION_BOUND_S = 2.0
NODE_ARGS = dict(num_cpus=1, resources={"vlite_slot": 1}, object_store_memory=80 << 20)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def load_tp_oracle() -> ModuleType:
    """tests/e2e/test_tp_oracle.py, for its prompts and transformers' greedy tokens."""
    path = Path(__file__).parents[1] / "e2e" / "test_tp_oracle.py"
    spec = importlib.util.spec_from_file_location("_tp_oracle_for_ray_cluster", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cluster():
    """A head node and one worker node, this process connected as the driver."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(NODE_ARGS, include_dashboard=False))
    cluster.add_node(**NODE_ARGS)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    processes = [
        info.process
        for node in cluster.list_all_nodes()
        for infos in node.all_processes.values()
        for info in infos
    ]
    cluster.shutdown()
    assert [process.pid for process in processes if process.poll() is None] == []


@pytest.fixture(scope="module")
def oracle_case(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A tiny Llama (MHA, untied, biases), the oracle's prompts and transformers' tokens."""
    oracle = load_tp_oracle()
    architecture, settings = oracle.MODELS["llama-mha-untied-biases"]
    folder = make_tiny_model(tmp_path_factory.mktemp("llama"), architecture, **settings)
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    prompts = oracle.make_prompts(vocab_size)
    return folder, prompts, oracle.hf_greedy(folder, prompts)


def start_engine(folder: Path, tp: int = 2, pp: int = 1) -> LLM:
    """tp=2 (or pp=2), one rank per node (each bundle takes a node's only ``vlite_slot``)."""
    return call_with_timeout(
        lambda: LLM(
            model=str(folder),
            executor="ray",
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            cpu_threads=1,
            num_kv_blocks=10,
            ray_bundle_resources=("vlite_slot=1",),
        ),
        HANG_TIMEOUT_S,
        f"constructing a tp={tp} x pp={pp} engine over two nodes",
    )


def shut_down(llm: LLM) -> None:
    call_with_timeout(llm.llm_engine.shutdown, HANG_TIMEOUT_S, "shutdown")


def nothing_left_in_the_cluster() -> None:
    """No live actor and no placement group (actors from the GCS: the state API needs the
    dashboard, which the test cluster does not run)."""
    from ray._private import state

    assert [a for a in state.actors().values() if a["State"] != "DEAD"] == []
    groups = ray.util.placement_group_table().values()
    assert [g for g in groups if g["state"] != "REMOVED"] == []


def worker_node(cluster):
    (node,) = cluster.worker_nodes
    return node


def rank_on(llm: LLM, node_id: str) -> int:
    locations = llm.llm_engine.engine_core.executor.group.locations
    (rank,) = [rank for rank, location in locations.items() if location.node_id == node_id]
    return rank


def run_until_failure(llm: LLM, prompts, fail_after_steps: int, fail) -> tuple[Exception, float]:
    """Generate; after ``fail_after_steps`` steps call ``fail()``. The error and how long
    after ``fail()`` it was raised."""
    steps = []
    failed_at: list[float] = []

    def observer(record) -> None:
        steps.append(record)
        if len(steps) == fail_after_steps:
            fail()
            failed_at.append(time.monotonic())

    llm.llm_engine.add_step_observer(observer)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with pytest.raises(RayWorkerError) as error:
        call_with_timeout(
            lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params),
            HANG_TIMEOUT_S,
            "generate",
        )
    return error.value, time.monotonic() - failed_at[0]


# ---- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_two_ranks_over_two_nodes_give_transformers_tokens(cluster, oracle_case, tp, pp):
    folder, prompts, expected = oracle_case
    llm = start_engine(folder, tp, pp)
    try:
        locations = llm.llm_engine.engine_core.executor.group.locations
        assert {location.node_id for location in locations.values()} == {
            node.node_id for node in cluster.list_all_nodes()
        }
        params = SamplingParams(max_tokens=len(expected[0]), temperature=0.0, ignore_eos=True)
        outputs = call_with_timeout(
            lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params),
            HANG_TIMEOUT_S,
            "generate",
        )
        assert [out.outputs[0].token_ids for out in outputs] == expected
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    finally:
        shut_down(llm)
    nothing_left_in_the_cluster()


def test_a_killed_rank_actor_is_an_error_naming_the_rank_and_its_node(cluster, oracle_case):
    folder, prompts, _ = oracle_case
    llm = start_engine(folder)
    try:
        location = llm.llm_engine.engine_core.executor.group.locations[1]
        error, seconds = run_until_failure(
            llm, prompts, 2, lambda: os.kill(location.pid, signal.SIGKILL)
        )
        message = str(error)
        print(f"\nkilled actor of rank 1: error after {seconds:.3f} s")
        assert message.startswith(
            f"worker rank 1 (Ray actor pid {location.pid} on node {location.node_ip}, "
            f"node id {location.node_id}) failed: its Ray actor is gone"
        ), message
        assert seconds < DETECTION_BOUND_S
        with pytest.raises(RayWorkerError, match="failed earlier: worker rank 1"):
            llm.generate("Hello", SamplingParams(max_tokens=2))
    finally:
        shut_down(llm)
    nothing_left_in_the_cluster()


def test_losing_the_worker_node_is_an_error_naming_the_rank_and_the_node(cluster, oracle_case):
    folder, prompts, _ = oracle_case
    node = worker_node(cluster)
    llm = start_engine(folder)
    try:
        rank = rank_on(llm, node.node_id)
        error, seconds = run_until_failure(llm, prompts, 2, lambda: cluster.remove_node(node))
        message = str(error)
        print(f"\nremoved the worker node: error after {seconds:.3f} s")
        assert message.startswith(f"worker rank {rank} (Ray actor pid "), message
        assert f"node id {node.node_id}) failed: its Ray actor is gone" in message
        assert "node has died" in message
        assert seconds < DETECTION_BOUND_S
    finally:
        shut_down(llm)
        cluster.add_node(**NODE_ARGS)  # the cluster as the other tests expect it
        cluster.wait_for_nodes()
    nothing_left_in_the_cluster()


# ---- data-parallel engine cores as Ray actors ------------------------------------------------


def start_ray_cores(folder: Path) -> AsyncLLM:
    """Two engine cores, one per node (each core's bundle takes its node's ``vlite_slot``)."""
    config = VliteConfig(model=str(folder), cpu_threads=1, num_kv_blocks=10)
    return call_with_timeout(
        lambda: AsyncLLM(
            config,
            data_parallel_size=2,
            data_parallel_backend="ray",
            data_parallel_resources=("vlite_slot=1",),
        ),
        HANG_TIMEOUT_S,
        "starting two engine cores as Ray actors",
    )


async def greedy_tokens(engine: AsyncLLM, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    final = None
    async for output in engine.generate({"prompt_token_ids": prompt}, params):
        final = output
    return final.outputs[0].token_ids


def test_data_parallel_cores_on_two_nodes_give_transformers_tokens(cluster, oracle_case):
    folder, prompts, expected = oracle_case
    engine = start_ray_cores(folder)
    try:
        nodes = [info.node for info in engine.engine_infos]
        assert {node.split("node id ")[1] for node in nodes} == {
            node.node_id for node in cluster.list_all_nodes()
        }, nodes

        async def all_prompts():
            before = await engine.get_engine_stats()
            tokens = await asyncio.gather(
                *(greedy_tokens(engine, prompt, len(expected[0])) for prompt in prompts)
            )
            return before, tokens, await engine.get_engine_stats()

        before, tokens, after = asyncio.run(asyncio.wait_for(all_prompts(), HANG_TIMEOUT_S))
        assert tokens == expected
        admitted = [b.totals.num_new_prompt_tokens - a.totals.num_new_prompt_tokens
                    for a, b in zip(before, after)]  # fmt: skip
        assert all(count > 0 for count in admitted), admitted  # both cores served
    finally:
        call_with_timeout(engine.shutdown, HANG_TIMEOUT_S, "shutdown")
    assert [core.exitcode for core in engine.engine_core.processes] == [0, 0]
    nothing_left_in_the_cluster()


def test_a_killed_core_actor_makes_the_engine_dead_naming_the_core_and_node(cluster, oracle_case):
    folder, prompts, _ = oracle_case
    engine = start_ray_cores(folder)
    try:
        victim = engine.engine_core.processes[1]
        node = engine.engine_infos[1].node

        async def kill_while_generating() -> float:
            params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
            stream = engine.generate({"prompt_token_ids": prompts[0]}, params)
            await anext(stream)
            ray.kill(victim.actor)
            killed_at = time.monotonic()
            while engine.engine_core.dead_error is None:
                await asyncio.sleep(0.01)
            seconds = time.monotonic() - killed_at
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            return seconds

        seconds = asyncio.run(asyncio.wait_for(kill_while_generating(), HANG_TIMEOUT_S))
        message = str(engine.engine_core.dead_error)
        print(f"\nkilled engine core 1's actor: noticed after {seconds:.3f} s")
        assert message.startswith("engine core 1 of 2 (Ray actor "), message
        assert f"on node {node}" in message and "died" in message, message
        assert seconds < DETECTION_BOUND_S
    finally:
        call_with_timeout(engine.shutdown, HANG_TIMEOUT_S, "shutdown")
    nothing_left_in_the_cluster()
