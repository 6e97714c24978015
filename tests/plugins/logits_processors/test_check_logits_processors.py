"""``vlite plugins check`` runs LogitsProcessorConformance on a logits processor."""

from __future__ import annotations

from click.testing import CliRunner

from vlite.cli.main import cli
from vlite.testing.suite_runs import check_table_rows as table_rows

#: An installed third-party processor that names its examples on its class, and biases
#: every row, not just those of the requests that select it.
SLOPPY_PROCESSOR = """
import vlite
from vlite.core.logits_processor import LogitsProcessor
from vlite.core.sampling_params import SamplingParams


class SloppyBoost(LogitsProcessor):
    active_params = [SamplingParams(extra_args={"boost": 3})]

    def update_state(self, batch_update):
        self.boosts = getattr(self, "boosts", {})
        for request_id in batch_update.removed:
            self.boosts.pop(request_id, None)
        for request in batch_update.added:
            boost = (request.params.extra_args or {}).get("boost")
            if boost is not None:
                self.boosts[request.request_id] = boost
        self.rows = [r for r in batch_update.rows if r in self.boosts]

    def apply(self, logits):
        for request_id in self.rows:
            logits[:, self.boosts[request_id]] += 10.0  # every row: the bug
        return logits


@vlite.hookimpl
def register_logits_processors(register):
    register("sloppy-boost", SloppyBoost)
"""


def check(*args: str):
    return CliRunner().invoke(cli, ["plugins", "check", *args])


def test_check_passes_a_builtin_processor():
    result = check("logit_bias")
    assert result.exit_code == 0, result.output
    assert "Checking logits_processor 'logit_bias' (vlite " in result.stdout
    rows = table_rows(result.stdout)
    assert rows["test_a_step_without_its_requests_does_no_tensor_work"] == "PASSED"
    assert set(rows.values()) == {"PASSED", "SKIPPED"}
    assert result.stdout.strip().splitlines()[-1].startswith("PASS: LogitsProcessorConformance")


def test_check_fails_an_installed_processor_that_edits_every_row(install_plugin):
    install_plugin("sloppy-boost", SLOPPY_PROCESSOR, version="0.2")
    result = check("sloppy-boost")
    assert result.exit_code == 1, result.output
    assert "Checking logits_processor 'sloppy-boost' (sloppy-boost 0.2)" in result.stdout
    rows = table_rows(result.stdout)
    assert rows["test_rows_of_other_requests_are_untouched"] == "FAILED"
    assert rows["test_active_params_change_their_rows"] == "PASSED"  # read from the class
    assert rows["test_a_step_without_its_requests_does_no_tensor_work"] == "PASSED"
