"""LogitsProcessorConformance over each built-in logits processor.

Each class adds the other built-ins' examples to the requests that must stay untouched: a
processor that reads another's field fails here.
"""

from __future__ import annotations

import pytest
import torch

from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.sampling_params import SamplingParams
from vlite.plugins.logits_processors.allowed_token_ids import AllowedTokenIdsLogitsProcessor
from vlite.plugins.logits_processors.bad_words import BadWordsLogitsProcessor
from vlite.plugins.logits_processors.logit_bias import LogitBiasLogitsProcessor
from vlite.plugins.logits_processors.min_tokens import MinTokensLogitsProcessor
from vlite.testing import LogitsProcessorConformance

BUILTINS = {
    "allowed_token_ids": AllowedTokenIdsLogitsProcessor,
    "bad_words": BadWordsLogitsProcessor,
    "logit_bias": LogitBiasLogitsProcessor,
    "min_tokens": MinTokensLogitsProcessor,
}


def others_examples(name: str) -> tuple[SamplingParams, ...]:
    """The examples of every built-in but ``name``, and a request under every one of the
    settings ``name`` reads, but set so that it does not apply."""
    others = [p for other, cls in BUILTINS.items() if other != name for p in cls.active_params]
    harmless = {
        "allowed_token_ids": SamplingParams(allowed_token_ids=None),
        "bad_words": SamplingParams(bad_words_token_ids=[[5000], [4, 9000]]),
        "logit_bias": SamplingParams(logit_bias={7000: 50.0}),
        "min_tokens": SamplingParams(min_tokens=4, ignore_eos=True, stop_token_ids=[6000]),
    }
    return (*LogitsProcessorConformance.inactive_params, *others, harmless[name])


class TestLogitBias(LogitsProcessorConformance):
    plugin_name = "logit_bias"
    load_entry_points = False
    inactive_params = others_examples("logit_bias")


class TestAllowedTokenIds(LogitsProcessorConformance):
    plugin_name = "allowed_token_ids"
    load_entry_points = False
    inactive_params = others_examples("allowed_token_ids")


class TestBadWords(LogitsProcessorConformance):
    plugin_name = "bad_words"
    load_entry_points = False
    inactive_params = others_examples("bad_words")


class TestMinTokens(LogitsProcessorConformance):
    plugin_name = "min_tokens"
    load_entry_points = False
    inactive_params = others_examples("min_tokens")


def test_every_builtin_is_tested_here():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    assert registry.names("logits_processor") == sorted(BUILTINS)
    for name, cls in BUILTINS.items():
        assert registry.get("logits_processor", name) is cls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestBuiltinsOnCuda(LogitsProcessorConformance):
    """Every built-in with its logits on the GPU (cached index tensors included)."""

    load_entry_points = False
    device = "cuda"

    @pytest.fixture(scope="class", params=sorted(BUILTINS))
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param
