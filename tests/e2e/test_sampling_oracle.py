"""The oracle for the sampling options: greedy float32 with a repetition
penalty equals transformers' ``generate(..., repetition_penalty=...)``, and logprobs equal
the log-softmax of transformers' raw logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from vlite import LLM, SamplingParams
from vlite.testing.tiny_models import make_tiny_model

NUM_NEW_TOKENS = 16
PROMPTS = [
    [5, 9, 5, 9, 5],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47],
    [7],
]
NUM_TOP = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    # One architecture: the penalty and logprobs live after the model, which the main
    # oracle checks for every architecture.
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM")


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like ignore_eos
    return model


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(model=str(tiny_model), dtype="float32")


def hf_generate(model, prompt: list[int], **kw):
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
            **kw,
        )


@pytest.mark.parametrize("penalty", [1.5, 0.7])  # discourage and encourage repeats
def test_repetition_penalty_matches_transformers(hf_model, llm, penalty):
    expected = [
        hf_generate(hf_model, prompt, repetition_penalty=penalty)
        .sequences[0, len(prompt) :]
        .tolist()
        for prompt in PROMPTS
    ]
    params = SamplingParams(
        max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=penalty
    )

    # All in one batch, beside a request without the penalty.
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in [*PROMPTS, PROMPTS[0]]],
        [params] * len(PROMPTS) + [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)],
        use_tqdm=False,
    )

    assert [o.outputs[0].token_ids for o in outputs[:-1]] == expected
    plain = hf_generate(hf_model, PROMPTS[0]).sequences[0, len(PROMPTS[0]) :].tolist()
    assert outputs[-1].outputs[0].token_ids == plain[:4]
    assert expected[0] != plain, "the penalty changed nothing: a weak test"


def test_logprobs_equal_the_log_softmax_of_transformers_logits(hf_model, llm):
    params = SamplingParams(
        max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=NUM_TOP
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)

    for prompt, output in zip(PROMPTS, outputs):
        hf = hf_generate(hf_model, prompt, output_logits=True)
        completion = output.outputs[0]
        assert completion.token_ids == hf.sequences[0, len(prompt) :].tolist()
        for token_id, position, logits in zip(completion.token_ids, completion.logprobs, hf.logits):
            expected = torch.log_softmax(logits[0].float(), dim=-1)
            assert abs(position[token_id].logprob - expected[token_id].item()) < 1e-4
            top = expected.topk(NUM_TOP)
            ranked = sorted(position.items(), key=lambda item: item[1].rank)
            assert [token for token, _ in ranked] == top.indices.tolist()
            got = torch.tensor([lp.logprob for _, lp in ranked])
            torch.testing.assert_close(got, top.values, atol=1e-4, rtol=0)
        total = sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs))
        assert abs(completion.cumulative_logprob - total) < 1e-6
