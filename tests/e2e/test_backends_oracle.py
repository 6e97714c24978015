"""The correctness oracle for the ``triton`` and ``flash`` attention backends, and for
speculative decoding on every architecture.

Greedy float32 tokens through ``LLM(attention_backend=...)`` equal ``transformers``'
``generate``, on tiny random models (GQA with tied embeddings, MHA with untied ones; one
batch of prompts crossing block boundaries, then the same prompts again through the prefix
cache) and on the default model (SmolLM2-135M from its GGUF file). Without a GPU the
``triton`` kernels run under the Triton interpreter, so prompts and token counts are small.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from vlite import LLM, SamplingParams
from vlite.testing.tiny_models import make_tiny_model

BACKENDS = ("triton", "flash")
PROMPT_LENGTHS = (1, 15, 17, 33, 40)
NUM_NEW_TOKENS = 10
MODELS = {
    "llama-gqa-tied": ("LlamaForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "qwen3-mha-untied": ("Qwen3ForCausalLM", {"num_kv_heads": 4, "tie_word_embeddings": False}),
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
    "olmoe-gqa-untied": ("OlmoeForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": False}),
    "mistral-w12-gqa-tied": (
        "MistralForCausalLM",
        {"num_kv_heads": 2, "tie_word_embeddings": True, "sliding_window": 12},
    ),
    "qwen2-mha-untied": ("Qwen2ForCausalLM", {"num_kv_heads": 4, "tie_word_embeddings": False}),
    "qwen3moe-gqa-tied": ("Qwen3MoeForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "gemma2-gqa-tied": ("Gemma2ForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "gemma3-mha-untied": ("Gemma3ForCausalLM", {"num_kv_heads": 4, "tie_word_embeddings": False}),
}


def hf_greedy(model, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    model.generation_config.eos_token_id = None  # like ignore_eos
    continuations = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=num_new_tokens,
                do_sample=False,
            )
        continuations.append(out[0, len(prompt) :].tolist())
    return continuations


def vlite_greedy(llm: LLM, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=num_new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny_case(request, tmp_path_factory):
    """A tiny model folder, prompts sharing a 20-token prefix, and transformers' tokens."""
    architecture, settings = MODELS[request.param]
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), architecture, **settings)
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(4, vocab_size) for _ in range(20)]
    prompts = []
    for length in PROMPT_LENGTHS:
        tokens = [rng.randrange(4, vocab_size) for _ in range(length)]
        if length > len(prefix):
            tokens[: len(prefix)] = prefix
        prompts.append(tokens)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return folder, prompts, hf_greedy(model, prompts, NUM_NEW_TOKENS)


def test_tiny_models_with_speculative_decoding(tiny_case):
    """Every architecture verifies drafts exactly: the model drafting for itself (drafts
    right but for float noise) keeps transformers' tokens, through the prefix cache too."""
    folder, prompts, expected = tiny_case
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    llm = LLM(model=str(folder), speculative_config=spec, num_kv_blocks=48)
    assert vlite_greedy(llm, prompts, NUM_NEW_TOKENS) == expected
    assert vlite_greedy(llm, prompts, NUM_NEW_TOKENS) == expected
    assert llm.llm_engine.engine_core.scheduler.num_accepted_tokens > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_models_in_one_batch_then_from_the_prefix_cache(tiny_case, backend):
    folder, prompts, expected = tiny_case
    llm = LLM(model=str(folder), attention_backend=backend, num_kv_blocks=32)
    assert llm.llm_engine.engine_core.executor.worker.attention_backend_name == backend

    assert vlite_greedy(llm, prompts, NUM_NEW_TOKENS) == expected
    kv_cache = llm.llm_engine.engine_core.kv_cache_manager
    hits_before = kv_cache.num_prefix_hit_tokens
    assert vlite_greedy(llm, prompts, NUM_NEW_TOKENS) == expected
    assert kv_cache.num_prefix_hit_tokens > hits_before


# ---- the default model -------------------------------------------------------------------

DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):")
DEFAULT_NEW_TOKENS = 4


def _default_model_file() -> Path:
    from vlite.models.spec import DEFAULT_MODEL_INSTALL, DEFAULT_MODEL_PACKAGE

    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip(f"the default model is not installed: {DEFAULT_MODEL_INSTALL}")
    from vlite.models.spec import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def default_model_oracle():
    """Prompt ids and transformers' greedy tokens for the default model.

    transformers' own GGUF loader takes ~30 s; tests/models/test_gguf.py shows that vlite's
    GGUF config and dequantized weights equal what it loads, so here transformers' Llama is
    built from those directly (a few seconds) and runs as the oracle.
    """
    from vlite.models.gguf import gguf_hf_config, iter_gguf_weights, load_gguf_tokenizer, read_gguf

    path = _default_model_file()
    model = AutoModelForCausalLM.from_config(gguf_hf_config(read_gguf(path)), dtype=torch.float32)
    weights = dict(iter_gguf_weights(path, show_progress=False))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected  # lm_head is tied
    model.tie_weights()
    tokenizer = load_gguf_tokenizer(path)
    prompts = [tokenizer.encode(text) for text in DEFAULT_PROMPTS]
    return prompts, hf_greedy(model.eval(), prompts, DEFAULT_NEW_TOKENS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_model(default_model_oracle, backend):
    prompts, expected = default_model_oracle
    llm = LLM(dtype="float32", num_kv_blocks=16, attention_backend=backend)  # no model: default
    assert vlite_greedy(llm, prompts, DEFAULT_NEW_TOKENS) == expected
