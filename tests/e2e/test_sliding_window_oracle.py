"""Sliding-window attention against ``transformers``: greedy float32 tokens are equal.

Tiny random models whose windows (10-13 tokens) are far shorter than the prompts (up to
70 tokens) and generations: Mistral (every layer windowed, so the KV-cache manager frees
blocks that leave the window), Qwen2 with ``use_sliding_window`` from ``max_window_layers``
on (a full layer beside a windowed one, so nothing is freed) and Mixtral. Each runs one
request at a time, in one batch, again through the prefix cache, under forced preemption and
with chunked prefill, on the backends that window (``cpu``, ``torch`` and, smaller, the
interpreted ``triton``).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from vlite import LLM, SamplingParams
from vlite.testing.tiny_models import make_tiny_model

NUM_NEW_TOKENS = 20
PROMPT_LENGTHS = (3, 11, 12, 13, 30, 70)
MODELS = {
    "mistral-w12": ("MistralForCausalLM", {"sliding_window": 12}),
    "qwen2-w10-from-layer1": (
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 1},
    ),
    "mixtral-w13": ("MixtralForCausalLM", {"sliding_window": 13}),
}
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(MODELS))
def window_case(request, tmp_path_factory):
    """A tiny windowed model folder, prompts sharing a 20-token prefix, and HF's tokens."""
    architecture, overrides = MODELS[request.param]
    folder = make_tiny_model(
        tmp_path_factory.mktemp(request.param),
        architecture,
        num_kv_heads=2,
        tie_word_embeddings=False,
        **overrides,
    )
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    rng = random.Random(1)
    prefix = [rng.randrange(4, vocab_size) for _ in range(20)]
    prompts = []
    for length in PROMPT_LENGTHS:
        tokens = [rng.randrange(4, vocab_size) for _ in range(length)]
        tokens[: min(length, 20)] = prefix[:length]
        prompts.append(tokens)
    return request.param, folder, prompts, hf_greedy(folder, prompts)


def hf_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False
            )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_windows_come_from_the_config(window_case):
    name, folder, _, _ = window_case
    llm = LLM(model=str(folder), max_num_seqs=1)
    windows = llm.llm_engine.engine_core.model_spec.sliding_windows
    expected = {
        "mistral-w12": (12, 12),
        "qwen2-w10-from-layer1": (None, 10),
        "mixtral-w13": (13, 13),
    }[name]
    assert windows == expected
    kv_window = llm.llm_engine.engine_core.kv_cache_manager.sliding_window
    assert kv_window == (None if None in expected else max(expected))


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_one_at_a_time_batched_and_from_the_prefix_cache(window_case, backend):
    _, folder, prompts, expected = window_case
    one = LLM(model=str(folder), attention_backend=backend, max_num_seqs=1)
    assert greedy(one, prompts) == expected
    batched = LLM(model=str(folder), attention_backend=backend)
    assert greedy(batched, prompts) == expected
    hits = batched.llm_engine.engine_core.kv_cache_manager.num_prefix_hit_tokens
    assert greedy(batched, prompts) == expected
    assert batched.llm_engine.engine_core.kv_cache_manager.num_prefix_hit_tokens > hits


def test_under_preemption_and_chunked_prefill(window_case):
    _, folder, prompts, expected = window_case
    llm = LLM(
        model=str(folder),
        num_kv_blocks=8,
        block_size=16,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    assert greedy(llm, prompts) == expected
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_triton_interpreted(window_case):
    _, folder, prompts, expected = window_case
    llm = LLM(model=str(folder), attention_backend="triton", num_kv_blocks=48)
    assert greedy(llm, prompts[-3:]) == expected[-3:]


def test_a_long_generation_holds_only_its_window(tmp_path):
    """With every layer windowed and chunked prefill, a 170-token request never holds more
    than 3 blocks of 16 (it would need 11 without the window: 3 would be refused), and its
    tokens still equal HF's."""
    folder = make_tiny_model(
        tmp_path, "MistralForCausalLM", num_kv_heads=2, tie_word_embeddings=True, sliding_window=12
    )
    prompt = [random.Random(5).randrange(4, 300) for _ in range(20)]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=150, do_sample=False)
    llm = LLM(
        model=str(folder),
        num_kv_blocks=6,
        block_size=16,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    core = llm.llm_engine.engine_core
    most_held = []
    core.add_step_observer(lambda record: most_held.append(core.kv_cache_manager.num_used_blocks))
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    result = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert list(result[0].outputs[0].token_ids) == out[0, len(prompt) :].tolist()
    assert max(most_held) <= 3
