"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's log-probability
after the tokens before it equals transformers' log-softmax on the same float32 weights,
whatever the chunking, with prefix caching on (such requests do not read it), under
preemption (a recompute adds no entry twice), with ``n > 1`` and tensor parallelism; on
the quantized path they stay close to the float32 path's."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from vlite import LLM, SamplingParams
from vlite.testing.engine_runs import cached_tiny_model

NUM_TOP = 3
rng = random.Random(3)
PROMPTS = [[rng.randrange(4, 300) for _ in range(n)] for n in (2, 17, 40)]


@pytest.fixture(scope="module")
def folder():
    return str(cached_tiny_model("LlamaForCausalLM"))


@pytest.fixture(scope="module")
def expected(folder):
    """Each prompt's ``[len - 1, vocab]`` log-softmax from transformers."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0, :-1].log_softmax(-1) for p in PROMPTS]


def prompt_logprobs(llm, n=1, max_tokens=2):
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, prompt_logprobs=NUM_TOP, n=n, ignore_eos=True
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [output.prompt_logprobs for output in outputs]


def check(results, expected, tolerance=1e-4):
    for prompt, logprobs, reference in zip(PROMPTS, results, expected):
        assert len(logprobs) == len(prompt) and logprobs[0] is None
        for position in range(1, len(prompt)):
            entry, row = logprobs[position], reference[position - 1]
            token = prompt[position]
            assert abs(entry[token].logprob - row[token].item()) < tolerance
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(NUM_TOP)
            for logprob, token_id in zip(top.values.tolist(), top.indices.tolist()):
                assert abs(entry[token_id].logprob - logprob) < tolerance
            assert len(entry) in (NUM_TOP, NUM_TOP + 1)  # the prompt's token, if not in the top


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 8},
        {"num_kv_blocks": 13, "block_size": 4, "enable_chunked_prefill": True,
         "max_num_batched_tokens": 16},
    ],
    ids=["whole", "chunked", "preempted"],
)  # fmt: skip
def test_prompt_logprobs_equal_transformers(folder, expected, settings):
    llm = LLM(model=folder, **settings)
    # Long enough outputs that the running requests outgrow the small cache.
    check(prompt_logprobs(llm, max_tokens=10), expected)
    if "num_kv_blocks" in settings:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_prefix_hits_do_not_take_them_away(folder, expected):
    llm = LLM(model=folder, enable_prefix_caching=True, block_size=4)
    check(prompt_logprobs(llm), expected)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(max_tokens=1, prompt_logprobs=NUM_TOP),
        use_tqdm=False,
    )
    check([output.prompt_logprobs for output in outputs], expected)
    assert all(output.num_cached_tokens == 0 for output in outputs)


def test_with_several_samples(folder, expected):
    check(prompt_logprobs(LLM(model=folder), n=2), expected)


def test_without_them_there_are_none(folder):
    output = LLM(model=folder).generate(
        [{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=1), use_tqdm=False
    )[0]
    assert output.prompt_logprobs is None


def test_with_tensor_parallelism(folder, expected):
    llm = LLM(model=folder, executor="multiproc", tensor_parallel_size=2)
    try:
        check(prompt_logprobs(llm), expected)
    finally:
        llm.llm_engine.shutdown()


def test_the_quantized_path_is_close_to_the_float32_path():
    """The default model's GGUF file, kept quantized, against the same file in float32."""
    prompt = [{"prompt_token_ids": [1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767]}]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def run(**settings):
        output = LLM(num_kv_blocks=16, **settings).generate(prompt, params, use_tqdm=False)[0]
        return [
            entry[token].logprob
            for entry, token in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])
        ]

    quantized, float32 = run(), run(quantization="none")
    assert max(abs(a - b) for a, b in zip(quantized, float32)) < 1e-2
