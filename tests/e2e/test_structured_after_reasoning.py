"""A constraint after the reasoning, end to end on a tiny random model: a logits processor
forces a reasoning (so the test does not depend on what random weights write), the
grammar lets it through untouched, and the answer after the end marker follows the
constraint, under both backends and with n-gram speculation."""

from __future__ import annotations

import pytest

import vlite
from vlite import LLM, SamplingParams
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.structured_output_params import StructuredOutputsParams
from vlite.plugins.logits_processors.per_request import PerRequestLogitsProcessor
from vlite.plugins.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from vlite.plugins.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from vlite.testing.tiny_models import make_tiny_model

CHOICES = ["yes", "no way"]
PROMPT = "Is the answer"
BACKENDS = ["xgrammar", "llguidance"]


class ForcedTextProcessor(PerRequestLogitsProcessor):
    """A request with ``extra_args={"forced": [ids]}`` samples those tokens first (a row
    after drafts counts them, so such a request speculates)."""

    follows_drafts = True

    def request_state(self, request):
        forced = (request.params.extra_args or {}).get("forced")
        return (request, forced) if forced else None

    def edit_rows(self, logits):
        for row, (request, forced) in self.active:
            position = request.num_output_tokens + len(self.drafts_before_row(row))
            if position < len(forced):
                logits[row] = float("-inf")
                logits[row, forced[position]] = 0.0
        return logits


class ForcedTextPlugin:
    @vlite.hookimpl
    def register_logits_processors(self, register):
        register("forced-text", ForcedTextProcessor)


def make_llm(model: str, **settings) -> LLM:
    manager = build_plugin_manager(extra_plugins=(ForcedTextPlugin(),), load_entry_points=False)
    return LLM(model=model, num_kv_blocks=64, registry=PluginRegistry(manager), **settings)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM"))


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return make_llm(tiny_llama)


def answer_after(
    llm: LLM, parser_cls, forced_text: str, backend: str, max_tokens: int = 40
) -> tuple[str, str]:
    """The reply and the finish reason of a choice constraint after ``parser_cls``'s
    reasoning, with ``forced_text`` forced first."""
    forced = llm.get_tokenizer().encode(forced_text, add_special_tokens=False)
    constraint = StructuredOutputsParams(
        choice=CHOICES, backend=backend, after_reasoning=parser_cls.markers
    )
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        structured_outputs=constraint,
        extra_args={"forced": forced},
    )
    output = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    return output.text, output.finish_reason


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("parser_cls", "forced"),
    [
        (DeepSeekR1ReasoningParser, "I think so, <b>yes</b>.</think>"),
        (Qwen3ReasoningParser, "\n<think>hmm </thi no</think>"),
    ],
    ids=["deepseek_r1", "qwen3"],
)
def test_the_reasoning_runs_free_and_the_answer_follows_the_constraint(
    llm, parser_cls, forced, backend
):
    text, finish_reason = answer_after(llm, parser_cls, forced, backend)
    split = parser_cls().parse(text)
    assert text.startswith(forced)
    assert split.answer in CHOICES, text
    assert finish_reason == "stop"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reply_that_does_not_open_the_reasoning_is_all_answer(llm, backend):
    text, finish_reason = answer_after(llm, Qwen3ReasoningParser, "no", backend)
    assert text == "no way" and finish_reason == "stop"


def test_speculation_keeps_the_same_reply(llm, tiny_llama):
    # Long enough for the n-gram drafts to come back after the first misses pause them.
    forced = "I think so:" + " no way," * 16 + "</think>"
    plain = answer_after(llm, DeepSeekR1ReasoningParser, forced, "xgrammar", max_tokens=160)
    assert plain[1] == "stop"
    speculating = make_llm(
        tiny_llama,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    )
    reply = answer_after(speculating, DeepSeekR1ReasoningParser, forced, "xgrammar", max_tokens=160)
    assert reply == plain
    totals = speculating.llm_engine.engine_core.step_totals
    assert totals.num_accepted_tokens > 0  # the request did speculate, through the reasoning
