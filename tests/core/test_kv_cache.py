"""KVCacheManager: block allocation, ref counts, prefix caching and LRU eviction.

The helpers below play the scheduler's part: look up the cached prefix of a request that
holds no blocks, allocate, and advance ``num_computed_tokens`` as a forward pass would.
"""

from __future__ import annotations

import random

import pytest

from vlite.core.kv_cache import KVCacheManager
from vlite.core.request import EngineCoreRequest, Request
from vlite.core.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(EngineCoreRequest(request_id, list(token_ids), SamplingParams(max_tokens=64)))


def admit(kv: KVCacheManager, request: Request) -> list[int] | None:
    """Admit a waiting request as the scheduler does and compute its prompt."""
    cached_prefix = kv.find_cached_prefix(request)
    num_cached = len(cached_prefix) * kv.block_size
    block_ids = kv.allocate_slots(request, request.num_tokens - num_cached, cached_prefix)
    if block_ids is not None:
        request.num_computed_tokens = request.num_tokens  # the prompt's forward pass
    return block_ids


def decode(kv: KVCacheManager, request: Request, token_id: int) -> list[int] | None:
    """Append a sampled token and make room for it, as the next step does."""
    request.append_output_token(token_id)
    block_ids = kv.allocate_slots(request, 1)
    if block_ids is not None:
        request.num_computed_tokens += 1
    return block_ids


def ref_counts(kv: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [kv.blocks[block_id].ref_count for block_id in block_ids]


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_used_blocks == 0
    assert all(block.ref_count == 0 for block in kv.blocks)


# ---- allocation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "num_blocks"), [(1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (16, 4)]
)
def test_allocate_takes_ceil_num_tokens_over_block_size_blocks(num_tokens, num_blocks):
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(num_tokens)))

    block_ids = kv.allocate_slots(request, num_tokens)

    assert block_ids is not None
    assert len(block_ids) == num_blocks == kv.num_blocks_for(num_tokens)
    assert len(set(block_ids)) == num_blocks
    assert kv.block_ids_of("a") == block_ids
    assert kv.num_free_blocks == 10 - num_blocks
    assert ref_counts(kv, block_ids) == [1] * num_blocks


def test_block_ids_are_unique_across_requests():
    kv = KVCacheManager(num_blocks=12, block_size=BLOCK_SIZE)
    requests = [make_request(str(i), [100 * i + t for t in range(7)]) for i in range(5)]

    all_ids = [block_id for request in requests for block_id in admit(kv, request)]

    assert len(all_ids) == 10
    assert len(set(all_ids)) == 10
    assert all(0 <= block_id < 12 for block_id in all_ids)
    assert kv.num_free_blocks == 2


def test_slots_grow_across_block_boundary_on_later_calls():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3, 4])
    first = admit(kv, request)
    assert len(first) == 1

    grown = [decode(kv, request, 100 + i) for i in range(5)]  # tokens 5..9

    # Token 5 opens block 2, tokens 6-8 fit in it, token 9 opens block 3.
    assert [len(ids) for ids in grown] == [1, 0, 0, 0, 1]
    table = kv.block_ids_of("a")
    assert table == first + grown[0] + grown[4]
    assert len(set(table)) == 3
    slots = [table[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(9)]
    assert len(set(slots)) == 9
    assert kv.num_free_blocks == 5


def test_free_returns_every_block_and_twice_is_a_no_op():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    a, b = make_request("a", list(range(10))), make_request("b", list(range(50, 55)))
    admit(kv, a)
    admit(kv, b)
    assert kv.num_free_blocks == 1

    kv.free(a)
    assert kv.num_free_blocks == 4
    assert kv.block_ids_of("a") == []
    kv.free(a)
    assert kv.num_free_blocks == 4
    assert ref_counts(kv, kv.block_ids_of("b")) == [1, 1]

    kv.free(b)
    assert_all_free(kv)


def test_allocation_failure_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    holder = make_request("holder", list(range(12)))
    admit(kv, holder)
    held = kv.block_ids_of("holder")
    big = make_request("big", list(range(100, 108)))

    assert kv.allocate_slots(big, 8) is None

    assert kv.num_free_blocks == 1
    assert kv.block_ids_of("big") == []
    assert kv.block_ids_of("holder") == held
    assert ref_counts(kv, list(range(4))) == [1 if i in held else 0 for i in range(4)]
    # Growing a running request past the cache fails the same way.
    assert kv.allocate_slots(holder, 5) is None
    assert kv.block_ids_of("holder") == held
    assert kv.num_free_blocks == 1


def test_allocation_failure_with_a_cached_prefix_does_not_revive_it():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    prefix = list(range(8))
    a = make_request("a", prefix + [99])
    admit(kv, a)
    a_blocks = kv.block_ids_of("a")
    kv.free(a)
    other = make_request("other", list(range(200, 204)))
    admit(kv, other)
    assert kv.num_free_blocks == 3

    # Needs 4 blocks: 2 revived cached ones + 2 new, but only 3 are free.
    too_big = make_request("too_big", prefix + list(range(300, 308)))
    hits = kv.find_cached_prefix(too_big)
    assert [block.block_id for block in hits] == a_blocks[:2]
    assert kv.allocate_slots(too_big, 8, hits) is None

    assert kv.num_free_blocks == 3
    assert ref_counts(kv, a_blocks[:2]) == [0, 0]
    assert kv.block_ids_of("too_big") == []
    # The cached blocks are still cached and can be revived by a request that fits.
    fits = make_request("fits", prefix + list(range(400, 404)))
    block_ids = admit(kv, fits)
    assert block_ids is not None
    assert block_ids[:2] == a_blocks[:2]
    assert kv.num_free_blocks == 0


# ---- prefix caching ----------------------------------------------------------------------


def test_two_requests_sharing_a_prefix_share_its_blocks_with_ref_count_two():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    prefix = [7, 3, 9, 1, 4, 4, 2, 8]
    a = make_request("a", prefix + [5])
    b = make_request("b", prefix + [6])
    a_blocks = admit(kv, a)

    hits = kv.find_cached_prefix(b)
    b_blocks = kv.allocate_slots(b, 1, hits)

    assert [block.block_id for block in hits] == a_blocks[:2]
    assert b_blocks[:2] == a_blocks[:2]
    assert b_blocks[2] != a_blocks[2]
    assert ref_counts(kv, a_blocks) == [2, 2, 1]
    assert ref_counts(kv, b_blocks) == [2, 2, 1]
    assert kv.num_free_blocks == 10 - 4

    kv.free(a)
    assert ref_counts(kv, a_blocks[:2]) == [1, 1]
    assert kv.block_ids_of("b") == b_blocks
    assert kv.num_free_blocks == 10 - 3

    kv.free(b)
    assert_all_free(kv)


def test_prefix_hit_returns_the_first_two_full_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    first = make_request("first", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    first_blocks = admit(kv, first)
    assert kv.num_prefix_hit_tokens == kv.num_prefix_queried_tokens == 0  # admit() counts none

    second = make_request("second", [1, 2, 3, 4, 5, 6, 7, 8, 77, 78, 79])
    hits = kv.find_cached_prefix(second)

    assert [block.block_id for block in hits] == first_blocks[:2]
    # A lookup alone counts nothing: only admissions are counted (by the scheduler).
    assert kv.num_prefix_hit_tokens == kv.num_prefix_queried_tokens == 0
    kv.record_prefix_lookup(second.num_tokens, len(hits) * BLOCK_SIZE)
    assert kv.num_prefix_hit_tokens == 8
    assert kv.num_prefix_queried_tokens == 11


def test_prefix_miss_on_block_zero_misses_everything_because_hashes_chain():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(kv, make_request("first", [1, 2, 3, 4, 5, 6, 7, 8, 9]))

    differs_in_block_0 = make_request("x", [1, 2, 3, 0, 5, 6, 7, 8, 9])
    differs_in_block_1 = make_request("y", [1, 2, 3, 4, 5, 6, 0, 8, 9])

    assert kv.find_cached_prefix(differs_in_block_0) == []
    assert len(kv.find_cached_prefix(differs_in_block_1)) == 1


def test_prompts_whose_64_bit_hashes_collide_never_share_blocks(monkeypatch):
    # Force every 64-bit hash() taken in the cache module to collide: keys made from
    # Python's hash() would then map different prompts to the same cached blocks.
    import vlite.core.kv_cache as kv_cache_module

    monkeypatch.setattr(kv_cache_module, "hash", lambda value: 0, raising=False)
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(kv, make_request("first", [1, 2, 3, 4, 5, 6, 7, 8, 9]))

    other = make_request("other", [9, 8, 7, 6, 5, 4, 3, 2, 1])

    assert kv.find_cached_prefix(other) == []
    assert not set(admit(kv, other)) & set(kv.block_ids_of("first"))


def test_block_keys_are_chained_sha256_digests():
    from vlite.core.kv_cache import hash_block_tokens

    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(first) == 32 and first != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(first, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_tokens(first, [5, 6, 7, 8]) == hash_block_tokens(first, [5, 6, 7, 8])


def test_partial_last_block_is_not_cached():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    admit(kv, make_request("first", [1, 2, 3, 4, 5, 6]))
    assert kv.num_cached_blocks == 1

    hits = kv.find_cached_prefix(make_request("second", [1, 2, 3, 4, 5, 6, 7, 8, 9]))

    assert len(hits) == 1


@pytest.mark.parametrize(("prompt_len", "num_hit_blocks"), [(8, 1), (9, 2), (12, 2), (13, 3)])
def test_fully_cached_prompt_leaves_at_least_one_token_to_compute(prompt_len, num_hit_blocks):
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    prompt = list(range(prompt_len))
    first = make_request("first", prompt)
    admit(kv, first)
    decode(kv, first, 999)  # the prompt's last block is full and cached too
    assert kv.num_cached_blocks == (prompt_len + 1) // BLOCK_SIZE

    hits = kv.find_cached_prefix(make_request("again", prompt))

    assert len(hits) == num_hit_blocks
    assert prompt_len - len(hits) * BLOCK_SIZE >= 1


def test_prefix_caching_disabled_shares_and_caches_nothing():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    prompt = list(range(9))
    a, b = make_request("a", prompt), make_request("b", prompt)
    a_blocks = admit(kv, a)

    assert kv.find_cached_prefix(b) == []
    b_blocks = admit(kv, b)

    assert set(a_blocks).isdisjoint(b_blocks)
    assert kv.num_cached_blocks == 0
    assert all(block.block_hash is None for block in kv.blocks)
    assert kv.num_prefix_queried_tokens == 0
    kv.free(a)
    kv.free(b)
    assert_all_free(kv)
    assert kv.find_cached_prefix(make_request("c", prompt)) == []


# ---- eviction ----------------------------------------------------------------------------


def test_eviction_takes_tail_blocks_of_the_earliest_freed_request_first():
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    a_tokens, b_tokens = list(range(12)), list(range(100, 112))
    a, b = make_request("a", a_tokens), make_request("b", b_tokens)
    a_blocks, b_blocks = admit(kv, a), admit(kv, b)
    kv.free(a)
    kv.free(b)
    assert kv.num_cached_blocks == 6

    c_blocks = admit(kv, make_request("c", list(range(200, 208))))

    # a was freed first, and its tail before its head: a's last two blocks are reused.
    assert c_blocks == [a_blocks[2], a_blocks[1]]
    a_again = kv.find_cached_prefix(make_request("a2", a_tokens + [1]))
    b_again = kv.find_cached_prefix(make_request("b2", b_tokens + [1]))
    assert [block.block_id for block in a_again] == a_blocks[:1]
    assert [block.block_id for block in b_again] == b_blocks


def test_reviving_a_cached_block_makes_it_most_recently_used():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a_tokens, b_tokens = [1, 2, 3, 4], [5, 6, 7, 8]
    a, b = make_request("a", a_tokens), make_request("b", b_tokens)
    (a_block,) = admit(kv, a)
    (b_block,) = admit(kv, b)
    kv.free(a)
    kv.free(b)  # LRU order now: the 2 unused blocks, a's block, b's block

    reuse_a = make_request("reuse_a", a_tokens + [9])
    assert admit(kv, reuse_a)[0] == a_block
    kv.free(reuse_a)  # a's block is now more recently used than b's

    filler_blocks = admit(kv, make_request("filler", list(range(300, 312))))

    assert b_block in filler_blocks
    assert a_block not in filler_blocks
    assert len(kv.find_cached_prefix(make_request("a3", a_tokens + [0]))) == 1
    assert kv.find_cached_prefix(make_request("b3", b_tokens + [0])) == []


def test_evicted_block_loses_its_hash():
    kv = KVCacheManager(num_blocks=2, block_size=BLOCK_SIZE)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    admit(kv, a)
    kv.free(a)
    assert kv.num_cached_blocks == 2

    admit(kv, make_request("b", [9, 9, 9, 9, 9]))

    assert kv.num_cached_blocks == 1  # b's one full block; both of a's are gone
    assert kv.find_cached_prefix(make_request("a2", [1, 2, 3, 4, 5, 6, 7, 8, 0])) == []


# ---- leaks and misuse --------------------------------------------------------------------


def test_no_block_leaks_after_every_request_finishes_or_is_aborted():
    rng = random.Random(1234)
    kv = KVCacheManager(num_blocks=64, block_size=BLOCK_SIZE)
    shared = [rng.randrange(50) for _ in range(12)]
    requests = []
    for i in range(12):
        prompt = shared[: rng.randrange(0, 13)] + [rng.randrange(50) for _ in range(5)]
        request = make_request(str(i), prompt)
        assert admit(kv, request) is not None
        for _ in range(rng.randrange(0, 9)):
            assert decode(kv, request, rng.randrange(50)) is not None
        requests.append(request)
    assert any(ref > 1 for ref in (block.ref_count for block in kv.blocks))

    # Some "finish", some are "aborted" mid-flight: both release through free().
    aborted_mid_prompt = make_request("aborted", shared + [1, 2])
    hits = kv.find_cached_prefix(aborted_mid_prompt)
    assert kv.allocate_slots(aborted_mid_prompt, 14 - len(hits) * BLOCK_SIZE, hits) is not None
    requests.append(aborted_mid_prompt)
    rng.shuffle(requests)
    for request in requests:
        kv.free(request)

    assert_all_free(kv)
    for request in requests:
        kv.free(request)
    assert_all_free(kv)


def test_cached_prefix_for_a_request_that_holds_blocks_is_rejected():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    admit(kv, make_request("a", list(range(9))))
    b = make_request("b", list(range(9)))
    hits = kv.find_cached_prefix(b)
    kv.allocate_slots(b, 1, hits)

    with pytest.raises(ValueError, match="already holds blocks"):
        kv.allocate_slots(b, 1, hits)


@pytest.mark.parametrize(
    ("num_blocks", "block_size", "field"), [(0, 4, "num_blocks"), (4, 0, "block_size")]
)
def test_invalid_sizes_are_rejected(num_blocks, block_size, field):
    with pytest.raises(ValueError, match=field):
        KVCacheManager(num_blocks, block_size)


# ---- what a preemption would free --------------------------------------------------------


def test_num_blocks_short_counts_the_blocks_missing_for_an_allocation():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    holder = make_request("holder", list(range(1, 10)))  # three blocks
    admit(kv, holder)
    newcomer = make_request("newcomer", list(range(20, 29)))  # needs three

    assert kv.num_blocks_short(newcomer, newcomer.num_tokens) == 2
    assert kv.num_blocks_short(newcomer, 4) == 0
    assert kv.allocate_slots(newcomer, newcomer.num_tokens) is None
    kv.free(holder)
    assert kv.num_blocks_short(newcomer, newcomer.num_tokens) == 0


def test_num_blocks_freed_by_counts_only_blocks_no_other_request_holds():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    shared_prefix = list(range(1, 9))  # two full blocks
    first = make_request("first", [*shared_prefix, 50])
    second = make_request("second", [*shared_prefix, 60])
    admit(kv, first)
    admit(kv, second)  # reuses the two prefix blocks, adds its own third
    assert kv.num_used_blocks == 4

    # Freeing one keeps the shared blocks held by the other: one block each.
    assert kv.num_blocks_freed_by([first]) == 1
    assert kv.num_blocks_freed_by([second]) == 1
    # Freeing both frees all four; minus the two the caller keeps as its cached prefix.
    assert kv.num_blocks_freed_by([first, second]) == 4
    prefix = kv.find_cached_prefix(make_request("third", [*shared_prefix, 70]))
    assert kv.num_blocks_freed_by([first, second], keep=prefix) == 2
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 8


# ---- sliding windows -----------------------------------------------------------------


def test_blocks_that_leave_every_layers_window_are_released():
    kv = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, sliding_window=BLOCK_SIZE + 1)
    req = make_request("a", list(range(3 * BLOCK_SIZE)))
    kv.allocate_slots(req, 3 * BLOCK_SIZE)  # the whole prompt in one step
    req.num_computed_tokens = 3 * BLOCK_SIZE
    table = kv.block_ids_of("a")
    assert kv.num_used_blocks == 3
    # The next token (position 3 * bs) sees keys >= 2 * bs: the first two blocks go.
    new = kv.allocate_slots(req, 1)
    assert new is not None and len(new) == 1
    assert kv.block_ids_of("a")[:3] == table  # the table keeps its places
    assert kv.held_block_ids_of("a") == kv.block_ids_of("a")[2:]
    assert kv.num_used_blocks == 2
    assert all(kv.blocks[b].ref_count == 0 for b in table[:2])


def test_released_blocks_stay_cached_but_are_not_republished_once_reused():
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, sliding_window=1)
    a = make_request("a", list(range(2 * BLOCK_SIZE)))
    kv.allocate_slots(a, 2 * BLOCK_SIZE)
    a.num_computed_tokens = 2 * BLOCK_SIZE
    first = kv.block_ids_of("a")[0]
    kv.allocate_slots(a, 1)  # releases both full blocks (window of 1 token)
    assert kv.num_cached_blocks == 2  # still cached, still hit-able
    b = make_request("b", list(range(2 * BLOCK_SIZE)) + [99])
    assert [blk.block_id for blk in kv.find_cached_prefix(b)] == kv.block_ids_of("a")[:2]
    # Another request takes every free block: the released ones are evicted and reused.
    c = make_request("c", [7] * (3 * BLOCK_SIZE))
    assert kv.allocate_slots(c, 2 * BLOCK_SIZE) is not None
    a.num_computed_tokens += 1
    kv.allocate_slots(a, 1)
    assert first not in {blk.block_id for blk in kv.find_cached_prefix(b)}
    kv.free(a)
    kv.free(c)
    assert kv.num_free_blocks == 4


def test_the_most_blocks_a_windowed_request_holds():
    kv = KVCacheManager(num_blocks=100, block_size=16, sliding_window=12)
    assert kv.max_blocks_held(170, None) == 11  # a whole recomputation in one step
    assert kv.max_blocks_held(170, 16) == 3  # window 11 back + 16 new, misaligned
    assert kv.max_blocks_held(20, 16) == 2
    assert KVCacheManager(100, 16).max_blocks_held(170, 16) == 11


def test_a_backend_without_windows_is_refused_for_a_windowed_model():
    from vlite.core.engine_core import kv_cache_window
    from vlite.core.verify import check_layer_features

    class NoWindows:
        supports_sliding_window = False

    class Windows:
        supports_sliding_window = True

    windows = (None, 8, 8, None, 8)
    with pytest.raises(ValueError, match=r"'plain' cannot .* layers 1-2, 4 .* 8 tokens"):
        check_layer_features(windows, None, NoWindows, "plain")
    with pytest.raises(ValueError, match=r"caps attention scores at 50.0"):
        check_layer_features((None,), 50.0, Windows, "windowed")
    check_layer_features(windows, None, Windows, "windowed")
    check_layer_features((None, None), None, NoWindows, "plain")  # nothing windowed
    assert kv_cache_window(windows) is None  # a full layer needs every block
    assert kv_cache_window((8, 16, 8)) == 16
    assert kv_cache_window(()) is None
