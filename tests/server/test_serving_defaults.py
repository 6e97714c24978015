"""``vlite serve`` chunks prefills, with any scheduler policy, unless the user turned
chunking off or set the budget."""

from __future__ import annotations

import pytest

from vlite.core.config import VliteConfig
from vlite.server.api_server import SERVING_TOKEN_BUDGET, with_serving_defaults


def served(config_file=None, **flags) -> VliteConfig:
    """The config ``vlite serve`` runs with, for these flags (and file, and environment)."""
    return with_serving_defaults(VliteConfig.load(config_file, **flags), config_file, flags)


@pytest.fixture(autouse=True)
def no_vlite_environment(monkeypatch):
    for name in ("SCHEDULER", "MAX_NUM_BATCHED_TOKENS", "ENABLE_CHUNKED_PREFILL"):
        monkeypatch.delenv(f"VLITE_{name}", raising=False)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_by_default_the_server_chunks_prefills_with_the_device_budget(device):
    config = served(device=device, max_num_seqs=7)

    assert (config.scheduler, config.enable_chunked_prefill) == ("fcfs", True)
    assert config.max_num_batched_tokens == SERVING_TOKEN_BUDGET[device]
    assert config.max_num_seqs == 7 and config.device == device  # the rest is kept


def test_a_priority_server_keeps_chunked_prefill():
    config = served(scheduler="priority")

    assert (config.scheduler, config.enable_chunked_prefill) == ("priority", True)
    assert config.max_num_batched_tokens == SERVING_TOKEN_BUDGET["cpu"]


def test_turning_chunking_off_keeps_the_engine_budget():
    config = served(enable_chunked_prefill=False)

    assert config.enable_chunked_prefill is False
    assert config.max_num_batched_tokens is None  # whole prompts need room


def test_a_budget_flag_is_kept_with_chunking():
    config = served(max_num_batched_tokens=96)

    assert (config.enable_chunked_prefill, config.max_num_batched_tokens) == (True, 96)


def test_the_environment_and_the_config_file_count_as_a_choice(monkeypatch, tmp_path):
    monkeypatch.setenv("VLITE_ENABLE_CHUNKED_PREFILL", "false")
    assert served().enable_chunked_prefill is False

    monkeypatch.delenv("VLITE_ENABLE_CHUNKED_PREFILL")
    config_file = tmp_path / "vlite.toml"
    config_file.write_text("enable_chunked_prefill = false\n")
    assert served(config_file).enable_chunked_prefill is False
