"""Logits processors through LLM on a tiny random model: the built-ins change exactly the
requests that ask for them, and a third-party processor is selected through extra_args.

(``min_tokens`` end to end: ``tests/engine/test_sampling_options.py``.)
"""

from __future__ import annotations

import pytest

import vlite
from vlite import LLM, SamplingParams
from vlite.core.logits_processor import LogitsProcessor
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.plugins.logits_processors.per_request import PerRequestLogitsProcessor
from vlite.testing.tiny_models import make_tiny_model

PROMPTS = [
    {"prompt_token_ids": [5, 17, 42, 99, 120, 7]},
    {"prompt_token_ids": [60, 61, 62]},
    {"prompt_token_ids": [200, 3, 150, 151, 9, 9, 9, 30]},
]
MAX_TOKENS = 10


class ForcedTokenProcessor(PerRequestLogitsProcessor[int]):
    """A third-party processor: a request with ``extra_args={"force_token": t}`` samples
    ``t`` at every step."""

    def request_state(self, request):
        return (request.params.extra_args or {}).get("force_token")

    def edit_rows(self, logits):
        for row, token_id in self.active:
            logits[row] = float("-inf")
            logits[row, token_id] = 0.0
        return logits


class ForcedTokenPlugin:
    @vlite.hookimpl
    def register_logits_processors(self, register):
        register("force-token", ForcedTokenProcessor)


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model = make_tiny_model(tmp_path_factory.mktemp("logits-processors"), "LlamaForCausalLM")
    # Installed third-party plugins left out: the worker runs every registered processor.
    manager = build_plugin_manager(extra_plugins=(ForcedTokenPlugin(),), load_entry_points=False)
    return LLM(
        model=str(model), dtype="float32", num_kv_blocks=64, registry=PluginRegistry(manager)
    )


def greedy(**settings) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **settings}
    )


def generate(llm: LLM, params: list[SamplingParams], prompts=PROMPTS) -> list[list[int]]:
    outputs = llm.generate(prompts[: len(params)], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


@pytest.fixture(scope="module")
def unconstrained(llm) -> list[list[int]]:
    return generate(llm, [greedy() for _ in PROMPTS])


def processors(llm: LLM) -> list[LogitsProcessor]:
    executor = llm.llm_engine.engine_core.executor
    return executor.worker.model_runner.logits_processors.processors


def test_every_registered_processor_runs_in_the_worker(llm):
    names = [type(p).__name__ for p in processors(llm)]
    assert names == [
        "AllowedTokenIdsLogitsProcessor",
        "BadWordsLogitsProcessor",
        "LogitBiasLogitsProcessor",
        "MinTokensLogitsProcessor",
        "ForcedTokenProcessor",
    ]


def test_a_large_logit_bias_makes_greedy_pick_that_token_every_step(llm, unconstrained):
    token = next(t for t in range(50, 300) if all(t not in out for out in unconstrained))

    tokens = generate(llm, [greedy(), greedy(logit_bias={token: 100.0}), greedy()])

    assert tokens[1] == [token] * MAX_TOKENS
    assert tokens[0] == unconstrained[0] and tokens[2] == unconstrained[2]


def test_a_negative_logit_bias_keeps_a_token_out(llm, unconstrained):
    first = unconstrained[0][0]
    (tokens,) = generate(llm, [greedy(logit_bias={first: -100.0})])
    assert first not in tokens


def test_allowed_token_ids_restrict_every_sampled_token(llm, unconstrained):
    allowed = [11, 57, 140, 233]
    assert any(t not in allowed for t in unconstrained[1]), "the test needs a change to see"
    params = [
        greedy(),
        SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=4, allowed_token_ids=allowed),
        greedy(allowed_token_ids=allowed),
    ]

    tokens = generate(llm, params)

    assert tokens[0] == unconstrained[0]
    assert set(tokens[1]) <= set(allowed) and set(tokens[2]) <= set(allowed)


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens)))


def test_bad_words_are_never_generated(llm, unconstrained):
    pair = unconstrained[0][1:3]
    single = unconstrained[2][0]
    assert contains(unconstrained[0], pair)

    tokens = generate(
        llm,
        [greedy(bad_words_token_ids=[pair]), greedy(), greedy(bad_words_token_ids=[[single]])],
    )

    assert not contains(tokens[0], pair)
    assert tokens[0][:2] == unconstrained[0][:2]  # the word's first token is still allowed
    assert tokens[1] == unconstrained[1]
    assert single not in tokens[2]


def test_a_third_party_processor_changes_only_the_requests_that_select_it(llm, unconstrained):
    params = [greedy(), greedy(extra_args={"force_token": 77}), greedy(extra_args={"other": 1})]

    tokens = generate(llm, params)

    assert tokens[1] == [77] * MAX_TOKENS
    assert tokens[0] == unconstrained[0] and tokens[2] == unconstrained[2]


def test_logprobs_are_those_of_the_raw_logits(llm, unconstrained):
    """Captured before the processors: a token forced by a bias keeps its model logprob."""
    token = next(t for t in range(50, 300) if all(t not in out for out in unconstrained))
    (output,) = llm.generate(
        PROMPTS[:1], greedy(logit_bias={token: 100.0}, logprobs=0), use_tqdm=False
    )
    completion = output.outputs[0]
    assert completion.token_ids == [token] * MAX_TOKENS
    ranks = [position[token].rank for position in completion.logprobs]
    assert all(rank > 1 for rank in ranks), "the biased token ranked first in the raw logits"


def test_finished_requests_are_forgotten(llm):
    every_builtin = greedy(
        logit_bias={5: 1.0}, allowed_token_ids=[5, 9, 11], min_tokens=3, bad_words_token_ids=[[9]]
    )
    generate(llm, [every_builtin, every_builtin])
    # The worker hears that they finished with the next step's batch.
    generate(llm, [greedy(max_tokens=1)])
    for processor in processors(llm):
        if isinstance(processor, PerRequestLogitsProcessor):
            assert processor.states == {}, type(processor).__name__
