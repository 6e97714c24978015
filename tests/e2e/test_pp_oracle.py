"""The correctness oracle under pipeline parallelism: ``multiproc`` workers split into
stages give the same greedy float32 tokens as transformers' ``generate``.

Tiny four-layer models at pp=2 (two layers a stage), tp=2 x pp=2 (four processes) and an
uneven pp=3 split; all prompts in one batch queue (as many batches in flight as stages),
with prefix-cache hits and forced preemption.
"""

from __future__ import annotations

import pytest
from test_tp_oracle import NUM_NEW_TOKENS, hf_greedy, make_prompts
from transformers import AutoModelForCausalLM

from vlite import LLM, SamplingParams
from vlite.testing.engine_runs import call_with_timeout
from vlite.testing.tiny_models import make_tiny_model

CASES = {
    "llama-pp2": ("LlamaForCausalLM", 1, 2, {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "qwen3-tp2-pp2": ("Qwen3ForCausalLM", 2, 2, {"num_kv_heads": 2, "tie_word_embeddings": False}),
    "mixtral-pp2": ("MixtralForCausalLM", 1, 2, {"num_kv_heads": 2, "tie_word_embeddings": False}),
    "gemma2-pp2": (
        "Gemma2ForCausalLM",
        1,
        2,
        {"num_kv_heads": 2, "layer_types": ["sliding_attention", "full_attention"] * 2},
    ),
    "smollm3-pp3-uneven": (
        "SmolLM3ForCausalLM",
        1,
        3,
        {"num_kv_heads": 2, "tie_word_embeddings": True},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_greedy_tokens_equal_transformers(case, tmp_path):
    architecture, tp, pp, settings = CASES[case]
    folder = make_tiny_model(tmp_path, architecture, num_hidden_layers=4, **settings)
    prompts = make_prompts(AutoModelForCausalLM.from_pretrained(folder).config.vocab_size)
    expected = hf_greedy(folder, prompts)
    llm = call_with_timeout(
        lambda: LLM(
            model=str(folder),
            executor="multiproc",
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            num_kv_blocks=10,  # too few for all eight requests: some are preempted
        ),
        180,
        f"constructing a tp={tp} x pp={pp} engine",
    )
    try:
        engine_core = llm.llm_engine.engine_core
        assert engine_core.max_batches_in_flight == pp
        params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = call_with_timeout(
            lambda: llm.generate([{"prompt_token_ids": p} for p in prompts], params),
            180,
            "generate",
        )
        assert [out.outputs[0].token_ids for out in outputs] == expected
        assert engine_core.scheduler.num_preemptions > 0
        assert engine_core.kv_cache_manager.num_prefix_hit_tokens > 0
    finally:
        llm.llm_engine.shutdown()


def test_async_scheduling_with_multiproc_workers(tmp_path):
    """One stage, two batches in flight: the workers compute one while the engine
    schedules the next."""
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM", num_kv_heads=2)
    prompts = make_prompts(AutoModelForCausalLM.from_pretrained(folder).config.vocab_size)
    expected = hf_greedy(folder, prompts)
    llm = LLM(model=str(folder), executor="multiproc", async_scheduling=True)
    try:
        assert llm.llm_engine.engine_core.max_batches_in_flight == 2
        params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [out.outputs[0].token_ids for out in outputs] == expected
    finally:
        llm.llm_engine.shutdown()
