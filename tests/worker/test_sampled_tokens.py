"""Sampled tokens left on the device (async scheduling with ``uniproc``): the next step reads
a pending token from the sampled tensor, results resolve in sampling order, and requests
whose sampling reads their tokens wait for them."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from vlite import LLM, SamplingParams
from vlite.core.config import VliteConfig
from vlite.core.sampling_params import SamplingParams as Params
from vlite.testing.tiny_models import make_tiny_model
from vlite.worker.input_batch import CachedRequestState, prepare_inputs
from vlite.worker.sampled_tokens import SampledTokens, resolve_all


def state(request_id: str, token_ids: list[int], num_computed: int) -> CachedRequestState:
    return CachedRequestState(
        request_id=request_id,
        token_ids=list(token_ids),
        sampling_params=Params(),
        block_ids=[0, 1],
        num_computed_tokens=num_computed,
        num_prompt_tokens=2,
    )


def test_a_pending_token_is_read_from_the_sampled_tensor():
    waiting = state("a", [5, 6, 7], num_computed=3)  # its 4th token is still on the device
    waiting.pending_token = (torch.tensor([40, 41]), 1)
    known = state("b", [8, 9, 10, 11], num_computed=3)  # its 4th token is on the host
    inputs = prepare_inputs([waiting, known], [1, 1], block_size=16, device=torch.device("cpu"))
    assert inputs.input_ids.tolist() == [41, 11]
    assert inputs.positions.tolist() == [3, 3]
    assert inputs.sampled_request_ids == ["a", "b"]  # both reach the end of their tokens


def test_results_resolve_in_sampling_order_and_keep_a_later_pending_token():
    unresolved: deque[SampledTokens] = deque()
    request = state("a", [5, 6], num_computed=2)
    first = SampledTokens(["a"], [request], torch.tensor([7]), unresolved)
    second = SampledTokens(["a"], [request], torch.tensor([8]), unresolved)
    assert request.pending_token[0] is second.sampled
    assert second.result().sampled_token_ids == {"a": [8]}
    assert request.token_ids == [5, 6, 7, 8]  # the first batch's token first
    assert first.done() and first.result().sampled_token_ids == {"a": [7]}
    assert request.pending_token is None and not unresolved

    third = SampledTokens(["a"], [request], torch.tensor([9]), unresolved)
    fourth = SampledTokens(["a"], [request], torch.tensor([10]), unresolved)
    first_done = third.result()
    assert request.pending_token[0] is fourth.sampled  # the later batch's token stays
    resolve_all(unresolved)
    assert first_done.sampled_token_ids == {"a": [9]}
    assert request.token_ids == [5, 6, 7, 8, 9, 10] and request.pending_token is None


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM"))


def test_sampling_that_reads_tokens_sees_every_token_with_async_scheduling(tiny_llama):
    """Penalties and min_tokens read a request's tokens while sampling: the runner brings
    the tokens still on the device to the host first, so the outputs equal the plain step's."""
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 2 * i))} for i in range(4)]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.8),
        SamplingParams(max_tokens=10, temperature=0.0, frequency_penalty=1.5),
        SamplingParams(max_tokens=10, temperature=0.0, min_tokens=6, stop_token_ids=[3]),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    ]
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(model=tiny_llama, max_num_seqs=4, async_scheduling=async_scheduling)
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs[async_scheduling] = [o.outputs[0].token_ids for o in results]
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize(
    "settings,expected",
    [
        (dict(device="cpu"), False),
        (dict(device="cuda"), True),
        (dict(device="cuda", executor="multiproc"), False),
        (dict(device="cuda", async_scheduling=False), False),
        (dict(device="cpu", async_scheduling=True), True),
        # Speculation proposes each step's drafts from the step before's tokens.
        (dict(device="cuda", speculative_config={"method": "ngram"}), False),
    ],
)
def test_async_scheduling_is_on_by_default_with_uniproc_on_cuda(settings, expected):
    assert VliteConfig(**settings).resolved_async_scheduling is expected
