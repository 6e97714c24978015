"""The ``draft_model`` proposer: a second model in the worker drafts, and the tokens are the
target's own, whatever the draft: the target itself (every draft right), another model of
another architecture sharing the tokenizer (drafts mostly wrong); under preemption, chunked
prefill, prefix hits and tensor parallelism (each rank runs its shard of the draft)."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from vlite import LLM, SamplingParams
from vlite.core.errors import ConfigError
from vlite.core.speculation_governor import SpeculationGovernor
from vlite.testing.engine_runs import cached_tiny_model

NUM_NEW = 20
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
rng = random.Random(1)
PROMPTS = [[rng.randrange(4, 300) for _ in range(n)] for n in (3, 9, 17, 30)]


@pytest.fixture(autouse=True)
def every_step_drafts(monkeypatch):
    """The governor's pauses depend on timing (tests/core/test_speculation_governor.py tests
    them); here every step drafts, so counts are exact."""
    monkeypatch.setattr(SpeculationGovernor, "allows_drafts", lambda self: True)


@pytest.fixture(scope="module")
def target():
    return str(cached_tiny_model("LlamaForCausalLM"))


@pytest.fixture(scope="module")
def other_draft():
    """A one-layer Qwen2 with other weights and the same tokenizer."""
    return str(cached_tiny_model("Qwen2ForCausalLM", seed=1, num_hidden_layers=1))


@pytest.fixture(scope="module")
def expected(target):
    return greedy(LLM(model=target))


def drafting_llm(target, draft, k=4, **settings):
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return LLM(model=target, speculative_config=spec, **settings)


def greedy(llm):
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def counts(llm):
    scheduler = llm.llm_engine.engine_core.scheduler
    return scheduler.num_draft_tokens, scheduler.num_accepted_tokens, scheduler.num_steps


def test_the_target_as_its_own_draft_has_every_draft_accepted(target, expected):
    llm = drafting_llm(target, target, max_num_seqs=1)
    assert greedy(llm) == expected
    drafted, accepted, steps = counts(llm)
    assert drafted > 0 and accepted == drafted
    # Each request: its prompt, one plain decode, then 4 drafts and 1 token a step.
    assert steps <= len(PROMPTS) * (2 + -(-(NUM_NEW - 2) // 5))


def test_another_model_drafts_and_the_tokens_are_the_targets(target, other_draft, expected):
    llm = drafting_llm(target, other_draft)
    assert greedy(llm) == expected
    assert counts(llm)[0] > 0


@pytest.mark.parametrize(
    "settings",
    [
        {"num_kv_blocks": 16, "block_size": 4},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 8},
        {"enable_prefix_caching": True, "block_size": 4},
    ],
    ids=["preemption", "chunked-prefill", "prefix-caching"],
)
def test_with_the_schedulers_mechanisms(target, expected, settings):
    llm = drafting_llm(target, target, **settings)
    assert greedy(llm) == expected
    assert greedy(llm) == expected  # again: over prefix hits, or blocks other requests used
    drafted, accepted, _ = counts(llm)
    assert accepted == drafted > 0  # the draft's cache held every token it needed
    if "num_kv_blocks" in settings:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("draft", ["target", "other"])
def test_with_a_grammar(target, other_draft, draft):
    """The draft knows no grammar: its drafts are cut where the grammar refuses them (here
    a grammar of any text but special tokens, which the random models' drafts often are)."""
    params = SamplingParams(
        max_tokens=30, temperature=0.0, structured_outputs={"regex": "(.|\\n){0,200}"}
    )
    prompt = [{"prompt_token_ids": PROMPTS[2]}]
    plain = LLM(model=target).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    llm = drafting_llm(target, target if draft == "target" else other_draft)
    output = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert output.token_ids == plain.token_ids
    drafted, accepted, _ = counts(llm)
    assert drafted > 0
    if draft == "target":
        assert accepted > 0


def test_with_async_scheduling(target, expected):
    llm = drafting_llm(target, target, async_scheduling=True)
    assert greedy(llm) == expected
    drafted, accepted, _ = counts(llm)
    assert accepted == drafted > 0


def test_with_tensor_parallelism(target, other_draft, expected):
    llm = drafting_llm(target, target, executor="multiproc", tensor_parallel_size=2)
    try:
        assert greedy(llm) == expected
        drafted, accepted, _ = counts(llm)
        assert accepted == drafted > 0
    finally:
        llm.llm_engine.shutdown()


def edited_copy(folder, tmp_path, file_name, edit):
    """A copy of the model ``folder`` whose JSON file ``file_name`` went through ``edit``."""
    copy = tmp_path / "draft"
    shutil.copytree(folder, copy)
    data = json.loads((copy / file_name).read_text())
    edit(data)
    (copy / file_name).write_text(json.dumps(data))
    return str(copy)


def test_a_draft_with_another_vocabulary_size_is_refused(target, tmp_path):
    draft = edited_copy(target, tmp_path, "config.json", lambda c: c.update(vocab_size=400))
    with pytest.raises(ConfigError, match="vocabulary of 400 tokens"):
        drafting_llm(target, draft)


def test_a_draft_whose_tokens_mean_other_things_is_refused(target, tmp_path):
    def swap_two_tokens(tokenizer):
        vocab = tokenizer["model"]["vocab"]
        vocab["!"], vocab["<unk>"] = vocab["<unk>"], vocab["!"]

    draft = edited_copy(target, tmp_path, "tokenizer.json", swap_two_tokens)
    with pytest.raises(ConfigError, match="tokenizer differs"):
        drafting_llm(target, draft)


def test_a_draft_with_a_shorter_context_is_refused(target, tmp_path):
    def shorten(config):
        config["max_position_embeddings"] = 64

    draft = edited_copy(target, tmp_path, "config.json", shorten)
    with pytest.raises(ConfigError, match="reaches 64 tokens"):
        drafting_llm(target, draft)


def test_the_draft_model_setting_is_checked(target):
    with pytest.raises(ValueError, match="needs model"):
        LLM(model=target, speculative_config={"method": "draft_model"})
    with pytest.raises(ValueError, match="read only by method='draft_model'"):
        LLM(model=target, speculative_config={"method": "ngram", "model": target})
