"""Each data-parallel engine core gets its own GPUs: the split, its errors, and the core
process that runs with the ``CUDA_VISIBLE_DEVICES`` it was given."""

from __future__ import annotations

import functools

import pytest
import torch

from vlite.core.config import VliteConfig
from vlite.engine.core_client import AsyncMPClient, CoreProcess
from vlite.engine.core_devices import split_devices, visible_device_ids
from vlite.engine.data_parallel_client import _devices_per_core
from vlite.testing.tiny_models import make_tiny_model


def test_visible_ids_come_from_the_variable_else_from_the_count():
    assert visible_device_ids(None, 3) == ["0", "1", "2"]
    assert visible_device_ids("4, 6,GPU-ab12", 8) == ["4", "6", "GPU-ab12"]
    assert visible_device_ids("", 8) == []


def test_cores_get_consecutive_runs_of_devices():
    assert split_devices(2, 1, ["0", "1"]) == ["0", "1"]
    assert split_devices(2, 2, ["4", "5", "6", "7", "8"]) == ["4,5", "6,7"]


def test_too_few_devices_names_the_sizes_and_the_devices_seen():
    expected = r"data_parallel_size 2 x 2 GPU\(s\) .* needs 4 GPUs, but 3 are visible \(0,1,2\)"
    with pytest.raises(ValueError, match=expected):
        split_devices(2, 2, ["0", "1", "2"])


def test_cores_on_cuda_split_the_visible_devices_by_their_ranks(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    config = VliteConfig(device="cuda", tensor_parallel_size=2, executor="multiproc")

    assert _devices_per_core(config, 2) == ["4,5", "6,7"]
    with pytest.raises(ValueError, match="needs 6 GPUs"):
        _devices_per_core(config, 3)


def test_cores_on_cpu_or_under_the_ray_executor_inherit_the_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _devices_per_core(VliteConfig(device="cpu"), 4) == [None] * 4
    ray_ranks = VliteConfig(device="cuda", executor="ray", tensor_parallel_size=2)
    assert _devices_per_core(ray_ranks, 4) == [None] * 4  # Ray gives each rank its GPU


def test_a_core_process_runs_with_the_devices_it_was_given(tmp_path):
    model = make_tiny_model(tmp_path, "LlamaForCausalLM")
    config = VliteConfig(model=str(model), num_kv_blocks=4, cpu_threads=1)
    client = AsyncMPClient(config, start_core=functools.partial(CoreProcess, config, None, "3"))
    try:
        info = client.wait_until_ready(60)
    finally:
        client.shutdown()
    assert info.visible_devices == "3"
    assert info.node == "local" and info.input_address.startswith("ipc://")
