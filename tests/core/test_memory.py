"""The memory plan's arithmetic and the KV-cache sizing rule of a run with known requests."""

from __future__ import annotations

import msgspec
import pytest

from vlite.core.memory import (
    MemoryPlan,
    WorkerMemory,
    format_bytes,
    kv_cache_tokens_for_requests,
)


def size(sequences, *, max_model_len=512, block_size=16, max_num_seqs=256) -> int:
    return kv_cache_tokens_for_requests(
        sequences, max_model_len=max_model_len, block_size=block_size, max_num_seqs=max_num_seqs
    )


def test_each_sequence_takes_its_prompt_and_max_tokens_in_whole_blocks():
    # 3 + 5 = 8 tokens: one block; 10 + 7 = 17: two; 16 + 16 = 32: exactly two.
    assert size([(3, 5)]) == 16
    assert size([(10, 7)]) == 32
    assert size([(16, 16)]) == 32
    assert size([(3, 5), (10, 7), (16, 16)]) == (1 + 2 + 2) * 16


def test_the_context_ends_every_sequence():
    # 100 + 1024 tokens asked, but no sequence outgrows max_model_len=200: 13 blocks of 16.
    assert size([(100, 1024)], max_model_len=200) == 13 * 16


def test_only_the_largest_max_num_seqs_sequences_run_at_once():
    sequences = [(1, 15), (40, 8), (20, 12), (100, 28)]  # 1, 3, 2 and 8 blocks
    assert size(sequences, max_num_seqs=2) == (8 + 3) * 16
    assert size(sequences, max_num_seqs=1) == 8 * 16
    assert size(sequences, max_num_seqs=4) == (1 + 3 + 2 + 8) * 16


def test_an_empty_prompt_still_counts_one_block():
    # The engine refuses it later; the size never comes out as zero.
    assert size([(0, 0)]) == 16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_model_len": 0}, "max_model_len=0 is invalid: must be >= 1"),
        ({"block_size": 0}, "block_size=0 is invalid: must be >= 1"),
        ({"max_num_seqs": 0}, "max_num_seqs=0 is invalid: must be >= 1"),
    ],
)
def test_bad_sizes_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        size([(1, 1)], **kwargs)


def test_no_sequences_is_refused():
    with pytest.raises(ValueError, match="at least one sequence"):
        size([])


def test_the_plan_adds_up_over_its_workers():
    workers = [WorkerMemory(1000, 64), WorkerMemory(3000, 32)]
    plan = MemoryPlan.from_workers(workers, kv_cache_blocks=10, block_size=16)
    assert plan.weights_bytes == 4000
    assert plan.kv_cache_block_bytes == 96
    assert plan.kv_cache_bytes == 10 * 96
    assert plan.kv_cache_tokens == 10 * 16
    assert plan.total_bytes == 4000 + 960
    assert plan.num_workers == 2
    assert "over 2 workers" in plan.describe()


def test_a_plan_needs_a_worker():
    with pytest.raises(ValueError, match="at least one worker"):
        MemoryPlan.from_workers([], kv_cache_blocks=1, block_size=16)


def test_describe_states_weights_blocks_bytes_and_tokens():
    plan = MemoryPlan(
        weights_bytes=98_672_896, kv_cache_blocks=5, kv_cache_block_bytes=737_280, block_size=16
    )
    assert plan.describe() == (
        "weights 94.1 MiB, KV cache 5 blocks x 720.0 KiB = 3.5 MiB (80 tokens)"
    )


def test_one_block_is_one_block():
    plan = MemoryPlan(weights_bytes=0, kv_cache_blocks=1, kv_cache_block_bytes=2048, block_size=16)
    assert "KV cache 1 block x 2.0 KiB = 2.0 KiB (16 tokens)" in plan.describe()


def test_the_plan_travels_in_messages():
    plan = MemoryPlan(weights_bytes=1, kv_cache_blocks=2, kv_cache_block_bytes=3, block_size=4)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=MemoryPlan)
    assert decoded == plan


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (3 << 20, "3.0 MiB"), (2 << 30, "2.0 GiB")],
)
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text
