"""The engine's batch queue (async scheduling on one stage; a pipeline's stages): several
batches in flight, updates in scheduling order, and the same greedy tokens as the plain
four-stage step. On one stage a request in a batch in flight goes on in the next batch with
the token that batch samples (a decode overlap); in no other way is a request in two."""

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


def track_batches(llm: LLM) -> tuple[list[set[str]], list[int], list[set[str]]]:
    """Record each submitted batch's request ids, how many batches were in flight and the
    requests overlapping a batch in flight, checking that an overlap computes exactly one
    token (the one the batch in flight samples) and updates come in submission order."""
    core = llm.llm_engine.engine_core
    in_flight: list[set[str]] = []
    submitted: list[set[str]] = []
    depths: list[int] = []
    overlaps: list[set[str]] = []
    submit, update = core.executor.execute_model_async, core.scheduler.update_from_output

    def tracking_submit(scheduler_output):
        ids = set(scheduler_output.num_scheduled_tokens)
        overlapping = {i for other in in_flight for i in ids & other}
        for request_id in overlapping:
            assert scheduler_output.num_scheduled_tokens[request_id] == 1
        overlaps.append(overlapping)
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
    return submitted, depths, overlaps


@pytest.mark.parametrize("num_kv_blocks", [None, 6])  # 6 blocks of 16: preemptions
def test_async_scheduling_gives_the_plain_steps_tokens(tiny_llama, num_kv_blocks):
    batch = prompts(10)
    plain = LLM(
        model=tiny_llama, num_kv_blocks=num_kv_blocks, max_num_seqs=4, async_scheduling=False
    )
    expected = [o.outputs[0].token_ids for o in plain.generate(batch, PARAMS, use_tqdm=False)]
    llm = LLM(model=tiny_llama, num_kv_blocks=num_kv_blocks, max_num_seqs=4, async_scheduling=True)
    assert llm.llm_engine.engine_core.max_batches_in_flight == 2
    submitted, depths, overlaps = track_batches(llm)
    outputs = llm.generate(batch, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert max(len(ids) for ids in submitted) == 4  # every running request, overlapping
    assert max(depths) == 2  # two batches were in flight at once
    assert sum(map(len, overlaps)) > 0
    if num_kv_blocks is not None:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_the_plain_step_keeps_one_batch(tiny_llama):
    llm = LLM(model=tiny_llama, async_scheduling=False)
    assert llm.llm_engine.engine_core.max_batches_in_flight == 1


def test_overlapped_decodes_stop_where_the_plain_step_stops(tiny_llama):
    """A request that stops on a sampled token (here a stop token id, as EOS would) has
    already been scheduled once more; that token is dropped, the text ends where it ends
    without overlap, and lengths (max_tokens 1 to 9) never overrun."""
    batch = prompts(8)
    plain = LLM(model=tiny_llama, max_num_seqs=8, async_scheduling=False)
    free_run = plain.generate(batch, PARAMS, use_tqdm=False)
    # Each prompt stops at the 4th distinct token it would generate.
    params = [
        SamplingParams(
            max_tokens=1 + i,
            temperature=0.0,
            stop_token_ids=[list(dict.fromkeys(out.outputs[0].token_ids))[3]],
        )
        for i, out in enumerate(free_run)
    ]
    expected = [o.outputs[0] for o in plain.generate(batch, params, use_tqdm=False)]
    llm = LLM(model=tiny_llama, max_num_seqs=8, async_scheduling=True)
    _, _, overlaps = track_batches(llm)
    outputs = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [
        (o.token_ids, o.finish_reason) for o in expected
    ]
    assert {"stop", "length"} <= {o.finish_reason for o in outputs}
    assert sum(map(len, overlaps)) > 0
    scheduler = llm.llm_engine.engine_core.scheduler
    assert not scheduler.in_flight and not scheduler.requests
    assert scheduler.kv_cache_manager.num_used_blocks == 0


def test_overlapped_decodes_publish_generated_blocks_for_prefix_hits(tiny_llama):
    """Blocks filled by generated tokens are published only once their tokens are known,
    so a follow-up prompt holding a request's prompt and answer hits them as without
    overlap (a block published early would carry the hash of a partial block)."""
    first = {"prompt_token_ids": list(range(5, 25))}  # 20 tokens; 40 more generated
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    hits = []
    for async_scheduling in (False, True):
        llm = LLM(model=tiny_llama, max_num_seqs=4, async_scheduling=async_scheduling)
        answer = llm.generate([first], params, use_tqdm=False)[0].outputs[0].token_ids
        kv = llm.llm_engine.engine_core.kv_cache_manager
        before = kv.num_prefix_hit_tokens
        follow_up = {"prompt_token_ids": first["prompt_token_ids"] + list(answer) + [7, 8]}
        llm.generate([follow_up], SamplingParams(max_tokens=1), use_tqdm=False)
        hits.append(kv.num_prefix_hit_tokens - before)
    assert hits[0] == 48  # three full blocks of the 62-token prompt (the last is computed)
    assert hits[1] == hits[0]
