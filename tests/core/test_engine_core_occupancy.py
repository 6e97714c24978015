"""EngineCore.occupancy() and fail_unfinished_requests(): what the core process asks for."""

from __future__ import annotations

from vlite import LLM
from vlite.core.request import EngineCoreRequest
from vlite.core.sampling_params import SamplingParams
from vlite.testing.engine_runs import cached_tiny_model


def test_occupancy_follows_requests_and_failing_them_frees_everything():
    core = LLM(model=str(cached_tiny_model()), num_kv_blocks=32).llm_engine.engine_core
    empty = core.occupancy()
    assert (empty.num_kv_blocks, empty.num_free_kv_blocks, empty.kv_cache_usage) == (32, 32, 0.0)

    for request_id in ("a", "b"):
        core.add_request(EngineCoreRequest(request_id, [5, 6, 7], SamplingParams(max_tokens=8)))
    queued = core.occupancy()
    assert (queued.num_unfinished_requests, queued.num_waiting_requests) == (2, 2)
    core.step()
    running = core.occupancy()
    assert (running.num_running_requests, running.num_waiting_requests) == (2, 0)
    assert running.num_free_kv_blocks < 32 and running.kv_cache_usage > 0

    assert sorted(core.fail_unfinished_requests()) == ["a", "b"]
    after = core.occupancy()
    assert (after.num_unfinished_requests, after.num_free_kv_blocks) == (0, 32)
