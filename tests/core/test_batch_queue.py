"""The engine's batch queue (async scheduling on one stage; a pipeline's stages): several
batches in flight, no request in two of them, updates in scheduling order, and the same
greedy tokens as the plain four-stage step."""

from __future__ import annotations

import random

import pytest

from vlite import LLM, SamplingParams
from vlite.testing.tiny_models import make_tiny_model

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM"))


def prompts(count: int) -> list[dict]:
    rng = random.Random(3)
    return [
        {"prompt_token_ids": [rng.randrange(4, 300) for _ in range(rng.randint(3, 40))]}
        for _ in range(count)
    ]


def track_batches(llm: LLM) -> tuple[list[set[str]], list[int]]:
    """Record each submitted batch's request ids and how many batches were in flight,
    checking no request is in two of them and updates come in submission order."""
    core = llm.llm_engine.engine_core
    in_flight: list[set[str]] = []
    submitted: list[set[str]] = []
    depths: list[int] = []
    submit, update = core.executor.execute_model_async, core.scheduler.update_from_output

    def tracking_submit(scheduler_output):
        ids = set(scheduler_output.num_scheduled_tokens)
        for other in in_flight:
            assert not ids & other, f"requests {ids & other} in two batches in flight"
        in_flight.append(ids)
        submitted.append(ids)
        depths.append(len(in_flight))
        assert len(in_flight) <= core.max_batches_in_flight
        return submit(scheduler_output)

    def tracking_update(scheduler_output, runner_output):
        assert set(scheduler_output.num_scheduled_tokens) == in_flight.pop(0)  # in order
        return update(scheduler_output, runner_output)

    core.executor.execute_model_async = tracking_submit
    core.scheduler.update_from_output = tracking_update
    return submitted, depths


@pytest.mark.parametrize("num_kv_blocks", [None, 6])  # 6 blocks of 16: preemptions
def test_async_scheduling_gives_the_plain_steps_tokens(tiny_llama, num_kv_blocks):
    batch = prompts(10)
    plain = LLM(model=tiny_llama, num_kv_blocks=num_kv_blocks, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(batch, PARAMS, use_tqdm=False)]
    llm = LLM(model=tiny_llama, num_kv_blocks=num_kv_blocks, max_num_seqs=4, async_scheduling=True)
    assert llm.llm_engine.engine_core.max_batches_in_flight == 2
    submitted, depths = track_batches(llm)
    outputs = llm.generate(batch, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert max(len(ids) for ids in submitted) <= 2  # a half share of max_num_seqs=4
    assert max(depths) == 2  # two batches were in flight at once
    if num_kv_blocks is not None:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_the_plain_step_keeps_one_batch(tiny_llama):
    llm = LLM(model=tiny_llama)
    assert llm.llm_engine.engine_core.max_batches_in_flight == 1
