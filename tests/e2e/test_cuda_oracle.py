"""The correctness oracle on a CUDA device: greedy float32 tokens equal transformers'.

The CPU suites prove the model code and the backends under the Triton interpreter; this one
runs the same engine on a GPU (compiled Triton kernels, CUDA tensors, the CUDA KV cache,
decode steps replayed from CUDA graphs, and eagerly) with TF32 off, one batch of prompts
crossing block boundaries, then the same prompts again through the prefix cache. Skipped
without a CUDA device (``pytest -m gpu`` on a GPU host).
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoConfig

from vlite import LLM, SamplingParams
from vlite.testing.engine_runs import transformers_greedy
from vlite.testing.tiny_models import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("exact_float32_products"),  # as the oracle's CPU run computes
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPT_LENGTHS = (1, 7, 16, 17, 40, 95)
NUM_NEW_TOKENS = 16
MODELS = {
    "llama-gqa-tied": ("LlamaForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "qwen3-mha-untied": ("Qwen3ForCausalLM", {"num_kv_heads": 4, "tie_word_embeddings": False}),
    "mixtral-gqa-untied": (
        "MixtralForCausalLM",
        {"num_kv_heads": 2, "tie_word_embeddings": False},
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def cuda_case(request, tmp_path_factory):
    """A tiny model folder, prompts sharing a 20-token prefix, and transformers' tokens."""
    architecture, settings = MODELS[request.param]
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), architecture, **settings)
    vocab_size = AutoConfig.from_pretrained(folder).vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(4, vocab_size) for _ in range(20)]
    prompts = []
    for length in PROMPT_LENGTHS:
        tokens = [rng.randrange(4, vocab_size) for _ in range(length)]
        tokens[: min(length, len(prefix))] = prefix[:length]
        prompts.append(tokens)
    expected = [c.token_ids for c in transformers_greedy(folder, prompts, NUM_NEW_TOKENS)]
    return folder, prompts, expected


@pytest.mark.parametrize(
    "backend, enforce_eager",
    [("torch", False), ("triton", False), ("triton", True)],
    ids=["torch", "triton-graphs", "triton-eager"],
)
def test_cuda_float32_greedy_equals_transformers(cuda_case, backend, enforce_eager):
    folder, prompts, expected = cuda_case
    llm = LLM(
        model=str(folder),
        device="cuda",
        dtype="float32",
        attention_backend=backend,
        num_kv_blocks=64,
        enforce_eager=enforce_eager,
    )
    worker = llm.llm_engine.engine_core.executor.worker
    # Decode steps replay CUDA graphs where the backend supports them, unless told not to.
    assert (worker.cuda_graph_report is not None) == (backend == "triton" and not enforce_eager)
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for _ in range(2):  # the second pass is served from the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(out.outputs[0].token_ids) for out in outputs] == expected
    assert llm.llm_engine.engine_core.kv_cache_manager.num_prefix_hit_tokens > 0
