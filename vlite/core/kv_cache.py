"""The paged KV cache's bookkeeping: blocks, block tables, reference counts, prefix caching.

The cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. A request's
block table lists its blocks in token order; token ``i`` lives in slot
``block_ids[i // block_size] * block_size + i % block_size``.

Prefix caching: a *full* block is identified by a SHA-256 digest chained over every token
up to its end (``sha256(parent_digest + tokens_of_block)``), so two requests that share a
prompt prefix map its full blocks to the same digests and can share the same physical
blocks, and two different prefixes cannot (a collision of a 256-bit digest is not a
practical event, unlike one of Python's 64-bit ``hash()``, which a crafted prompt can force
and which would serve one request another's cached keys and values). A block
whose reference count falls to zero keeps its hash and contents and goes to the tail of
the free queue; allocation takes from the head, so the least recently freed cached block
is evicted first, and a later request can revive a cached block until it is evicted.

Sliding windows: when every layer of the model attends only to its last ``sliding_window``
tokens, a block that lies wholly before the window of a request's next token is never read
again. Each allocation releases such blocks (vLLM's sliding-window manager), so a long
generation holds about ``sliding_window / block_size + 1`` blocks however long it runs.
A released block keeps its place in the request's block table (the worker's copy is never
read there) and its prefix hash (it may still serve a later prefix hit until evicted).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence

from vlite.core.request import Request

#: A full block's chained SHA-256 digest (32 bytes).
BlockHash = bytes


class KVCacheBlock:
    """One physical block: its id, how many requests use it, and its prefix hash if full."""

    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        digest = None if self.block_hash is None else self.block_hash.hex()[:12]
        return f"KVCacheBlock({self.block_id}, refs={self.ref_count}, hash={digest})"


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained digest of one full block: equal only if every earlier token is equal too.

    SHA-256 over the parent block's digest (none for the first block) and the token ids
    as little-endian int64s.
    """
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


class KVCacheManager:
    """Hands out blocks to requests and takes them back.

    Args:
        num_blocks: Physical blocks in the cache.
        block_size: Token slots per block.
        enable_prefix_caching: Share and keep full blocks by prefix hash.
        sliding_window: When every layer attends only to its last ``sliding_window`` tokens
            (the largest window, if they differ): release blocks that fall out of it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} is invalid: must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} is invalid: must be >= 1")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} is invalid: must be >= 1")
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Per request: its block table, the hashes of its full blocks so far, and how many
        # leading blocks of the table it has released (out of the sliding window).
        self._request_blocks: dict[str, list[KVCacheBlock]] = {}
        self._request_hashes: dict[str, list[BlockHash]] = {}
        self._num_released: dict[str, int] = {}
        #: Request id -> its leading blocks published to the prefix cache so far.
        self._num_published: dict[str, int] = {}
        self.num_prefix_hit_tokens = 0
        self.num_prefix_queried_tokens = 0

    # ---- queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached-but-unreferenced blocks count as free)."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int, max_tokens_per_step: int | None) -> int:
        """The most blocks a request of ``num_tokens`` tokens can hold at once.

        Without a sliding window: all of them. With one, a step computing ``n`` tokens holds
        the window before its first token plus the blocks of the ``n`` tokens; when no step
        computes more than ``max_tokens_per_step`` tokens (chunked prefill), that bounds it.
        ``None``: a step may compute every token (a whole prompt, or a preempted request's
        recomputation).
        """
        every_block = self.num_blocks_for(num_tokens)
        if self.sliding_window is None or max_tokens_per_step is None:
            return every_block
        span = self.sliding_window - 1 + max_tokens_per_step
        return min(every_block, self.num_blocks_for(span) + 1)

    def block_ids_of(self, request_id: str) -> list[int]:
        """The request's block table as the worker has it (released blocks included)."""
        return [block.block_id for block in self._request_blocks.get(request_id, [])]

    def held_block_ids_of(self, request_id: str) -> list[int]:
        """The blocks the request holds a reference to (its table less released blocks)."""
        return [block.block_id for block in self._held(request_id)]

    def _held(self, request_id: str) -> list[KVCacheBlock]:
        blocks = self._request_blocks.get(request_id, [])
        return blocks[self._num_released.get(request_id, 0) :]

    def _window_start_block(self, first_query_position: int) -> int:
        """Blocks wholly before the window of the token at ``first_query_position`` (0
        without a sliding window): the query at ``p`` sees keys ``> p - sliding_window``."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query_position - self.sliding_window + 1) // self.block_size

    # ---- prefix cache lookup -------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[KVCacheBlock]:
        """Longest run of the request's leading full blocks already in the cache.

        At least one token is always left to compute, so the model produces logits for
        the last token: a fully cached prompt reuses all blocks but its last.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._ensure_hashes(request, max_blocks)
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self._cached_blocks.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix-cache lookup (queried and hit tokens)."""
        if self.enable_prefix_caching:
            self.num_prefix_queried_tokens += num_tokens
            self.num_prefix_hit_tokens += num_hit_tokens

    def _ensure_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        hashes = self._request_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[start : start + bs]))
        return hashes

    # ---- allocation ----------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_prefix: Sequence[KVCacheBlock] = (),
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        ``cached_prefix`` (from :meth:`find_cached_prefix`, only for a request holding no
        blocks) is taken as the first blocks of its table. Returns the ids of the blocks
        newly added to the request's table, or ``None`` (and changes nothing) when there
        are not enough free blocks.
        """
        if not cached_prefix and self._fits_held_blocks(request, num_new_tokens):
            return []
        request_id = request.request_id
        held = self._request_blocks.setdefault(request_id, [])
        if cached_prefix and held:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if self.num_blocks_short(request, num_new_tokens, cached_prefix) > 0:
            return None
        num_computed = len(cached_prefix) * self.block_size or request.num_computed_tokens
        window_start = self._window_start_block(num_computed)
        num_to_take = self._num_blocks_to_take(request, num_new_tokens, cached_prefix)
        if cached_prefix:
            # Hits before the window are listed in the table but never referenced.
            for block in cached_prefix[window_start:]:
                self._take_reference(block)
            self._num_released[request_id] = window_start
        else:
            self._release_before(request_id, window_start)
        new_blocks = list(cached_prefix)
        new_blocks += [self._pop_free_block() for _ in range(max(num_to_take, 0))]
        held += new_blocks
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, held, num_computed + num_new_tokens)
        return [block.block_id for block in new_blocks]

    def _fits_held_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """The common decode step's shortcut: without a window, the new tokens fit the
        blocks the request holds and no block is left to publish (so nothing is taken,
        released or published)."""
        if self.sliding_window is not None:
            return False
        held = self._request_blocks.get(request.request_id)
        if not held:
            return False
        num_known = request.num_computed_tokens + num_new_tokens
        if num_known > len(held) * self.block_size:
            return False
        if not self.enable_prefix_caching:
            return True
        num_full = min(num_known, len(request.all_token_ids)) // self.block_size
        return self._num_published.get(request.request_id, 0) >= num_full

    def _release_before(self, request_id: str, window_start: int) -> None:
        """Drop the request's references to its blocks before ``window_start``."""
        num_released = self._num_released.get(request_id, 0)
        if window_start <= num_released:
            return
        for block in self._request_blocks[request_id][num_released:window_start]:
            self._drop_reference(block)
        self._num_released[request_id] = window_start

    def _drop_reference(self, block: KVCacheBlock) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_queue[block.block_id] = None

    def num_blocks_short(
        self,
        request: Request,
        num_new_tokens: int,
        cached_prefix: Sequence[KVCacheBlock] = (),
    ) -> int:
        """How many more free blocks :meth:`allocate_slots` would need (0: it fits now)."""
        num_to_take = self._num_blocks_to_take(request, num_new_tokens, cached_prefix)
        num_computed = len(cached_prefix) * self.block_size or request.num_computed_tokens
        window_start = self._window_start_block(num_computed)
        if cached_prefix:
            in_window = cached_prefix[window_start:]
            num_revived = sum(1 for block in in_window if block.ref_count == 0)
            return max(0, num_to_take + num_revived - self.num_free_blocks)
        request_id = request.request_id
        num_released = self._num_released.get(request_id, 0)
        leaving = self._request_blocks.get(request_id, [])[num_released:window_start]
        num_freed = sum(1 for block in leaving if block.ref_count == 1)
        return max(0, num_to_take - num_freed - self.num_free_blocks)

    def _num_blocks_to_take(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVCacheBlock]
    ) -> int:
        held = self._request_blocks.get(request.request_id, [])
        num_computed = len(cached_prefix) * self.block_size or request.num_computed_tokens
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        return num_needed - len(held) - len(cached_prefix)

    def num_blocks_freed_by(
        self, requests: Sequence[Request], keep: Sequence[KVCacheBlock] = ()
    ) -> int:
        """How many blocks would become free if all of ``requests`` were freed.

        A block shared with a request not in ``requests`` stays held. Blocks in ``keep``
        (the cached prefix the caller is about to reuse) are not counted: freeing them
        only to take them back gains nothing.
        """
        references: dict[int, int] = {}
        for request in requests:
            for block in self._held(request.request_id):
                references[block.block_id] = references.get(block.block_id, 0) + 1
        kept = {block.block_id for block in keep}
        return sum(
            1
            for block_id, count in references.items()
            if count == self.blocks[block_id].ref_count and block_id not in kept
        )

    def _take_reference(self, block: KVCacheBlock) -> None:
        if block.ref_count == 0:
            del self._free_queue[block.block_id]
        block.ref_count += 1

    def _pop_free_block(self) -> KVCacheBlock:
        block_id, _ = self._free_queue.popitem(last=False)
        block = self.blocks[block_id]
        self._uncache(block)  # evict: its contents are about to be overwritten
        block.ref_count = 1
        return block

    def _cache_full_blocks(
        self, request: Request, held: list[KVCacheBlock], num_known_tokens: int
    ) -> None:
        """Publish the request's blocks that are full once this step's tokens are written
        (not released ones: another request may own them by now)."""
        # Only blocks whose every token is known: an overlapping decode (see
        # Scheduler.overlaps_decodes) allocates for a token not yet sampled.
        num_known_tokens = min(num_known_tokens, len(request.all_token_ids))
        num_full = min(num_known_tokens // self.block_size, len(held))
        hashes = self._ensure_hashes(request, num_full)
        request_id = request.request_id
        first = max(self._num_released.get(request_id, 0), self._num_published.get(request_id, 0))
        for block, block_hash in zip(held[first:num_full], hashes[first:num_full]):
            if block.block_hash is None:
                block.block_hash = block_hash
                self._cached_blocks.setdefault(block_hash, block)
        if num_full > self._num_published.get(request_id, 0):
            self._num_published[request_id] = num_full

    # ---- freeing -------------------------------------------------------------------

    def free(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Drop the request's references; its unshared blocks become free.

        Blocks are queued tail-first, so a request's last blocks (the least likely to be
        shared) are evicted before its first ones. Freeing twice is a no-op.

        Blocks are published to the prefix cache when allocated, before the step that
        fills them runs. A request preempted in the very step that allocated them passes
        ``num_computed_tokens``: its blocks past that point were never written, so they
        leave the prefix cache instead of serving garbage to a later hit.
        """
        blocks = self._request_blocks.pop(request.request_id, [])
        self._request_hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        num_released = self._num_released.pop(request.request_id, 0)
        num_valid_blocks = len(blocks)
        if num_computed_tokens is not None:
            num_valid_blocks = num_computed_tokens // self.block_size
        for index in range(len(blocks) - 1, num_released - 1, -1):
            block = blocks[index]
            block.ref_count -= 1
            if block.ref_count == 0:
                if index >= num_valid_blocks:
                    self._uncache(block)
                self._free_queue[block.block_id] = None

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release ``request``'s blocks past those its first ``num_tokens`` tokens fill: the
        slots of draft tokens the step rejected. Those blocks held tokens no one knew, so
        none was published to the prefix cache; they go back first in line for reuse."""
        held = self._request_blocks.get(request.request_id)
        if not held:
            return
        keep = max(-(-num_tokens // self.block_size), self._num_released.get(request.request_id, 0))
        while len(held) > keep:
            block = held.pop()
            block.ref_count -= 1
            if block.ref_count == 0:
                self._uncache(block)
                self._free_queue[block.block_id] = None
                self._free_queue.move_to_end(block.block_id, last=False)

    def _uncache(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached_blocks.get(block.block_hash) is block:
                del self._cached_blocks[block.block_hash]
            block.block_hash = None
