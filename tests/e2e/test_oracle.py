"""The correctness oracle: greedy float32 tokens equal transformers' generate.

Twenty tiny random models (ten architectures; GQA with tied embeddings and MHA with
untied ones), eight prompts of different lengths, 24 new tokens, run one at a time, all in
one batch, with prefix-cache hits and under forced preemption.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from vlite import LLM, SamplingParams
from vlite.testing.engine_runs import transformers_greedy
from vlite.testing.tiny_models import ARCHITECTURES, make_tiny_model

NUM_NEW_TOKENS = 24
PROMPT_LENGTHS = (1, 5, 16, 17, 31, 33, 48, 70)
VARIANTS = {
    "gqa-tied": {"num_kv_heads": 2, "tie": True},
    "mha-untied": {"num_kv_heads": 4, "tie": False},
}
MODEL_CASES = [(arch, variant) for arch in ARCHITECTURES for variant in VARIANTS]
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=MODEL_CASES, ids=lambda case: f"{case[0]}-{case[1]}")
def oracle_case(request, tmp_path_factory):
    """A tiny model folder, prompts, and transformers' greedy continuations of them."""
    architecture, variant = request.param
    settings = VARIANTS[variant]
    folder = make_tiny_model(
        tmp_path_factory.mktemp(f"{architecture}-{variant}"),
        architecture,
        num_kv_heads=settings["num_kv_heads"],
        tie_word_embeddings=settings["tie"],
    )
    prompts = make_prompts(folder, shared_prefix_len=0)
    return folder, prompts, hf_greedy(folder, prompts)


def make_prompts(folder: Path, shared_prefix_len: int, seed: int = 0) -> list[list[int]]:
    from transformers import AutoConfig

    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    rng = random.Random(seed)
    prefix = [rng.randrange(4, vocab_size) for _ in range(shared_prefix_len)]
    return [prefix + [rng.randrange(4, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [c.token_ids for c in transformers_greedy(folder, prompts, NUM_NEW_TOKENS)]


def vlite_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def test_one_request_at_a_time(oracle_case):
    folder, prompts, expected = oracle_case
    llm = LLM(model=str(folder), max_num_seqs=1, enable_prefix_caching=False)
    assert vlite_greedy(llm, prompts) == expected


def test_all_in_one_batch(oracle_case):
    folder, prompts, expected = oracle_case
    llm = LLM(model=str(folder), enable_prefix_caching=False)
    assert vlite_greedy(llm, prompts) == expected


def test_under_forced_preemption(oracle_case):
    folder, prompts, expected = oracle_case
    # 8 blocks of 16 slots cannot hold all eight requests' prompts plus 24 tokens at once.
    llm = LLM(model=str(folder), num_kv_blocks=8, enable_prefix_caching=False)
    assert vlite_greedy(llm, prompts) == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_prefix_cache_hits(architecture, tmp_path):
    folder = make_tiny_model(tmp_path, architecture)
    prompts = make_prompts(folder, shared_prefix_len=40, seed=1)
    expected = hf_greedy(folder, prompts)
    llm = LLM(model=str(folder), enable_prefix_caching=True)
    kv_cache = llm.llm_engine.engine_core.kv_cache_manager
    # In one batch: later requests reuse the prefix blocks the first computes in that step.
    assert vlite_greedy(llm, prompts) == expected
    hits_in_batch = kv_cache.num_prefix_hit_tokens
    assert hits_in_batch > 0
    # Again: every prompt's full blocks now come from the cache.
    assert vlite_greedy(llm, prompts) == expected
    assert kv_cache.num_prefix_hit_tokens - hits_in_batch >= sum(
        (len(p) - 1) // 16 * 16 for p in prompts
    )
    assert kv_cache.num_free_blocks == kv_cache.num_blocks
