"""``vlite run``'s sampling flags are generated from SamplingParams: every field a flag can
carry has one, with the field's doc as help and its default (greedy for ``vlite run``)."""

from __future__ import annotations

import dataclasses

import click
import pytest

from vlite.cli.run import run_command
from vlite.cli.sampling_flags import RUN_DEFAULTS, SKIPPED_FIELDS, field_docs, given_sampling
from vlite.core.sampling_params import SamplingParams

#: Fields a command line cannot carry: set per request in --input JSONL.
JSONL_ONLY = {"structured_outputs", "logit_bias", "bad_words_token_ids", "extra_args"}


def run_options() -> dict[str, click.Option]:
    return {param.name: param for param in run_command.params if isinstance(param, click.Option)}


def test_every_field_a_flag_can_carry_has_one_named_after_it():
    options = run_options()
    for field in dataclasses.fields(SamplingParams):
        if field.name in JSONL_ONLY or field.name in SKIPPED_FIELDS - {"max_tokens"}:
            continue
        option = options.get(field.name)
        assert option is not None, field.name
        assert f"--{field.name.replace('_', '-')}" in option.opts


def test_a_flags_help_is_its_fields_doc_and_its_default_the_fields():
    options = run_options()
    docs = field_docs()
    assert options["top_p"].help.startswith("Keep the smallest set of tokens")
    assert docs["top_p"].startswith("Keep the smallest set of tokens")
    assert options["top_p"].default == SamplingParams().top_p
    assert options["temperature"].default == RUN_DEFAULTS["temperature"] == 0.0


def test_list_fields_repeat_and_booleans_are_switches():
    options = run_options()
    assert options["stop"].multiple and options["stop_token_ids"].type.name == "integer"
    assert options["ignore_eos"].is_flag


def test_flags_not_given_leave_lists_unset_and_the_rest_at_their_defaults():
    options = {"stop": (), "bad_words": ("x",), "top_k": 0, "model": "m"}
    assert given_sampling(options) == {"bad_words": ["x"], "top_k": 0}
    assert options == {"model": "m"}


@pytest.mark.parametrize("name", ["structured_outputs", "logit_bias", "extra_args"])
def test_fields_a_flag_cannot_carry_have_none(name):
    assert name not in run_options()
