"""``vlite plugins check`` runs the structured-output conformance suite on a built-in."""

from __future__ import annotations

from click.testing import CliRunner

from vlite.cli.main import cli


def test_plugins_check_runs_the_structured_output_suite():
    result = CliRunner().invoke(cli, ["plugins", "check", "xgrammar", "--timeout", "300"])

    assert result.exit_code == 0, result.output
    assert "with the structured_output_backend conformance suite" in result.output
    assert "test_masks_are_exact_for_a_finite_language[json]" in result.output
    assert "PASS: StructuredOutputBackendConformance on structured_output_backend" in result.output
