"""A model whose keys depend on the sequence's length (``recompute_past_length``, LongRoPE):
the scheduler computes a request's cache again from position 0 once it outgrows the length,
within the token budget, in the blocks it holds."""

from __future__ import annotations


def scheduled(result) -> dict[str, int]:
    return dict(result.scheduler_output.num_scheduled_tokens)


def test_a_request_that_outgrows_the_length_is_recomputed_once(make_engine):
    engine = make_engine(recompute_past_length=5)
    engine.add("a", [1, 2, 3, 4], max_tokens=4)
    # 4 prompt tokens; knows 5 after step 1 (not past 5), 6 after step 2: then all 6 again.
    assert [scheduled(engine.step()) for _ in range(4)] == [{"a": 4}, {"a": 1}, {"a": 6}, {"a": 1}]


def test_the_recompute_goes_to_the_worker_as_a_restart_in_the_same_blocks(make_engine):
    engine = make_engine(recompute_past_length=5, block_size=4)
    engine.add("a", [1, 2, 3, 4], max_tokens=4)
    engine.step()
    engine.step()
    blocks = engine.kv_cache.block_ids_of("a")
    result = engine.step()
    (cached,) = result.scheduler_output.cached_requests
    assert (cached.num_computed_tokens, cached.is_resumed) == (0, False)
    assert cached.new_token_ids == [1, 2, 3, 4, 1000, 1001]
    assert engine.kv_cache.block_ids_of("a")[: len(blocks)] == blocks


def test_a_prompt_past_the_length_is_never_recomputed(make_engine):
    engine = make_engine(recompute_past_length=5)
    engine.add("a", [1, 2, 3, 4, 5, 6], max_tokens=4)
    assert [scheduled(engine.step()) for _ in range(3)] == [{"a": 6}, {"a": 1}, {"a": 1}]


def test_the_recompute_is_chunked_to_the_budget(make_engine):
    engine = make_engine(
        recompute_past_length=8,
        enable_chunked_prefill=True,
        max_num_batched_tokens=4,
    )
    engine.add("a", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=3)
    steps = [scheduled(engine.step()) for _ in range(5)]
    # prompt in two chunks; its first token makes 9 known: 9 again in chunks of 4, 4, 1.
    assert steps == [{"a": 4}, {"a": 4}, {"a": 4}, {"a": 4}, {"a": 1}]
    assert engine.scheduler.requests["a"].num_computed_tokens == 9


def test_without_the_setting_nothing_is_recomputed(make_engine):
    engine = make_engine()
    engine.add("a", [1, 2, 3, 4], max_tokens=4)
    assert [scheduled(engine.step()) for _ in range(4)] == [{"a": 4}, {"a": 1}, {"a": 1}, {"a": 1}]
