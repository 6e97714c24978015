"""The CPU thread policy: physical cores by default, and the governor that shares them."""

from __future__ import annotations

import torch

from vlite.worker import cpu_threads
from vlite.worker.cpu_threads import ThreadGovernor, physical_cores, thread_environment


class FakeMachine:
    """``/proc`` readings of a 2-CPU machine: other processes' and our own busy cores."""

    def __init__(self) -> None:
        self.busy = self.total = self.own = 0.0
        self.now = 0.0

    def run(self, seconds: float, other_cores: float, own_cores: float) -> None:
        ticks = 100 * seconds
        self.busy += ticks * (other_cores + own_cores)
        self.total += ticks * 2
        self.own += ticks * own_cores
        self.now += seconds

    def read(self) -> tuple[float, float, float]:
        return self.busy, self.total, self.own


def make_governor(machine: FakeMachine, monkeypatch) -> tuple[ThreadGovernor, list[int]]:
    applied: list[int] = []
    monkeypatch.setattr(cpu_threads, "use_cpu_threads", applied.append)
    governor = ThreadGovernor(
        2, interval_s=2.0, num_cpus=2, read_times=machine.read, clock=lambda: machine.now
    )
    return governor, applied


def test_a_busy_neighbour_takes_a_thread_away_and_gives_it_back(monkeypatch):
    machine = FakeMachine()
    governor, applied = make_governor(machine, monkeypatch)
    machine.run(2.0, other_cores=0.0, own_cores=2.0)
    governor.on_step()
    assert governor.threads == 2 and applied == []
    machine.run(2.0, other_cores=1.0, own_cores=1.0)  # a busy process on one core
    governor.on_step()
    assert governor.threads == 1 and applied == [1]
    assert abs(governor.other_load - 1.0) < 1e-9
    machine.run(2.0, other_cores=0.05, own_cores=1.0)  # it ended
    governor.on_step()
    assert governor.threads == 2 and applied == [1, 2]


def test_light_background_work_keeps_every_thread(monkeypatch):
    machine = FakeMachine()
    governor, applied = make_governor(machine, monkeypatch)
    machine.run(2.0, other_cores=0.3, own_cores=1.7)
    governor.on_step()
    assert governor.threads == 2 and applied == []


def test_checks_at_most_once_per_interval(monkeypatch):
    machine = FakeMachine()
    governor, applied = make_governor(machine, monkeypatch)
    machine.run(1.0, other_cores=1.0, own_cores=1.0)
    governor.on_step()  # 1 s after the start: too early to judge
    assert governor.threads == 2
    machine.run(1.5, other_cores=1.0, own_cores=1.0)
    governor.on_step()
    assert governor.threads == 1


def test_never_below_one_thread(monkeypatch):
    machine = FakeMachine()
    governor, _ = make_governor(machine, monkeypatch)
    machine.run(2.0, other_cores=2.0, own_cores=0.0)
    governor.on_step()
    assert governor.threads == 1


def test_physical_cores_and_environment():
    assert 1 <= physical_cores() <= (torch.get_num_threads() + len(cpu_threads.usable_cpus()))
    assert thread_environment(3) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}


def test_the_worker_governs_only_when_cpu_threads_is_unset(tmp_path):
    from vlite import LLM
    from vlite.testing.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    before = torch.get_num_threads()
    try:
        auto = LLM(model=str(folder), num_kv_blocks=8).llm_engine.engine_core.executor.worker
        assert auto.thread_governor is not None
        fixed = LLM(model=str(folder), num_kv_blocks=8, cpu_threads=1)
        assert fixed.llm_engine.engine_core.executor.worker.thread_governor is None
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
