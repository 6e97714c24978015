"""prepare_inputs: a step's tokens laid end to end, with positions, cache slots, block tables
and the rows that sample."""

from __future__ import annotations

import torch

from vlite.core.sampling_params import SamplingParams
from vlite.worker.input_batch import CachedRequestState, prepare_inputs
from vlite.worker.input_buffers import InputBuffers


def state(request_id: str, num_tokens: int, blocks: list[int], computed: int) -> CachedRequestState:
    return CachedRequestState(
        request_id=request_id,
        token_ids=list(range(100, 100 + num_tokens)),
        sampling_params=SamplingParams(),
        block_ids=blocks,
        num_computed_tokens=computed,
        num_prompt_tokens=num_tokens,
    )


def test_a_mixed_step_lays_tokens_end_to_end():
    # a: a 5-token prompt chunk of a 9-token prompt (no sample); b: one decode after 17
    # cached tokens, crossing into its second block; c: a whole 3-token prompt.
    states = [state("a", 9, [7], 0), state("b", 18, [3, 9], 17), state("c", 3, [4], 0)]
    inputs = prepare_inputs(states, [5, 1, 3], block_size=16, device=torch.device("cpu"))
    assert inputs.input_ids.tolist() == [100, 101, 102, 103, 104, 117, 100, 101, 102]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 17, 0, 1, 2]
    metadata = inputs.attn_metadata
    assert metadata.slot_mapping.tolist() == [112, 113, 114, 115, 116, 9 * 16 + 1, 64, 65, 66]
    assert metadata.query_start_loc.tolist() == [0, 5, 6, 9]
    assert metadata.seq_lens.tolist() == [5, 18, 3]
    assert metadata.block_tables.tolist() == [[7, 0], [3, 9], [4, 0]]
    assert (metadata.max_query_len, metadata.max_seq_len) == (5, 18)
    assert (metadata.query_lens_cpu, metadata.seq_lens_cpu) == ([5, 1, 3], [5, 18, 3])
    # Only sequences reaching the end of their known tokens sample: b and c.
    assert inputs.logits_indices.tolist() == [5, 8]
    assert inputs.sampled_request_ids == ["b", "c"]
    # a and c start their caches now, knowing 9 and 3 tokens; b never did (0).
    assert metadata.context_lens_at_cache_start.tolist() == [9] * 5 + [0] + [3] * 3


def test_a_cache_started_again_from_position_0_records_what_it_knows_then():
    # b's cache was started knowing 4 tokens; it now knows 6 and is computed again from 0
    # (a scheduler's recompute), while a goes on with the count it started with.
    a, b = state("a", 5, [1], 4), state("b", 6, [2], 0)
    a.num_tokens_at_cache_start, b.num_tokens_at_cache_start = 2, 4
    inputs = prepare_inputs([a, b], [1, 6], 16, torch.device("cpu"))
    assert inputs.attn_metadata.context_lens_at_cache_start.tolist() == [2] + [6] * 6
    assert (a.num_tokens_at_cache_start, b.num_tokens_at_cache_start) == (2, 6)


def test_a_pending_sampled_token_counts_as_known_when_a_cache_starts():
    b = state("b", 3, [2], 0)
    b.pending_token = (torch.tensor([7]), 0)  # sampled on the device, not yet on the host
    inputs = prepare_inputs([b], [4], 16, torch.device("cpu"))
    assert inputs.input_ids.tolist() == [100, 101, 102, 7]
    assert b.num_tokens_at_cache_start == 4


def test_steps_fill_the_same_persistent_buffers_in_place():
    buffers = InputBuffers(torch.device("cpu"))
    first = prepare_inputs([state("a", 5, [7], 0)], [5], 16, torch.device("cpu"), buffers)
    pointer = first.input_ids.data_ptr()
    second = prepare_inputs([state("b", 3, [2], 0)], [3], 16, torch.device("cpu"), buffers)
    assert second.input_ids.data_ptr() == pointer  # nothing allocated
    assert second.input_ids.tolist() == [100, 101, 102]
    assert second.attn_metadata.block_tables.is_contiguous()


def test_a_step_larger_than_the_buffers_grows_them():
    buffers = InputBuffers(torch.device("cpu"))
    capacity = buffers.capacity("input_ids")
    big = state("big", capacity + 10, list(range(40)), 0)
    inputs = prepare_inputs([big], [capacity + 10], 16, torch.device("cpu"), buffers)
    assert buffers.capacity("input_ids") >= capacity + 10
    assert inputs.input_ids.tolist() == list(range(100, 100 + capacity + 10))
    assert inputs.positions[-1].item() == capacity + 9


def test_a_narrower_block_table_is_zero_padded_over_what_a_wider_step_left():
    buffers = InputBuffers(torch.device("cpu"))
    prepare_inputs([state("w", 40, [5, 6, 7], 0)], [40], 16, torch.device("cpu"), buffers)
    rows = [state("a", 3, [9], 0), state("b", 20, [3, 4], 0)]
    inputs = prepare_inputs(rows, [3, 20], 16, torch.device("cpu"), buffers)
    assert inputs.attn_metadata.block_tables.tolist() == [[9, 0], [3, 4]]
    assert inputs.attn_metadata.block_tables.dtype == torch.int32
