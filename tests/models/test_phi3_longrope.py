"""Phi-3 with LongRoPE: greedy float32 tokens equal transformers' generate.

A tiny random Phi-3 with a pre-training context of 32 positions stretched to 128, random
short and long factors, full (Phi-3-mini-128k, Phi-3.5) or partial (Phi-4-mini) rotary.
Prompts shorter than, equal to and longer than 32 tokens; the shorter ones cross 32 while
generating, where transformers recomputes every cached key with the long factors. Run one
at a time, all in one batch, under forced preemption and with chunked prefill.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from vlite import LLM, SamplingParams
from vlite.models.phi3 import ARCHITECTURE, Phi3ForCausalLM
from vlite.testing.tiny_models import make_tiny_model

ORIGINAL_MAX = 32
MAX_POSITIONS = 128
NUM_NEW_TOKENS = 24
#: Stays short; crosses 32 at new token 13, 2 and 1; long from the start (twice).
PROMPT_LENGTHS = (5, 20, 31, 32, 33, 47)
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
#: Head dim 16 (hidden 64, 4 heads): 8 or 6 rotated pairs.
PARTIAL_ROTARY = {"full-rotary": 1.0, "phi4-mini-partial": 0.75}


def _factors(count: int, low: float, spread: float, rng: random.Random) -> list[float]:
    return [round(low + spread * rng.random(), 4) for _ in range(count)]


def make_longrope_model(path, partial: float, **overrides):
    """A tiny Phi-3 folder with LongRoPE (32 -> 128 positions) and untied embeddings."""
    rng = random.Random(partial)
    pairs = int(16 * partial) // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
        "short_factor": _factors(pairs, 1.0, 1.0, rng),
        "long_factor": _factors(pairs, 2.0, 6.0, rng),
    }
    return make_tiny_model(
        path,
        ARCHITECTURE,
        num_kv_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=MAX_POSITIONS,
        original_max_position_embeddings=ORIGINAL_MAX,
        partial_rotary_factor=partial,
        rope_parameters=rope,
        **overrides,
    )


@pytest.fixture(scope="module", params=sorted(PARTIAL_ROTARY))
def oracle_case(request, tmp_path_factory):
    """A LongRoPE model folder, prompts, and transformers' greedy continuations of them."""
    folder = make_longrope_model(
        tmp_path_factory.mktemp(request.param), PARTIAL_ROTARY[request.param]
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 300) for _ in range(n)] for n in PROMPT_LENGTHS]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like ignore_eos
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS)
        expected.append(out[0, len(prompt) :].tolist())
    return folder, prompts, expected


def vlite_greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


# Prefix caching is off: cached blocks do not record which factors rotated their keys (the
# engine turns it off itself when not asked for, and refuses it when asked for).


def test_one_request_at_a_time(oracle_case):
    folder, prompts, expected = oracle_case
    llm = LLM(model=str(folder), max_num_seqs=1, enable_prefix_caching=False)
    assert llm.llm_engine.model_spec.max_model_len == MAX_POSITIONS  # the long context
    assert vlite_greedy(llm, prompts) == expected


def test_all_in_one_batch_with_prefix_caching_turned_off_by_the_engine(oracle_case):
    folder, prompts, expected = oracle_case
    with pytest.warns(UserWarning, match="prefix caching is off for this model: its LongRoPE"):
        llm = LLM(model=str(folder))
    assert not llm.llm_engine.engine_core.kv_cache_manager.enable_prefix_caching
    assert vlite_greedy(llm, prompts) == expected
    assert vlite_greedy(llm, prompts) == expected  # no stale keys served the second time


def test_prefix_caching_asked_for_is_refused_naming_why(oracle_case):
    folder, _, _ = oracle_case
    with pytest.raises(ValueError, match="original_max_position_embeddings=32"):
        LLM(model=str(folder), enable_prefix_caching=True)
    LLM(model=str(folder), max_model_len=ORIGINAL_MAX, enable_prefix_caching=True)  # exact


def test_under_forced_preemption(oracle_case):
    folder, prompts, expected = oracle_case
    # 8 blocks of 16 slots cannot hold the six requests' 22 blocks at once.
    llm = LLM(model=str(folder), num_kv_blocks=8, enable_prefix_caching=False)
    assert vlite_greedy(llm, prompts) == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_with_chunked_prefill(oracle_case):
    folder, prompts, expected = oracle_case
    llm = LLM(
        model=str(folder),
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    assert vlite_greedy(llm, prompts) == expected


def test_a_window_shorter_than_the_original_context_is_refused(tmp_path):
    from vlite.models.loader import load_hf_config
    from vlite.plugins.attention.torch_ref import TorchAttentionBackend

    folder = make_longrope_model(tmp_path, 1.0, sliding_window=16)
    with pytest.raises(ValueError, match="sliding_window=16 is shorter than LongRoPE's"):
        Phi3ForCausalLM(load_hf_config(folder), TorchAttentionBackend, 16)


def test_with_async_scheduling(oracle_case):
    # The next step is scheduled while the last one's token is unknown: a request whose
    # unknown token crosses 32 waits for it, then is recomputed.
    folder, prompts, expected = oracle_case
    llm = LLM(model=str(folder), async_scheduling=True, enable_prefix_caching=False)
    assert vlite_greedy(llm, prompts) == expected


def test_the_recompute_is_scheduled_within_the_token_budget(oracle_case):
    folder, prompts, expected = oracle_case
    llm = LLM(
        model=str(folder),
        enable_chunked_prefill=True,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    core = llm.llm_engine.engine_core
    steps = []
    core.add_step_observer(steps.append)
    assert vlite_greedy(llm, prompts[1:4]) == expected[1:4]  # the three that cross 32
    scheduled = [s.stats.num_prefill_tokens + s.stats.num_decode_tokens for s in steps]
    assert max(scheduled) <= 8
    # Each request computes its prompt and all but its last token, and once it knows 33
    # tokens, its 32 cached ones again (in chunks of at most 8).
    computed = sum(len(prompt) + NUM_NEW_TOKENS - 1 for prompt in prompts[1:4])
    assert sum(scheduled) == computed + 3 * ORIGINAL_MAX
