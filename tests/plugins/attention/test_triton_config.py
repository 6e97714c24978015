"""Launch choices of the Triton kernels: tiles, query-block counts, the split-K heuristic."""

from __future__ import annotations

import pytest

from vlite.plugins.attention.triton_kernels.config import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    choose_num_splits,
    choose_tiles,
    next_power_of_2,
    num_query_blocks,
)

H100_SMS = 132


@pytest.mark.parametrize(
    "batch, context, expected",
    [
        (1, 8192, 32),  # 8 programs: split to 2 per SM, capped by 256 keys per split
        (16, 2048, 3),  # 128 programs: 3 splits reach 264
        (4, 300, 1),  # short contexts: one split of >= 256 keys
        (64, 8192, 1),  # 512 programs already fill the GPU
        (1, 1 << 20, 33),
    ],
)
def test_split_heuristic_on_an_h100_with_8_kv_heads(batch, context, expected):
    assert choose_num_splits(batch * 8, context, H100_SMS) == expected


def test_splits_are_capped():
    assert choose_num_splits(1, 1 << 20, H100_SMS) == MAX_SPLITS


def test_splits_keep_a_minimum_of_keys_each():
    for context in (1, 255, 256, 511, 512, 5000):
        splits = choose_num_splits(1, context, H100_SMS)
        assert splits == 1 or context // splits >= MIN_KEYS_PER_SPLIT


def test_decode_tiles_take_one_token_and_the_whole_group():
    tiles = choose_tiles(4, 128, max_query_len=1, dtype_itemsize=2, interpreted=False)
    assert (tiles.block_q, tiles.group_p2, tiles.block_m) == (1, 4, 16)
    big_group = choose_tiles(32, 128, max_query_len=1, dtype_itemsize=2, interpreted=False)
    assert big_group.block_m == 32


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("interpreted", [False, True])
def test_prefill_tiles_cover_whole_groups(group, interpreted):
    tiles = choose_tiles(group, 64, max_query_len=500, dtype_itemsize=2, interpreted=interpreted)
    assert tiles.block_m == tiles.block_q * tiles.group_p2 >= 16
    assert tiles.group_p2 == next_power_of_2(group)


def test_short_prompts_get_short_query_blocks():
    tiles = choose_tiles(1, 64, max_query_len=5, dtype_itemsize=4, interpreted=False)
    assert tiles.block_q == 8 and tiles.block_m == 16


def test_query_blocks_cover_every_sequence():
    """Sequence s's blocks start at query_start_loc[s] // block_q + s and fit in the grid."""
    query_lens = [1, 17, 64, 3, 100, 1]
    for block_q in (1, 4, 16, 64):
        grid = num_query_blocks(sum(query_lens), len(query_lens), block_q)
        start = 0
        for seq, query_len in enumerate(query_lens):
            first = start // block_q + (seq if block_q > 1 else 0)
            assert first + -(-query_len // block_q) <= grid
            start += query_len
