"""Quantized GGUF models at tensor-parallel size 2 (``multiproc`` workers, gloo): each rank
keeps its share of every quantized matrix (rows, whole blocks of columns, whole experts) in
the weight format, and the greedy tokens equal the single-process quantized run's."""

from __future__ import annotations

import pytest

from vlite import LLM, SamplingParams
from vlite.testing.tiny_gguf import write_tiny_gguf
from vlite.testing.tiny_models import make_tiny_model

#: case -> (architecture, tiny model settings, (matrix type, embedding type)).
CASES = {
    "llama": ("LlamaForCausalLM", {"num_kv_heads": 2}, ("Q4_1", "Q8_0")),
    "qwen3moe": ("Qwen3MoeForCausalLM", {"num_kv_heads": 2}, ("Q8_0", "Q8_0")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp2_quantized_tokens_equal_the_single_process_run(case, tmp_path):
    architecture, settings, quantize = CASES[case]
    folder = make_tiny_model(tmp_path / "hf", architecture, **settings)
    path = write_tiny_gguf(folder, tmp_path / "tiny-q.gguf", quantize=quantize)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9], list(range(20, 60)), [3])]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens, weights_bytes = {}, {}
    for size, quantization in ((1, "auto"), (2, "auto"), (1, "none")):
        executor = "multiproc" if size > 1 else "uniproc"
        llm = LLM(
            model=str(path),
            executor=executor,
            tensor_parallel_size=size,
            quantization=quantization,
            num_kv_blocks=16,
        )
        try:
            weights_bytes[size, quantization] = llm.llm_engine.memory_plan.weights_bytes
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[size, quantization] = [output.outputs[0].token_ids for output in outputs]
        finally:
            llm.llm_engine.shutdown()
    assert tokens[2, "auto"] == tokens[1, "auto"]
    # The ranks hold quantized shards: together (the embedding on both) far less than the
    # float32 model.
    assert weights_bytes[2, "auto"] < 0.6 * weights_bytes[1, "none"], weights_bytes
