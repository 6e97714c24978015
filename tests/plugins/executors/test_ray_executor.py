"""The ``ray`` executor on one machine: set-up errors, tokens, and cleaning up on every exit path.

The conformance suite runs on it from tests/testing/test_builtin_conformance.py; the
two-node cluster tests are in tests/distributed/test_ray_cluster.py. Tests that start
Ray share one small local instance (:func:`ray_session`).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from vlite import LLM, SamplingParams
from vlite.core.config import VliteConfig
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.plugins.executors.ray import failures as failures_module
from vlite.plugins.executors.ray import placement, session
from vlite.plugins.executors.ray.layout import rank_roles
from vlite.plugins.executors.ray.placement import parse_bundle_resources
from vlite.plugins.executors.ray.session import RayNotInstalledError
from vlite.testing.engine_runs import cached_tiny_model, call_with_timeout
from vlite.testing.server_process import wait_until_gone
from vlite.testing.tiny_models import make_tiny_model

HANG_TIMEOUT_S = 120.0


def load_tp_oracle() -> ModuleType:
    """tests/e2e/test_tp_oracle.py, for its prompts and transformers' greedy tokens."""
    path = Path(__file__).parents[2] / "e2e" / "test_tp_oracle.py"
    spec = importlib.util.spec_from_file_location("_tp_oracle_for_ray", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return PluginRegistry(build_plugin_manager(load_entry_points=False))


@pytest.fixture(scope="module")
def model() -> str:
    return str(cached_tiny_model("LlamaForCausalLM"))


@pytest.fixture(scope="module")
def ray_session():
    """A small local Ray instance, connected for the module's tests that need one."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False)
    yield ray
    ray.shutdown()


def alive_actors(ray) -> list[dict]:
    """Actors Ray still lists as not dead (from the GCS: the state API needs the dashboard)."""
    from ray._private import state

    return [actor for actor in state.actors().values() if actor["State"] != "DEAD"]


def placement_groups_left(ray) -> list[dict]:
    table = ray.util.placement_group_table()
    return [group for group in table.values() if group["state"] != "REMOVED"]


# ---- without Ray (nothing here starts it) --------------------------------------------------


def test_importing_vlite_and_registering_the_plugin_never_imports_ray():
    code = (
        "import sys, vlite\n"
        "from vlite.core.plugins import PluginRegistry, build_plugin_manager\n"
        "registry = PluginRegistry(build_plugin_manager(load_entry_points=False))\n"
        "assert 'ray' in registry.names('executor'), registry.names('executor')\n"
        "assert 'ray' not in sys.modules\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


def test_without_ray_installed_the_error_names_the_extra(model, registry, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(RayNotInstalledError, match=r'pip install "vlite\[ray\]"'):
        LLM(model=model, registry=registry, executor="ray")


def test_a_pipeline_the_model_cannot_take_is_refused_before_ray_starts(model, registry):
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2"):
        LLM(model=model, registry=registry, executor="ray", pipeline_parallel_size=3)


@pytest.mark.parametrize(
    "entry", ["node_a", "node_a=", "=1", "node_a=zero", "node_a=0", "node_a=-1", "x=inf"]
)
def test_a_malformed_bundle_resource_names_the_entry(entry):
    with pytest.raises(ValueError, match=f"entry {entry!r} is not NAME=AMOUNT"):
        parse_bundle_resources((entry,))


def test_bundle_resources_may_not_name_what_the_executor_sizes():
    with pytest.raises(ValueError, match="'CPU=4' names CPU, which the executor sets"):
        parse_bundle_resources(("CPU=4",))


def test_bundles_hold_the_threads_or_a_gpu_and_the_custom_resources():
    custom = parse_bundle_resources(("node_a=1", "ssd=0.5"))
    assert custom == {"node_a": 1.0, "ssd": 0.5}
    assert placement.rank_bundle("cpu", 3, custom) == {"CPU": 3.0, "node_a": 1.0, "ssd": 0.5}
    assert placement.rank_bundle("cuda", 3, {}) == {"GPU": 1.0}


def test_ranks_are_numbered_stage_by_stage_and_the_last_stage_replies():
    assert [(r.rank, r.returns_output) for r in rank_roles(2)] == [(0, True), (1, False)]
    roles = rank_roles(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert [(r.pipeline_stage, r.tensor_parallel_rank) for r in roles] == [
        (stage, tp_rank) for stage in range(3) for tp_rank in range(2)
    ]
    assert [r.rank for r in roles if r.returns_output] == [4]


def test_a_lost_actor_is_named_first_a_silent_rank_last_with_why_it_failed():
    pytest.importorskip("ray")
    from ray.exceptions import RayActorError

    gone = RayActorError(
        error_msg="The actor died unexpectedly before finishing this task.\n\tpid: 7\n"
        "The actor is dead because its node has died. Node Id: abc Some common causes: ..."
    )
    failures = [
        failures_module.rank_failure(0, "here", RuntimeError("peer closed the connection")),
        failures_module.silent_rank(2, "over there", 0.5),
        failures_module.rank_failure(1, "there", gone),
    ]
    assert str(failures_module.combined_error(failures)) == (
        "worker rank 1 (there) failed: its Ray actor is gone: The actor is dead because its "
        "node has died. Node Id: abc; worker rank 0 (here) failed: RuntimeError: peer closed "
        "the connection; worker rank 2 (over there) had not replied 0.5 s later"
    )


class FakeRay:
    """Just enough of the ``ray`` module for :mod:`~vlite.plugins.executors.ray.session`."""

    def __init__(self, initialized: bool) -> None:
        self.initialized = initialized
        self.calls: list[str] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, address=None) -> None:
        self.calls.append(f"init({address})")
        self.initialized = True

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        self.initialized = False


def test_the_last_executor_closes_a_connection_vlite_opened(monkeypatch):
    fake = FakeRay(initialized=False)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(session, "_CONNECTION", session._Connection())
    session.connect("local")
    session.connect("ignored: connected already")
    session.disconnect()
    assert fake.calls == ["init(local)"]  # one executor still uses it
    session.disconnect()
    assert fake.calls == ["init(local)", "shutdown"]


def test_a_connection_the_user_opened_is_left_open(monkeypatch):
    fake = FakeRay(initialized=True)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setattr(session, "_CONNECTION", session._Connection())
    session.connect(None)
    session.disconnect()
    assert fake.calls == [] and fake.initialized


# ---- its own Ray instance --------------------------------------------------------------------

_EXIT_WITHOUT_SHUTDOWN = """
    import json, sys
    import ray
    from vlite import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], executor="ray")  # starts a local Ray
        llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0))
        group = llm.llm_engine.engine_core.executor.group
        actors = [location.pid for location in group.locations.values()]
        node = ray._private.worker._global_node
        ray_processes = [
            info.process.pid for infos in node.all_processes.values() for info in infos
        ]
        print(json.dumps({"actors": actors, "ray": ray_processes}), flush=True)
"""


@pytest.mark.slow
def test_an_interpreter_exit_without_shutdown_leaves_no_process(model, tmp_path):
    pytest.importorskip("ray")
    script = tmp_path / "exit_without_shutdown.py"
    script.write_text(textwrap.dedent(_EXIT_WITHOUT_SHUTDOWN))
    completed = subprocess.run(
        [sys.executable, str(script), model],
        capture_output=True,
        text=True,
        timeout=HANG_TIMEOUT_S,
        cwd=Path(__file__).parents[3],
    )
    assert completed.returncode == 0, completed.stderr
    pids = json.loads(completed.stdout.strip().splitlines()[-1])
    assert len(pids["actors"]) == 1 and pids["ray"]
    assert wait_until_gone(pids["actors"] + pids["ray"]) == []


# ---- in a shared local Ray instance ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tp", "pp", "async_scheduling"),
    [(1, 1, False), (2, 1, True), (2, 2, False)],
    ids=["tp1", "tp2-async", "tp2-pp2"],
)
def test_greedy_tokens_equal_transformers(ray_session, tmp_path, tp, pp, async_scheduling):
    """A mixed batch with prefix-cache hits and preemption (tests/e2e/test_tp_oracle.py's).
    tp=2 runs two batches in flight (``async_scheduling``), tp=2 x pp=2 two (one per
    stage); tp=2 and pp=2 without it run across two nodes in
    tests/distributed/test_ray_cluster.py."""
    oracle = load_tp_oracle()
    architecture, settings = oracle.MODELS["llama-mha-untied-biases"]
    folder = make_tiny_model(tmp_path, architecture, **settings)
    prompts = oracle.make_prompts(
        vocab_size=json.loads((folder / "config.json").read_text())["vocab_size"]
    )
    expected = oracle.hf_greedy(folder, prompts)
    llm = call_with_timeout(
        lambda: LLM(
            model=str(folder),
            executor="ray",
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            num_kv_blocks=10,
            async_scheduling=async_scheduling,
        ),
        HANG_TIMEOUT_S,
        f"constructing a tp={tp} x pp={pp} engine",
    )
    try:
        params = SamplingParams(max_tokens=oracle.NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = call_with_timeout(
            lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params),
            HANG_TIMEOUT_S,
            "generate",
        )
        assert [out.outputs[0].token_ids for out in outputs] == expected
        engine_core = llm.llm_engine.engine_core
        assert engine_core.scheduler.num_preemptions > 0
        assert engine_core.kv_cache_manager.num_prefix_hit_tokens > 0
    finally:
        call_with_timeout(llm.llm_engine.shutdown, HANG_TIMEOUT_S, "shutdown")
    assert alive_actors(ray_session) == []
    assert placement_groups_left(ray_session) == []


@pytest.mark.slow
def test_an_executor_garbage_collected_without_shutdown_leaves_nothing(
    ray_session, model, registry
):
    from vlite.plugins.executors.ray import RayExecutor

    config = VliteConfig(model=model, executor="ray", num_kv_blocks=8)
    executor = call_with_timeout(
        lambda: RayExecutor(config, registry), HANG_TIMEOUT_S, "constructing RayExecutor"
    )
    assert len(alive_actors(ray_session)) == 1
    del executor
    gc.collect()
    assert alive_actors(ray_session) == []
    assert placement_groups_left(ray_session) == []
    assert ray_session.is_initialized()  # the user's connection stays


@pytest.mark.slow
def test_a_cluster_too_small_for_the_bundles_is_a_clear_error(
    ray_session, model, registry, monkeypatch
):
    monkeypatch.setattr(placement, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(placement.RayPlacementError) as error:
        LLM(model=model, registry=registry, executor="ray", cpu_threads=64)
    message = str(error.value)
    assert "did not reserve 1 bundles [{'CPU': 64.0}] with strategy PACK in 1 s" in message
    assert "'CPU': 4.0" in message  # the free resources
    assert alive_actors(ray_session) == []
    assert placement_groups_left(ray_session) == []
