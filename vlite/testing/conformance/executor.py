"""ExecutorConformance: same tokens as ``uniproc``, clean shutdown, crashed workers surface.

Worker failures are injected with the test-only model plugin :mod:`vlite.testing.faults`:
a tiny model whose forward pass fails when its batch holds a chosen token, by raising or
(for executors whose workers are processes) by ending the worker process. Every call that
could hang runs under a timeout, so a hang fails the test instead of stalling the run.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any, ClassVar

import pytest

from vlite.core.executor import Executor
from vlite.core.sampling_params import SamplingParams
from vlite.testing import faults
from vlite.testing.conformance.base import PluginConformance
from vlite.testing.engine_runs import (
    PromptCase,
    TimeoutExpired,
    cached_tiny_model,
    call_with_timeout,
    generate_tokens,
    mixed_prompts,
)

#: In the tiny models' vocabulary (~320 ids) but never in the suite's prompts (ids < 300);
#: the fault-injecting model never generates it.
FAULT_TOKEN_ID = 310


def child_pids() -> set[int]:
    """Live (not zombie) child processes of this process, from ``/proc`` (Linux)."""
    parent = os.getpid()
    children = set()
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it exited meanwhile
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == parent and state not in ("Z", "X"):
            children.add(int(entry.name))
    return children


class ExecutorConformance(PluginConformance):
    """Conformance suite for ``register_executors`` plugins.

    Capability flags (class attributes of the executor, see
    :class:`~vlite.core.executor.Executor`): ``is_deterministic`` (default ``True``),
    ``supports_tensor_parallel`` and ``runs_workers_in_subprocesses`` (default ``False``).

    Attributes:
        reference_executor: whose tokens the plugin's must equal.
        tensor_parallel_size: the size tried when ``supports_tensor_parallel``.
        hang_timeout_s: how long a call may take before it counts as a hang.
        shutdown_timeout_s: how long threads and processes may take to go after shutdown.
    """

    plugin_kind = "executor"
    reference_executor: ClassVar[str] = "uniproc"
    tensor_parallel_size: ClassVar[int] = 2
    hang_timeout_s: ClassVar[float] = 120.0
    shutdown_timeout_s: ClassVar[float] = 30.0
    capability_defaults: ClassVar[dict[str, bool]] = {
        "is_deterministic": True,
        "supports_tensor_parallel": False,
        "runs_workers_in_subprocesses": False,
    }
    is_deterministic: ClassVar[bool | None] = None
    supports_tensor_parallel: ClassVar[bool | None] = None
    runs_workers_in_subprocesses: ClassVar[bool | None] = None

    def check_interface(self, plugin_cls: Any) -> None:
        assert isinstance(plugin_cls, type) and issubclass(plugin_cls, Executor), (
            f"{plugin_cls!r} must subclass vlite.core.executor.Executor"
        )

    # ---- helpers -----------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def executor_model(cls) -> str:
        return str(cached_tiny_model("LlamaForCausalLM"))

    @pytest.fixture(scope="class")
    @classmethod
    def executor_prompts(cls) -> list:
        return mixed_prompts(
            num_prompts=8, max_prompt_len=30, shared_prefix_len=8, seeded_sampling=True
        )

    @classmethod
    def make_llm(cls, model: str, registry: Any, executor: str, **overrides: Any) -> Any:
        """An ``LLM`` with small blocks and cache (batching, prefix hits, preemption)."""
        from vlite.engine.llm import LLM

        settings = dict(block_size=4, num_kv_blocks=32, max_num_seqs=4, seed=0)
        settings.update(overrides)
        return call_with_timeout(
            lambda: LLM(model=model, registry=registry, executor=executor, **settings),
            cls.hang_timeout_s,
            f"constructing an LLM with executor {executor!r}",
        )

    def generate(self, llm: Any, cases: list) -> list[list[int]]:
        return call_with_timeout(
            lambda: generate_tokens(llm, cases), self.hang_timeout_s, "LLM.generate"
        )

    def shutdown(self, llm: Any) -> None:
        call_with_timeout(llm.llm_engine.shutdown, self.hang_timeout_s, "shutdown()")

    @pytest.fixture(scope="class")
    @classmethod
    def reference_tokens(cls, plugin_registry, executor_model, executor_prompts) -> list:
        llm = cls.make_llm(executor_model, plugin_registry, cls.reference_executor)
        tokens = generate_tokens(llm, executor_prompts)
        llm.llm_engine.shutdown()
        return tokens

    def assert_same_tokens(self, tokens, reference_tokens, cases, name, what) -> None:
        for index, (got, expected) in enumerate(zip(tokens, reference_tokens)):
            kind = "greedy" if cases[index].params.temperature == 0 else "seeded"
            assert got == expected, (
                f"{what}, {kind} prompt {index}: executor {name!r} produced {got}, "
                f"{self.reference_executor!r} produced {expected}"
            )

    # ---- what it reports ---------------------------------------------------------------

    def test_reports_the_attention_backend_its_workers_built(
        self, plugin_registry, conformance_plugin_name, executor_model
    ) -> None:
        llm = self.make_llm(executor_model, plugin_registry, conformance_plugin_name)
        core = llm.llm_engine.engine_core
        try:
            name = core.executor.attention_backend_name
        finally:
            self.shutdown(llm)
        # The engine resolves "auto" before it builds the executor and hands it the name.
        assert name == core.attention_backend_name, (
            f"executor {conformance_plugin_name!r} reported attention_backend_name={name!r}; "
            "it must set the registered name of the backend its workers built, the one its "
            f"config names ({core.attention_backend_name!r})"
        )

    # ---- tokens ------------------------------------------------------------------------

    def test_greedy_tokens_equal_uniproc(
        self,
        plugin_registry,
        conformance_plugin_name,
        executor_model,
        executor_prompts,
        reference_tokens,
    ) -> None:
        greedy = [i for i, case in enumerate(executor_prompts) if case.params.temperature == 0]
        cases = [executor_prompts[i] for i in greedy]
        llm = self.make_llm(executor_model, plugin_registry, conformance_plugin_name)
        try:
            tokens = self.generate(llm, cases)
        finally:
            self.shutdown(llm)
        expected = [reference_tokens[i] for i in greedy]
        self.assert_same_tokens(tokens, expected, cases, conformance_plugin_name, "tp=1")

    def test_seeded_sampling_equals_uniproc(
        self,
        plugin_cls,
        plugin_registry,
        conformance_plugin_name,
        executor_model,
        executor_prompts,
        reference_tokens,
    ) -> None:
        self.require(plugin_cls, "is_deterministic")
        llm = self.make_llm(executor_model, plugin_registry, conformance_plugin_name)
        try:
            tokens = self.generate(llm, executor_prompts)
        finally:
            self.shutdown(llm)
        self.assert_same_tokens(
            tokens, reference_tokens, executor_prompts, conformance_plugin_name, "tp=1"
        )

    def test_tensor_parallel_tokens_equal_uniproc(
        self,
        plugin_cls,
        plugin_registry,
        conformance_plugin_name,
        executor_model,
        executor_prompts,
        reference_tokens,
    ) -> None:
        self.require(plugin_cls, "supports_tensor_parallel")
        tp = self.tensor_parallel_size
        llm = self.make_llm(
            executor_model, plugin_registry, conformance_plugin_name, tensor_parallel_size=tp
        )
        try:
            tokens = self.generate(llm, executor_prompts)
        finally:
            self.shutdown(llm)
        greedy = [i for i, case in enumerate(executor_prompts) if case.params.temperature == 0]
        self.assert_same_tokens(
            [tokens[i] for i in greedy],
            [reference_tokens[i] for i in greedy],
            [executor_prompts[i] for i in greedy],
            conformance_plugin_name,
            f"tp={tp}",
        )

    # ---- shutdown ----------------------------------------------------------------------

    def test_shutdown_is_clean_and_idempotent(
        self, plugin_registry, conformance_plugin_name, executor_model, executor_prompts
    ) -> None:
        threads_before = set(threading.enumerate())
        children_before = child_pids()
        unused = self.make_llm(executor_model, plugin_registry, conformance_plugin_name)
        self.shutdown(unused)  # right after construction
        llm = self.make_llm(executor_model, plugin_registry, conformance_plugin_name)
        self.generate(llm, executor_prompts[:3])
        self.shutdown(llm)
        self.shutdown(llm)  # a second shutdown is harmless
        deadline = time.monotonic() + self.shutdown_timeout_s
        for thread in set(threading.enumerate()) - threads_before:
            thread.join(max(0.0, deadline - time.monotonic()))
        leftover_threads = [t.name for t in set(threading.enumerate()) - threads_before]
        assert not leftover_threads, f"threads left running after shutdown: {leftover_threads}"
        leftover_children = child_pids() - children_before
        while leftover_children and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for exits: child processes cannot be joined here
            leftover_children = child_pids() - children_before
        assert not leftover_children, f"processes left after shutdown: {leftover_children}"

    # ---- crashed workers ---------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def fault_registry(cls) -> Any:
        from vlite.core.plugins import PluginRegistry

        return PluginRegistry(cls.build_plugin_manager(faults))

    def faulty_model(self, tmp_path: Path, executor_model: str, mode: str) -> str:
        folder = faults.make_faulty_model(
            tmp_path / mode, Path(executor_model), FAULT_TOKEN_ID, mode
        )
        return str(folder)

    def check_fault_surfaces(self, llm: Any, expect_marker: bool) -> None:
        healthy = mixed_prompts(num_prompts=3, max_prompt_len=12, shared_prefix_len=0, seed=5)
        assert all(FAULT_TOKEN_ID not in case.prompt_token_ids for case in healthy)
        self.generate(llm, healthy)  # the workers run until the fault
        fault = PromptCase([20, FAULT_TOKEN_ID, 21], SamplingParams(max_tokens=4, temperature=0))
        poisoned = [healthy[0], fault]
        try:
            self.generate(llm, poisoned)
        except TimeoutExpired:
            raise  # a hang, not an error
        except Exception as exc:
            error = exc
        else:
            pytest.fail("LLM.generate returned although a worker failed")
        if expect_marker:
            text = "".join(traceback.format_exception(error))
            assert faults.FAULT_MARKER in text, (
                f"the error does not carry the worker's exception: {error!r}"
            )

    def test_worker_exception_surfaces_as_an_error(
        self, fault_registry, conformance_plugin_name, executor_model, tmp_path
    ) -> None:
        model = self.faulty_model(tmp_path, executor_model, "raise")
        llm = self.make_llm(model, fault_registry, conformance_plugin_name)
        try:
            self.check_fault_surfaces(llm, expect_marker=True)
        finally:
            self.shutdown(llm)

    def test_worker_process_death_surfaces_as_an_error(
        self, plugin_cls, fault_registry, conformance_plugin_name, executor_model, tmp_path
    ) -> None:
        self.require(plugin_cls, "runs_workers_in_subprocesses")
        model = self.faulty_model(tmp_path, executor_model, "exit")
        llm = self.make_llm(model, fault_registry, conformance_plugin_name)
        try:
            self.check_fault_surfaces(llm, expect_marker=False)
        finally:
            self.shutdown(llm)
