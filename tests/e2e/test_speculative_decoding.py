"""Speculative decoding keeps the model's own tokens: greedy tokens with drafts equal the
tokens without, whether the drafts are right, partly right or wrong, under preemption, chunked
prefill and prefix caching; right drafts make fewer steps.

The drafts come from test proposers that know each prompt's greedy continuation (found by a
run without speculation) and draft it, with mistakes where asked: so every path of the
verification (all kept, some kept, none kept) is taken on purpose.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

import vlite
from vlite import LLM, SamplingParams
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.proposer import Proposer
from vlite.testing.engine_runs import cached_tiny_model

NUM_NEW = 20
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
rng = random.Random(0)
PROMPTS = [[rng.randrange(4, 300) for _ in range(n)] for n in (3, 9, 17, 30)]
#: Prompt -> its greedy continuation (filled by the ``expected`` fixture).
CONTINUATIONS: dict[tuple[int, ...], list[int]] = {}


class OracleProposer(Proposer):
    """Drafts each request's true continuation; ``wrong_every`` > 0 makes every such
    draft position wrong (the token plus one)."""

    wrong_every = 0

    def propose(self, requests):
        drafts = {}
        for request in requests:
            tokens = list(request.token_ids)
            prompt = tuple(tokens[: request.num_prompt_tokens])
            done = len(tokens) - len(prompt)
            truth = CONTINUATIONS[prompt][done : done + request.max_drafts]
            if self.wrong_every:
                truth = [
                    t + 1 if (done + i) % self.wrong_every == self.wrong_every - 1 else t
                    for i, t in enumerate(truth)
                ]
            if truth:
                drafts[request.request_id] = truth
        return drafts


class HalfWrongProposer(OracleProposer):
    wrong_every = 2


class AlwaysWrongProposer(OracleProposer):
    wrong_every = 1


class Plugin:
    @vlite.hookimpl
    def register_proposers(self, register):
        register("oracle", OracleProposer)
        register("half-wrong", HalfWrongProposer)
        register("always-wrong", AlwaysWrongProposer)


@pytest.fixture(scope="module")
def folder():
    return str(cached_tiny_model("LlamaForCausalLM"))


@pytest.fixture(scope="module")
def expected(folder):
    llm = LLM(model=folder)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    tokens = [output.outputs[0].token_ids for output in outputs]
    CONTINUATIONS.update({tuple(p): t for p, t in zip(PROMPTS, tokens)})
    return tokens


def speculative_llm(folder, method, k=4, lookup=None, **settings):
    """An engine speculating with ``method`` (``lookup``: ngram's ``prompt_lookup_min``)."""
    registry = PluginRegistry(build_plugin_manager(extra_plugins=(Plugin(),)))
    spec = {"method": method, "num_speculative_tokens": k}
    if lookup is not None:
        spec["prompt_lookup_min"] = lookup
    return LLM(model=folder, registry=registry, speculative_config=spec, **settings)


def greedy(llm):
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def counts(llm):
    scheduler = llm.llm_engine.engine_core.scheduler
    return scheduler.num_draft_tokens, scheduler.num_accepted_tokens, scheduler.num_steps


@pytest.mark.parametrize("method", ["oracle", "half-wrong", "always-wrong"])
def test_greedy_tokens_equal_the_tokens_without_speculation(folder, expected, method):
    llm = speculative_llm(folder, method)
    assert greedy(llm) == expected
    drafted, accepted, _ = counts(llm)
    assert drafted > 0
    if method == "oracle":
        assert accepted == drafted
    elif method == "always-wrong":
        assert accepted == 0
    else:
        assert 0 < accepted < drafted


def test_right_drafts_take_fewer_steps(folder, expected):
    plain = LLM(model=folder, max_num_seqs=1)
    greedy(plain)
    llm = speculative_llm(folder, "oracle", k=4, max_num_seqs=1)
    assert greedy(llm) == expected
    # Each request: its prompt, then 4 drafts and 1 token per step: 20 new in 4 steps.
    assert counts(llm)[2] < plain.llm_engine.engine_core.scheduler.num_steps / 2


def test_under_forced_preemption(folder, expected):
    llm = speculative_llm(folder, "half-wrong", num_kv_blocks=6, block_size=16)
    assert greedy(llm) == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_with_chunked_prefill_and_a_small_budget(folder, expected):
    llm = speculative_llm(
        folder, "oracle", k=6, enable_chunked_prefill=True, max_num_batched_tokens=8
    )
    assert greedy(llm) == expected
    assert counts(llm)[1] > 0


def test_with_prefix_caching_twice(folder, expected):
    llm = speculative_llm(folder, "half-wrong", enable_prefix_caching=True)
    assert greedy(llm) == expected
    assert greedy(llm) == expected  # prefix hits over blocks that held rejected drafts


def test_blocks_of_rejected_drafts_are_given_back(folder, expected):
    llm = speculative_llm(folder, "always-wrong", k=16, block_size=4, enable_prefix_caching=False)
    assert greedy(llm) == expected
    kv = llm.llm_engine.engine_core.kv_cache_manager
    assert kv.num_used_blocks == 0


def test_the_ngram_proposer_keeps_the_tokens(folder, expected):
    llm = speculative_llm(folder, "ngram", lookup=1)
    assert greedy(llm) == expected
    assert counts(llm)[0] > 0  # it drafted (single-token matches of the random prompts)


def test_an_unknown_method_is_refused_naming_the_registered_ones(folder):
    with pytest.raises(vlite.core.errors.ConfigError, match="'nope' is not a registered proposer"):
        LLM(model=folder, speculative_config={"method": "nope"})


@pytest.mark.parametrize("method", ["half-wrong", "ngram"])
def test_with_async_scheduling(folder, expected, method):
    """A request that speculates is in one batch in flight at a time (its drafts follow
    known tokens); requests that do not overlap as usual."""
    llm = speculative_llm(folder, method, lookup=1, async_scheduling=True)
    assert greedy(llm) == expected
    drafted, accepted, _ = counts(llm)
    assert drafted > 0
    if method == "half-wrong":
        assert 0 < accepted < drafted


def test_pipeline_parallelism_is_refused_naming_why(folder):
    with pytest.raises(vlite.core.errors.ConfigError, match="pipeline_parallel_size=2"):
        LLM(
            model=folder,
            executor="multiproc",
            pipeline_parallel_size=2,
            speculative_config={"method": "ngram"},
        )


def test_a_setting_of_the_speculative_config_is_checked(folder):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=folder, speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(folder, expected):
    stop = expected[2][6]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, stop_token_ids=[stop])
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    plain = LLM(model=folder).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    llm = speculative_llm(folder, "oracle", k=8)
    output = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == plain.token_ids == expected[2][: expected[2].index(stop) + 1]
    assert output.finish_reason == plain.finish_reason == "stop"
    assert counts(llm)[1] > 0


def test_with_tensor_parallelism(folder, expected):
    llm = speculative_llm(folder, "half-wrong", executor="multiproc", tensor_parallel_size=2)
    try:
        assert greedy(llm) == expected
        assert counts(llm)[1] > 0
    finally:
        llm.llm_engine.shutdown()


# ---- sampled requests: the same distribution ------------------------------------------

NUM_SAMPLES = 4000
TOP_K = 3
#: Each run's outcome is its 3 tokens: at most TOP_K ** 3 values.
NUM_OUTCOMES = TOP_K**3
#: Two runs' empirical distributions of the same law differ in L1 by at least 2 * eps with
#: probability at most 2 * 2**K * exp(-N eps**2 / 2) (Weissman et al.'s bound, for each
#: run): eps for a false-failure rate of 1e-6.
FALSE_FAILURE_RATE = 1e-6
EPS = math.sqrt(2 * math.log(2 * 2**NUM_OUTCOMES / FALSE_FAILURE_RATE) / NUM_SAMPLES)


def sampled_distribution(llm) -> Counter:
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K, seed=seed, ignore_eos=True)
        for seed in range(NUM_SAMPLES)
    ]
    prompts = [{"prompt_token_ids": PROMPTS[1]}] * NUM_SAMPLES
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return Counter(tuple(output.outputs[0].token_ids) for output in outputs)


def l1_distance(a: Counter, b: Counter) -> float:
    return sum(abs(a[key] - b[key]) for key in set(a) | set(b)) / NUM_SAMPLES


@pytest.fixture(scope="module")
def plain_distribution(folder, expected):
    return sampled_distribution(LLM(model=folder, max_num_seqs=512))


def test_sampled_tokens_have_the_distribution_they_have_without_speculation(
    folder, plain_distribution
):
    llm = speculative_llm(folder, "oracle", max_num_seqs=512)
    distribution = sampled_distribution(llm)
    drafted, accepted, _ = counts(llm)
    assert 0 < accepted < drafted  # the drafts (greedy tokens) are sometimes sampled
    assert l1_distance(distribution, plain_distribution) < 2 * EPS


def test_the_distribution_check_catches_a_verifier_that_keeps_every_draft(
    folder, plain_distribution, monkeypatch
):
    from vlite.worker import draft_verification

    monkeypatch.setattr(
        draft_verification, "accepted_tokens", lambda samples, drafts: [*drafts, samples[-1]]
    )
    distribution = sampled_distribution(speculative_llm(folder, "oracle", max_num_seqs=512))
    assert l1_distance(distribution, plain_distribution) > 2 * EPS


def test_drafts_and_acceptance_are_counted_as_vllm_names_them(folder, expected):
    from vlite.core.stats import metric_values

    llm = speculative_llm(folder, "half-wrong")
    steps = []
    llm.llm_engine.engine_core.add_step_observer(steps.append)
    assert greedy(llm) == expected
    drafted, accepted, _ = counts(llm)
    totals = llm.llm_engine.engine_core.step_totals
    assert (totals.num_draft_tokens, totals.num_accepted_tokens) == (drafted, accepted)
    assert totals.num_drafts == sum(record.stats.num_drafts for record in steps) > 0
    metrics = {metric.name: value for metric, value in metric_values(totals)}
    assert metrics["spec_decode_num_draft_tokens"] == drafted
    assert metrics["spec_decode_num_accepted_tokens"] == accepted
    # Every second draft is wrong: a step keeps its first draft or none.
    assert metrics["spec_decode_num_accepted_tokens_per_pos"] == (accepted,)
    assert sum(sum(record.accepted_per_position) for record in steps) == accepted


@pytest.mark.parametrize("method", ["oracle", "half-wrong"])
def test_penalties_count_the_drafts_before_each_row(folder, expected, method):
    params = SamplingParams(
        max_tokens=NUM_NEW,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = [o.outputs[0].token_ids for o in LLM(model=folder).generate(prompts, params)]
    llm = speculative_llm(folder, method)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain
    assert plain != expected  # the penalties changed the tokens
    assert counts(llm)[1] > 0


def test_logprobs_of_kept_tokens_are_those_without_speculation(folder, expected):
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(model=folder).generate(prompts, params, use_tqdm=False)
    llm = speculative_llm(folder, "half-wrong")
    got = llm.generate(prompts, params, use_tqdm=False)
    assert counts(llm)[1] > 0
    for ours, theirs in zip(got, plain):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert len(ours.outputs[0].logprobs) == NUM_NEW
        for mine, reference in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            assert mine.keys() == reference.keys()
            for token, entry in mine.items():
                assert entry.logprob == pytest.approx(reference[token].logprob, abs=1e-4)
                assert entry.rank == reference[token].rank


def test_logit_bias_and_allowed_tokens_apply_at_every_draft_position(folder, expected):
    allowed = sorted({token for tokens in expected for token in tokens})[:40]
    params = SamplingParams(
        max_tokens=NUM_NEW,
        temperature=0.0,
        ignore_eos=True,
        allowed_token_ids=allowed,
        logit_bias={allowed[0]: 3.0, allowed[1]: -2.0},
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = [o.outputs[0].token_ids for o in LLM(model=folder).generate(prompts, params)]
    llm = speculative_llm(folder, "half-wrong")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain
    assert plain != expected
    assert counts(llm)[0] > 0


@pytest.mark.parametrize("method", ["oracle", "half-wrong"])
def test_min_tokens_counts_the_drafts_before_each_row(folder, expected, method):
    # Each request's own 5th greedy token stops it, banned for the first 4 output tokens: a
    # step verifying positions 1..5 must ban it at rows 1..3 only (it follows 1 output and
    # the drafts before each row), then stop at 4.
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [
        SamplingParams(max_tokens=NUM_NEW, temperature=0.0, min_tokens=4, stop_token_ids=[t[4]])
        for t in expected
    ]
    plain = [o.outputs[0].token_ids for o in LLM(model=folder).generate(prompts, params)]
    llm = speculative_llm(folder, method)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain
    stops_at_4 = [t[:5] for t in expected if t[4] not in t[:4]]
    assert stops_at_4 and all(tokens in plain for tokens in stops_at_4)
    assert counts(llm)[0] > 0


@pytest.mark.parametrize("method", ["oracle", "half-wrong"])
def test_bad_words_read_the_drafts_before_each_row(folder, expected, method):
    # Each request bans the word of its own greedy tokens 3 and 4: a row after the draft of
    # token 3 must ban token 4 (the word's start is a draft, not yet an output token).
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [
        SamplingParams(
            max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, bad_words_token_ids=[t[2:4]]
        )
        for t in expected
    ]
    plain = [o.outputs[0].token_ids for o in LLM(model=folder).generate(prompts, params)]
    llm = speculative_llm(folder, method)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == plain
    assert all(tokens[:3] == t[:3] and tokens[3] != t[3] for tokens, t in zip(plain, expected))
    assert counts(llm)[1] > 0  # they speculated


# ---- structured outputs: one mask per draft position ----------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
GRAMMAR_PROMPT = [7, 11, 13, 17, 19]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("method", ["oracle", "half-wrong"])
def test_with_a_grammar_each_draft_position_has_its_own_mask(folder, method, backend):
    params = SamplingParams(
        max_tokens=60, temperature=0.0, structured_outputs={"json": PERSON, "backend": backend}
    )
    prompt = [{"prompt_token_ids": GRAMMAR_PROMPT}]
    plain = LLM(model=folder).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    CONTINUATIONS[tuple(GRAMMAR_PROMPT)] = list(plain.token_ids)  # what the oracle drafts
    llm = speculative_llm(folder, method)
    output = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == plain.token_ids
    assert output.finish_reason == plain.finish_reason == "stop"  # the grammar ended it
    drafted, accepted, _ = counts(llm)
    assert accepted > 0
    if method == "oracle":
        assert accepted == drafted


def test_the_draft_budget_learns_step_costs_and_each_requests_acceptance(folder, monkeypatch):
    from vlite.core.draft_budget import DraftBudget

    seen: list[dict[str, list[int]]] = []
    real = DraftBudget.observe_outputs

    def observing(self, verified, outputs):
        seen.append(dict(verified))
        return real(self, verified, outputs)

    monkeypatch.setattr(DraftBudget, "observe_outputs", observing)
    llm = speculative_llm(folder, "always-wrong", max_num_seqs=1)
    greedy(llm)
    budget = llm.llm_engine.engine_core.drafts.budget
    assert budget.costs.estimated_decode_seconds(1) is not None  # decode steps were timed
    assert any(seen)  # the drafts each step verified reached the budget
    assert budget.acceptance == {}  # ended requests are forgotten
