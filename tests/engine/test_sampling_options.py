"""The sampling options end to end through LLM on a tiny model: min_tokens, n, logprobs,
and requests for options the configured sampler does not support."""

from __future__ import annotations

import math

import pytest

import vlite
from vlite import LLM, SamplingParams
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.request import EngineCoreRequest
from vlite.testing.tiny_models import make_tiny_model

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 120, 7]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model = make_tiny_model(tmp_path_factory.mktemp("sampling-options"), "LlamaForCausalLM")
    return LLM(model=str(model), dtype="float32", num_kv_blocks=64)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kw})


def generate(llm: LLM, prompt, params: SamplingParams):
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    return output


def greedy_tokens(llm: LLM, max_tokens: int = 12) -> list[int]:
    return generate(llm, PROMPT, greedy(max_tokens=max_tokens)).outputs[0].token_ids


# ---- min_tokens ----------------------------------------------------------------------------


def test_a_stop_token_cannot_end_the_request_before_min_tokens(llm):
    first = greedy_tokens(llm)[0]
    assert generate(llm, PROMPT, greedy(stop_token_ids=[first])).outputs[0].token_ids == [first]

    completion = generate(llm, PROMPT, greedy(stop_token_ids=[first], min_tokens=5)).outputs[0]

    assert len(completion.token_ids) >= 5
    # Masked in the sampler, not just ignored by the stop check: never sampled early.
    assert first not in completion.token_ids[:5]


def test_eos_is_masked_until_min_tokens(llm):
    """EOS set to the greedy next token: without min_tokens it ends the request at once."""
    first = greedy_tokens(llm)[0]
    core = llm.llm_engine.engine_core

    def run(min_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=min_tokens)
        core.add_request(
            EngineCoreRequest(f"eos-{min_tokens}", PROMPT["prompt_token_ids"], params, first)
        )
        tokens = []
        while core.has_unfinished_requests():
            for output in core.step().outputs:
                tokens += output.new_token_ids
        return tokens

    assert run(0) == [first]
    tokens = run(4)
    assert len(tokens) >= 4 and first not in tokens[:4]


def test_stop_strings_do_not_apply_before_min_tokens(llm):
    reference = generate(llm, PROMPT, greedy(max_tokens=16)).outputs[0]
    tokenizer = llm.get_tokenizer()
    early_text = tokenizer.decode(reference.token_ids[:3], skip_special_tokens=True)
    stop = early_text.strip()[:2]
    assert stop, "the tiny model's first tokens give a usable stop string"
    stopped = generate(llm, PROMPT, greedy(max_tokens=16, stop=stop)).outputs[0]
    assert len(stopped.token_ids) <= 3 and stopped.finish_reason == "stop"

    completion = generate(llm, PROMPT, greedy(max_tokens=16, stop=stop, min_tokens=8)).outputs[0]

    assert len(completion.token_ids) >= 8
    assert completion.token_ids[:8] == reference.token_ids[:8]
    protected = tokenizer.decode(reference.token_ids[:8], skip_special_tokens=True)
    assert completion.text.startswith(protected[: len(protected) - len(stop)])


# ---- n -------------------------------------------------------------------------------------


def test_n_seeded_samples_differ_and_repeat(llm):
    params = SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True)

    output = generate(llm, PROMPT, params)
    again = generate(llm, PROMPT, params)

    assert output.finished and [c.index for c in output.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in output.outputs]
    assert len(set(samples)) == 3
    assert samples == [tuple(c.token_ids) for c in again.outputs]
    # Sample i is the one-sample request with seed + i.
    single = generate(
        llm, PROMPT, SamplingParams(seed=8, temperature=1.0, max_tokens=8, ignore_eos=True)
    )
    assert tuple(single.outputs[0].token_ids) == samples[1]


def test_n_greedy_samples_are_identical(llm):
    output = generate(llm, PROMPT, greedy(n=2))

    assert output.outputs[0].token_ids == output.outputs[1].token_ids == greedy_tokens(llm)


def test_n_samples_share_the_prompt_through_the_prefix_cache(llm):
    kv_cache = llm.llm_engine.engine_core.kv_cache_manager
    prompt = {"prompt_token_ids": list(range(40, 80))}  # two full blocks and a bit
    hits_before = kv_cache.num_prefix_hit_tokens

    output = generate(llm, prompt, greedy(n=3, max_tokens=4))

    assert kv_cache.num_prefix_hit_tokens - hits_before >= 2 * 32  # samples 1 and 2
    assert output.num_cached_tokens >= 32


def test_n_beside_single_requests_keeps_the_order(llm):
    outputs = llm.generate(
        [PROMPT, {"prompt_token_ids": [9, 8, 7]}],
        [greedy(n=2, max_tokens=3), greedy(max_tokens=3)],
        use_tqdm=False,
    )

    assert [len(o.outputs) for o in outputs] == [2, 1]
    assert outputs[1].prompt_token_ids == [9, 8, 7]


def test_aborting_the_parent_frees_every_sample(llm):
    engine = llm.llm_engine
    kv_cache = engine.engine_core.kv_cache_manager
    engine.add_request("parent", PROMPT, greedy(n=3, max_tokens=50))
    engine.step()
    assert engine.engine_core.scheduler.num_unfinished_requests == 3
    assert kv_cache.num_free_blocks < kv_cache.num_blocks

    engine.abort_requests(["parent"])

    assert not engine.has_unfinished_requests()
    assert not engine.output_processor.has_unfinished_requests()
    assert kv_cache.num_free_blocks == kv_cache.num_blocks


# ---- logprobs ------------------------------------------------------------------------------


def test_logprobs_come_per_token_with_their_sum(llm):
    outputs = llm.generate(
        [PROMPT, PROMPT], [greedy(logprobs=3, max_tokens=6), greedy(max_tokens=6)], use_tqdm=False
    )
    with_logprobs, without = (o.outputs[0] for o in outputs)

    assert without.logprobs is None and without.cumulative_logprob is None
    assert with_logprobs.token_ids == without.token_ids
    assert len(with_logprobs.logprobs) == 6
    total = 0.0
    for token_id, position in zip(with_logprobs.token_ids, with_logprobs.logprobs):
        assert list(position)[0] == token_id
        sampled = position[token_id]
        assert sampled.rank == 1  # greedy picks the most likely
        assert sampled.decoded_token == llm.get_tokenizer().decode([token_id])
        assert len(position) == 3  # the sampled token is also the top one
        ranked = sorted(position.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
        total += sampled.logprob
    assert math.isclose(with_logprobs.cumulative_logprob, total, rel_tol=1e-9)


def test_logprobs_zero_gives_only_the_sampled_token(llm):
    completion = generate(llm, PROMPT, SamplingParams(logprobs=0, max_tokens=5, seed=3)).outputs[0]

    assert [list(p) for p in completion.logprobs] == [[t] for t in completion.token_ids]


# ---- sampler capabilities ------------------------------------------------------------------


class ArgmaxSampler:
    """Claims nothing beyond the defaults (penalties and min-p are unclaimed)."""

    def sample(self, logits, metadata):
        return logits.argmax(dim=-1)


class ArgmaxPlugin:
    @vlite.hookimpl
    def register_samplers(self, register):
        register("argmax-test", ArgmaxSampler)


def test_a_request_for_an_unclaimed_sampler_feature_is_rejected(tmp_path):
    model = make_tiny_model(tmp_path, "LlamaForCausalLM")
    registry = PluginRegistry(build_plugin_manager(extra_plugins=(ArgmaxPlugin(),)))
    llm = LLM(model=str(model), sampler="argmax-test", registry=registry)

    with pytest.raises(ValueError, match="presence_penalty.*'argmax-test' does not support"):
        llm.generate(PROMPT, greedy(presence_penalty=0.5), use_tqdm=False)
    with pytest.raises(ValueError, match="min_p"):
        llm.generate(PROMPT, SamplingParams(temperature=1.0, min_p=0.2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # Greedy requests with min_p or top-k set are fine: those do not change a greedy token.
    tokens = generate(llm, PROMPT, greedy(min_p=0.2, top_k=3, logprobs=1)).outputs[0]
    assert len(tokens.token_ids) == 12 and len(tokens.logprobs) == 12


def test_the_engine_core_runs_one_sample_per_request(llm):
    params = SamplingParams(n=2)
    with pytest.raises(ValueError, match="n=2"):
        llm.llm_engine.engine_core.add_request(EngineCoreRequest("x", [1, 2], params))
