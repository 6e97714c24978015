"""ServerSettings' data-parallel placement fields: parsing, the rule that ties them, and the
flags derived from them."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from vlite.cli.main import cli
from vlite.server.settings import ServerSettings


def test_ray_resources_read_from_the_environment_as_a_list(monkeypatch):
    monkeypatch.setenv("VLITE_DATA_PARALLEL_BACKEND", "ray")
    monkeypatch.setenv("VLITE_DATA_PARALLEL_RESOURCES", "node_a=1, ssd=0.5")

    settings = ServerSettings()

    assert settings.data_parallel_backend == "ray"
    assert settings.data_parallel_resources == ("node_a=1", "ssd=0.5")


def test_ray_resources_without_the_ray_backend_are_refused_naming_both():
    with pytest.raises(ValidationError, match="need data_parallel_backend 'ray'.*'mp'"):
        ServerSettings(data_parallel_size=2, data_parallel_resources=("node_a=1",))


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValidationError, match="data_parallel_backend"):
        ServerSettings(data_parallel_backend="slurm")


def test_serve_help_lists_the_placement_flags():
    result = CliRunner().invoke(cli, ["serve", "--help"])

    assert result.exit_code == 0, result.output
    assert "--data-parallel-backend" in result.output
    assert "--data-parallel-resources" in result.output
