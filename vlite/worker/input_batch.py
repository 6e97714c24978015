"""Turning a SchedulerOutput into the flattened input tensors of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from vlite.core.attention import AttentionMetadata
from vlite.core.outputs import NewRequestData
from vlite.worker.input_buffers import InputBuffers


class CachedRequestState(NewRequestData, kw_only=True):
    """What a worker remembers about a request between steps: the
    :class:`~vlite.core.outputs.NewRequestData` it arrived as, kept up to date, and what the
    worker derives from it.

    ``token_ids`` are all known tokens (prompt and sampled); the worker appends the
    tokens it samples itself, so the scheduler only sends counters and new blocks (the
    list is never replaced: logits processors hold it, see ``AddedRequest.token_ids``).
    ``generator``: the request's own random stream (a ``seed`` was set).
    ``has_sampling_extras``: the request uses min-p, a penalty or logprobs, so a step
    whose rows all lack it skips building their inputs with one check.
    ``num_tokens_at_cache_start``: the tokens known when the request's cache was last
    computed from position 0 (``AttentionMetadata.context_lens_at_cache_start``).
    ``reads_own_tokens``: sampling the request reads its tokens (penalties, ``min_tokens``,
    bad words, a grammar, a plugin's ``extra_args``), so they must all be known first.
    ``pending_token``: a token sampled but not yet appended to ``token_ids`` (async
    scheduling, :mod:`vlite.worker.sampled_tokens`): the device tensor of its step's sampled
    ids and its row there; the next step's input reads it from the device.
    """

    generator: torch.Generator | None = None
    has_sampling_extras: bool = False
    num_tokens_at_cache_start: int = 0
    reads_own_tokens: bool = False
    pending_token: tuple[torch.Tensor, int] | None = None

    @classmethod
    def from_new(cls, new: NewRequestData, device: torch.device) -> CachedRequestState:
        """The worker's state of a request it sees for the first time (its own lists)."""
        fields = msgspec.structs.asdict(new)
        fields.update(token_ids=list(new.token_ids), block_ids=list(new.block_ids))
        params = new.sampling_params
        return cls(
            **fields,
            generator=_make_generator(params.seed, device),
            has_sampling_extras=bool(
                params.min_p > 0 or params.has_penalties or params.logprobs is not None
            ),
            reads_own_tokens=bool(
                params.has_penalties
                or params.min_tokens
                or params.bad_words_token_ids
                or params.bad_words
                or params.structured_outputs is not None
                or params.extra_args
            ),
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def _make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class ModelInputs:
    """One step's flattened batch.

    Attributes:
        input_ids: ``[num_tokens]`` int64.
        positions: ``[num_tokens]`` int64.
        attn_metadata: block tables, slot mapping, sequence lengths.
        logits_indices: ``[num_sampled]`` int64: the rows whose logits are sampled (the
            last known token of each sequence that reaches it, and each draft after it).
        sampled_request_ids: request id of each row of ``logits_indices`` (a request that
            verifies drafts has one row per draft and one more, in a run).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sampled_request_ids: list[str]


def prepare_inputs(
    states: list[CachedRequestState],
    num_scheduled: list[int],
    block_size: int,
    device: torch.device,
    buffers: InputBuffers | None = None,
    drafts: dict[str, list[int]] | None = None,
    as_decodes: bool = False,
) -> ModelInputs:
    """Lay the scheduled tokens of ``states`` end to end, with positions and cache slots,
    written into ``buffers`` (the worker's persistent ones; default: new ones), so the
    tensors returned are valid until the next call with the same buffers.

    ``num_scheduled[i]`` new tokens of ``states[i]`` are computed, starting at its
    ``num_computed_tokens``. A state whose tokens start at position 0 records how many it
    knows as its ``num_tokens_at_cache_start``. ``drafts`` (speculative decoding): request
    id -> the draft tokens that follow its known tokens in its chunk; every position from
    its last known token on is sampled. ``as_decodes``: lay every chunk out as one-token
    sequences, as verification does (a few tokens then compute as a decode step, which
    can be replayed).
    """
    buffers = buffers if buffers is not None else InputBuffers(device)
    buffers.begin()
    num_seqs = len(states)
    num_computed = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_seqs)
    query_lens = np.asarray(num_scheduled, dtype=np.int64)
    seq_lens = num_computed + query_lens
    query_ends = np.cumsum(query_lens)
    num_tokens = int(query_ends[-1])

    starts = np.repeat(query_ends - query_lens - num_computed, query_lens)
    positions = buffers.host("positions", num_tokens)
    np.subtract(np.arange(num_tokens), starts, out=positions)
    block_table = _fill_block_table(buffers, states, seq_lens, block_size)
    seq_index = np.repeat(np.arange(num_seqs), query_lens)
    slot_mapping = buffers.host("slot_mapping", num_tokens)
    np.add(
        block_table[seq_index, positions // block_size].astype(np.int64) * block_size,
        positions % block_size,
        out=slot_mapping,
    )
    pending = [index for index, state in enumerate(states) if state.pending_token is not None]
    placeholders = _gather_input_ids(
        buffers.host("input_ids", num_tokens), states, num_computed, query_lens, pending, drafts
    )

    known = np.fromiter((len(s.token_ids) for s in states), np.int64, num_seqs)
    known[pending] += 1  # a token sampled but not yet on the host is known
    # Rows sampled: the last known token's, and each draft's after it.
    num_rows = np.maximum(seq_lens - known + 1, 0)
    at_cache_start = _record_cache_starts(states, num_computed, known)
    buffers.host("context_lens_at_cache_start", num_tokens)[:] = np.repeat(
        at_cache_start, query_lens
    )
    num_sampled = int(num_rows.sum())
    first_rows = np.repeat(query_ends - num_rows, num_rows)
    row_offsets = np.arange(num_sampled) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    buffers.host("logits_indices", num_sampled)[:] = first_rows + row_offsets

    split = np.ones(num_seqs, dtype=bool) if as_decodes else num_rows > 1
    metadata = _attention_metadata(buffers, query_lens, seq_lens, block_table, split, num_tokens)
    input_ids = buffers.upload("input_ids", num_tokens)
    inputs = ModelInputs(
        input_ids=input_ids,
        positions=buffers.upload("positions", num_tokens),
        attn_metadata=metadata,
        logits_indices=buffers.upload("logits_indices", num_sampled),
        sampled_request_ids=[
            state.request_id for state, rows in zip(states, num_rows.tolist()) for _ in range(rows)
        ],
    )
    buffers.end()
    _fill_pending_tokens(input_ids, states, np.concatenate(([0], query_ends)), placeholders)
    return inputs


def _attention_metadata(
    buffers: InputBuffers,
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_table: np.ndarray,
    verifies_drafts: np.ndarray,
    num_tokens: int,
) -> AttentionMetadata:
    """The step's :class:`AttentionMetadata`. A request that verifies drafts (a decode of
    its last token and ``d`` drafts, ``verifies_drafts``) is laid out as ``1 + d`` one-token
    sequences over its block table, with contexts one token longer each: each position
    attends exactly as a decode step of that length would (a backend writes every new key
    before it attends), so verification computes with the decode path's own kernels (and
    the step is a decode step that can be replayed)."""
    if verifies_drafts.any():
        counts = np.where(verifies_drafts, query_lens, 1)  # sequences each request becomes
        rows = np.repeat(np.arange(len(query_lens)), counts)
        offsets = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
        split = verifies_drafts[rows]
        seq_lens = np.where(split, seq_lens[rows] - query_lens[rows] + 1 + offsets, seq_lens[rows])
        query_lens = np.where(split, 1, query_lens[rows])
        table = block_table[rows]  # a copy: block_table is the buffer written below
        block_table = buffers.host("block_tables", table.size).reshape(table.shape)
        block_table[:] = table
    num_seqs = len(query_lens)
    query_start_loc = buffers.host("query_start_loc", num_seqs + 1)
    query_start_loc[0] = 0
    np.cumsum(query_lens, out=query_start_loc[1:])
    buffers.host("seq_lens", num_seqs)[:] = seq_lens
    return AttentionMetadata(
        slot_mapping=buffers.upload("slot_mapping", num_tokens),
        query_start_loc=buffers.upload("query_start_loc", num_seqs + 1),
        seq_lens=buffers.upload("seq_lens", num_seqs),
        block_tables=buffers.upload("block_tables", block_table.size, block_table.shape),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_lens_cpu=query_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        context_lens_at_cache_start=buffers.upload("context_lens_at_cache_start", num_tokens),
    )


def _record_cache_starts(
    states: list[CachedRequestState], num_computed: np.ndarray, known: np.ndarray
) -> np.ndarray:
    """``[num_seqs]`` each state's ``num_tokens_at_cache_start``, first set to its
    ``known`` tokens for the states computed from position 0 in this step."""
    for index in np.flatnonzero(num_computed == 0).tolist():
        states[index].num_tokens_at_cache_start = int(known[index])
    return np.fromiter((s.num_tokens_at_cache_start for s in states), np.int64, len(states))


def _fill_block_table(
    buffers: InputBuffers,
    states: list[CachedRequestState],
    seq_lens: np.ndarray,
    block_size: int,
) -> np.ndarray:
    """The ``[num_seqs, max_num_blocks]`` block table, zero-padded, in ``buffers``."""
    num_blocks = -(-seq_lens // block_size)
    width = int(num_blocks.max())
    table = buffers.host("block_tables", len(states) * width).reshape(len(states), width)
    table.fill(0)
    for row, (state, count) in enumerate(zip(states, num_blocks.tolist())):
        table[row, :count] = state.block_ids[:count]
    return table


def _gather_input_ids(
    out: np.ndarray,
    states: list[CachedRequestState],
    num_computed: np.ndarray,
    query_lens: np.ndarray,
    pending: list[int],
    drafts: dict[str, list[int]] | None = None,
) -> list[int]:
    """Write the scheduled tokens (and ``drafts``) end to end into ``out``; return the
    indices (among ``pending``, the states with a pending token) whose chunk ends with that
    token: it is not on the host yet, so it is 0 here and filled on the device by
    :func:`_fill_pending_tokens`."""
    starts, lengths = num_computed.tolist(), query_lens.tolist()
    chunks = [
        state.token_ids[start : start + length]
        for state, start, length in zip(states, starts, lengths)
    ]
    placeholders = [index for index in pending if len(chunks[index]) < lengths[index]]
    for index in placeholders:
        chunks[index] = [*chunks[index], 0]
    if drafts:  # a request's drafts follow its last known token
        for index, state in enumerate(states):
            chunks[index] = [*chunks[index], *drafts.get(state.request_id, ())]
    flat = (token for chunk in chunks for token in chunk)
    out[:] = np.fromiter(flat, np.int64, len(out))
    return placeholders


def _fill_pending_tokens(
    input_ids: torch.Tensor,
    states: list[CachedRequestState],
    query_start_loc: np.ndarray,
    placeholders: list[int],
) -> None:
    """Copy, on the device, the pending token of each of ``states[placeholders]`` from its
    step's sampled ids into ``input_ids`` (the last position of its request's chunk)."""
    rows_by_source: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for index in placeholders:
        sampled, row = states[index].pending_token
        entry = rows_by_source.setdefault(id(sampled), (sampled, [], []))
        entry[1].append(int(query_start_loc[index + 1]) - 1)
        entry[2].append(row)
    for sampled, positions, rows in rows_by_source.values():
        targets = torch.tensor(positions).to(input_ids.device, non_blocking=True)
        sources = torch.tensor(rows).to(sampled.device, non_blocking=True)
        input_ids[targets] = sampled[sources]
