"""The plain-PyTorch reference attention backend (registry name ``torch``).

Correctness first: every other backend is checked against this one. It is also the default
CPU backend, so it avoids needless slowness:

- decode-only sequences (one new token each) are attended in one batched
  ``scaled_dot_product_attention`` call over their block-gathered, padded contexts;
- sequences with several new tokens (prefills, prompt chunks) are attended one at a time,
  each over exactly its own context, so a long prefill never pads the decodes beside it.

Contexts are always read back from the paged cache after the new keys/values are written, so
the cache layout is exercised on every call. A windowed layer (``sliding_window``) reads
a prefill's context from the first block its first query can see, and masks the rest. A
layer with ``logits_soft_cap`` (Gemma 2) computes its scores explicitly, since SDPA cannot
cap them: ``cap * tanh(scores / cap)`` before the mask and the softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlite.core.attention import AttentionBackend, AttentionMetadata
from vlite.core.hookspecs import Register, hookimpl


class TorchAttentionBackend(AttentionBackend):
    """Paged causal attention with grouped-query support, written with PyTorch ops only.

    Cache layout (the base class default): ``[2, num_blocks, block_size, num_kv_heads,
    head_dim]``, index 0 keys, index 1 values.
    """

    supports_sliding_window = True
    supports_logits_soft_cap = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """See :meth:`AttentionBackend.forward`. Returns ``[num_tokens, num_heads, head_dim]``."""
        self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        window, cap = sliding_window, logits_soft_cap
        if metadata.is_all_decode:
            return self._decode(
                query,
                kv_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.max_seq_len,
                window,
                cap,
            )

        output = torch.empty_like(query)
        starts = _cumsum(metadata.query_lens_cpu)
        decode_seqs = [i for i, n in enumerate(metadata.query_lens_cpu) if n == 1]
        if decode_seqs:
            seq_index = torch.tensor(decode_seqs, device=query.device)
            token_index = torch.tensor([starts[i] for i in decode_seqs], device=query.device)
            output[token_index] = self._decode(
                query[token_index],
                kv_cache,
                metadata.block_tables[seq_index],
                metadata.seq_lens[seq_index],
                max(metadata.seq_lens_cpu[i] for i in decode_seqs),
                window,
                cap,
            )
        for i, query_len in enumerate(metadata.query_lens_cpu):
            if query_len > 1:
                rows = slice(starts[i], starts[i] + query_len)
                output[rows] = self._prefill(
                    query[rows],
                    kv_cache,
                    metadata.block_tables[i],
                    metadata.seq_lens_cpu[i],
                    window,
                    cap,
                )
        return output

    @staticmethod
    def write_kv(
        key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping``
        ``[num_tokens]`` of ``kv_cache`` ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        key_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, kv_heads, dim]
        value_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
        slot_mapping = slot_mapping.long()  # no-op for the documented int64
        key_slots.index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        value_slots.index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def _gather_context(
        self,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        num_blocks: int,
        first_block: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read blocks ``first_block:num_blocks`` of each row of ``block_tables`` ``[S, B]``.

        Returns keys and values ``[S, num_kv_heads, (num_blocks - first_block) * block_size,
        head_dim]``.
        """
        blocks = block_tables[:, first_block:num_blocks].long()  # [S, num_read]
        num_blocks -= first_block
        num_seqs = blocks.shape[0]
        keys = kv_cache[0][blocks]  # [S, num_blocks, block_size, kv_heads, dim]
        values = kv_cache[1][blocks]
        shape = (num_seqs, num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        return keys.reshape(shape).transpose(1, 2), values.reshape(shape).transpose(1, 2)

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        max_seq_len: int,
        window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        """One query token per sequence, batched over sequences with a padding mask.

        Args:
            query: ``[S, num_heads, head_dim]``, the last token of each sequence.
            block_tables: ``[S, max_num_blocks]``.
            seq_lens: ``[S]`` context lengths (device tensor; no host sync is needed).
            max_seq_len: ``max(seq_lens)`` as a host int; bounds how many blocks are read.
            window: the layer's sliding window, if any.
            soft_cap: the layer's attention logit soft cap, if any.

        Returns:
            ``[S, num_heads, head_dim]``.
        """
        num_blocks = -(-max_seq_len // self.block_size)
        keys, values = self._gather_context(kv_cache, block_tables, num_blocks)
        context_len = keys.shape[2]
        positions = torch.arange(context_len, device=query.device)
        lens = seq_lens[:, None].to(positions.dtype)
        mask = positions[None, :] < lens  # [S, L]
        if window is not None:
            mask &= positions[None, :] >= lens - window
        out = self._attend(
            query.unsqueeze(2),  # [S, num_heads, 1, head_dim]
            keys.to(query.dtype),
            values.to(query.dtype),
            mask[:, None, None, :],
            soft_cap,
        )
        return out.squeeze(2)

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        window: int | None = None,
        soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Several new tokens of one sequence, attending causally to its context.

        Args:
            query: ``[query_len, num_heads, head_dim]``, the last ``query_len`` positions of a
                context of ``seq_len`` tokens.
            block_table: ``[max_num_blocks]`` the sequence's blocks.
            window: the layer's sliding window, if any: blocks before the first query's
                window are not read.
            soft_cap: the layer's attention logit soft cap, if any.

        Returns:
            ``[query_len, num_heads, head_dim]``.
        """
        query_len = query.shape[0]
        num_blocks = -(-seq_len // self.block_size)
        first_key = 0 if window is None else max(0, seq_len - query_len - window + 1)
        first_block = first_key // self.block_size
        keys, values = self._gather_context(kv_cache, block_table[None], num_blocks, first_block)
        offset = first_block * self.block_size  # context position of the first key read
        keys = keys[:, :, : seq_len - offset].to(query.dtype)  # [1, kv_heads, keys, dim]
        values = values[:, :, : seq_len - offset].to(query.dtype)
        q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, query_len, dim]
        mask = None  # a square causal mask, SDPA's is_causal
        if query_len != seq_len or window is not None or soft_cap is not None:
            mask = causal_mask(query_len, seq_len, query.device, window, offset)
        out = self._attend(q, keys, values, mask, soft_cap)
        return out.squeeze(0).transpose(0, 1)

    def _attend(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        soft_cap: float | None,
    ) -> torch.Tensor:
        """``query`` ``[S, H, Lq, D]`` over ``keys``/``values`` ``[S, Hkv, Lk, D]`` where
        ``mask`` (broadcast to ``[S, H, Lq, Lk]``, True: visible; ``None``: causal, square)
        allows -> ``[S, H, Lq, D]``."""
        gqa = self.num_queries_per_kv > 1
        if soft_cap is not None:
            return soft_capped_attention(query, keys, values, mask, self.scale, soft_cap)
        if mask is None:
            return F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=self.scale, enable_gqa=gqa
            )
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa
        )


def soft_capped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    soft_cap: float,
) -> torch.Tensor:
    """Attention with logits capped as Gemma 2 caps them: ``cap * tanh(scale * q.k / cap)``,
    masked, softmax in float32. Shapes as :meth:`TorchAttentionBackend._attend`'s."""
    group = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / soft_cap) * soft_cap
    if mask is None:
        length = scores.shape[-1]
        mask = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values)


def causal_mask(
    query_len: int,
    seq_len: int,
    device: torch.device,
    window: int | None = None,
    first_key: int = 0,
) -> torch.Tensor:
    """``[query_len, seq_len - first_key]`` bool, True where the query may attend.

    The queries are the last ``query_len`` positions of a context of ``seq_len`` tokens, so
    query ``j`` at position ``p = seq_len - query_len + j`` sees keys ``<= p`` (and, with a
    ``window``, ``> p - window``); the columns are key positions ``first_key:seq_len``.
    """
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    key_pos = torch.arange(first_key, seq_len, device=device)
    visible = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - window
    return visible


def _cumsum(lengths: list[int]) -> list[int]:
    """Exclusive prefix sums of host ints: ``[0, l0, l0 + l1, ...]``."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return starts


@hookimpl
def register_attention_backends(register: Register) -> None:
    register("torch", TorchAttentionBackend)
