"""``vlite serve`` chunks prefills unless the user chose the scheduling settings."""

from __future__ import annotations

import pytest

from vlite.core.config import VliteConfig
from vlite.server.api_server import SERVING_TOKEN_BUDGET, with_serving_defaults


def served(config_file=None, **flags) -> VliteConfig:
    """The config ``vlite serve`` runs with, for these flags (and file, and environment)."""
    return with_serving_defaults(VliteConfig.load(config_file, **flags), config_file, flags)


@pytest.fixture(autouse=True)
def no_vlite_environment(monkeypatch):
    monkeypatch.delenv("VLITE_SCHEDULER", raising=False)
    monkeypatch.delenv("VLITE_MAX_NUM_BATCHED_TOKENS", raising=False)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_by_default_the_server_chunks_prefills_with_the_device_budget(device):
    config = served(device=device, max_num_seqs=7)

    assert config.scheduler == "chunked-prefill"
    assert config.max_num_batched_tokens == SERVING_TOKEN_BUDGET[device]
    assert config.max_num_seqs == 7 and config.device == device  # the rest is kept


def test_a_scheduler_flag_keeps_the_engine_defaults():
    config = served(scheduler="fcfs")

    assert config.scheduler == "fcfs"
    assert config.max_num_batched_tokens is None  # fcfs needs room for whole prompts


def test_a_budget_flag_is_kept_with_the_chunking_scheduler():
    config = served(max_num_batched_tokens=96)

    assert (config.scheduler, config.max_num_batched_tokens) == ("chunked-prefill", 96)


def test_the_environment_and_the_config_file_count_as_a_choice(monkeypatch, tmp_path):
    monkeypatch.setenv("VLITE_SCHEDULER", "priority")
    assert served().scheduler == "priority"

    monkeypatch.delenv("VLITE_SCHEDULER")
    config_file = tmp_path / "vlite.toml"
    config_file.write_text('scheduler = "fcfs"\n')
    assert served(config_file).scheduler == "fcfs"
