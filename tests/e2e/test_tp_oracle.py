"""The correctness oracle at tensor-parallel size 2: ``multiproc`` workers give
the same greedy float32 tokens as transformers' ``generate``.

Two tiny models: Qwen3 with GQA and tied embeddings (per-head q/k norms, a head_dim that is
not hidden / heads), and Llama with MHA, untied embeddings and biases on every projection
(so column- and row-parallel biases are both exercised). All prompts run in one mixed
batch, with prefix-cache hits and forced preemption.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from vlite import LLM, SamplingParams
from vlite.testing.engine_runs import call_with_timeout, transformers_greedy
from vlite.testing.tiny_models import make_tiny_model

NUM_NEW_TOKENS = 16
PROMPT_LENGTHS = (1, 5, 16, 17, 31, 33, 48, 70)
SHARED_PREFIX_LEN = 20
MODELS = {
    "qwen3-gqa-tied": ("Qwen3ForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "llama-mha-untied-biases": (
        "LlamaForCausalLM",
        {
            "num_kv_heads": 4,
            "tie_word_embeddings": False,
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "smollm3-gqa-tied": ("SmolLM3ForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "phi3-gqa-untied": ("Phi3ForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": False}),
    "mixtral-gqa-untied": (
        "MixtralForCausalLM",
        {"num_kv_heads": 2, "tie_word_embeddings": False},
    ),
    "qwen2moe-gqa-tied": (
        "Qwen2MoeForCausalLM",
        {"num_kv_heads": 2, "tie_word_embeddings": True},
    ),
    "mistral-w40-gqa-tied": (  # prompts up to 90 tokens: windowed, and preempted
        "MistralForCausalLM",
        {"num_kv_heads": 2, "tie_word_embeddings": True, "sliding_window": 40},
    ),
    "qwen2-gqa-untied": ("Qwen2ForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": False}),
    "qwen3moe-gqa-tied": ("Qwen3MoeForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "gemma2-gqa-tied": ("Gemma2ForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "gemma3-mha-untied": ("Gemma3ForCausalLM", {"num_kv_heads": 4, "tie_word_embeddings": False}),
}


def make_prompts(vocab_size: int) -> list[list[int]]:
    """Every other prompt starts with a shared prefix (prefix-cache hits in the batch)."""
    rng = random.Random(0)
    prefix = [rng.randrange(4, vocab_size) for _ in range(SHARED_PREFIX_LEN)]
    prompts = []
    for index, length in enumerate(PROMPT_LENGTHS):
        tokens = [rng.randrange(4, vocab_size) for _ in range(length)]
        prompts.append(prefix + tokens if index % 2 else tokens)
    return prompts


def hf_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [c.token_ids for c in transformers_greedy(folder, prompts, NUM_NEW_TOKENS)]


@pytest.mark.parametrize("model_name", list(MODELS))
def test_tp2_greedy_tokens_equal_transformers_in_a_mixed_batch(model_name, tmp_path):
    architecture, settings = MODELS[model_name]
    folder = make_tiny_model(tmp_path, architecture, **settings)
    prompts = make_prompts(AutoModelForCausalLM.from_pretrained(folder).config.vocab_size)
    expected = hf_greedy(folder, prompts)
    # 10 blocks of 16 slots cannot hold all eight requests at once: some are preempted.
    llm = call_with_timeout(
        lambda: LLM(
            model=str(folder), executor="multiproc", tensor_parallel_size=2, num_kv_blocks=10
        ),
        120,
        "constructing a tp=2 engine",
    )
    try:
        params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = call_with_timeout(
            lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params),
            120,
            "generate",
        )
        assert [out.outputs[0].token_ids for out in outputs] == expected
        engine_core = llm.llm_engine.engine_core
        assert engine_core.scheduler.num_preemptions > 0
        assert engine_core.kv_cache_manager.num_prefix_hit_tokens > 0
    finally:
        llm.llm_engine.shutdown()
