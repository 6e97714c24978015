"""What the scheduler did each step, as data: :class:`StepStats`, and the ``--trace`` writer.

The scheduler fills one :class:`StepStats` per :meth:`~vlite.core.scheduler.Scheduler.schedule`
call from counters it keeps anyway (no extra pass over the batch); the engine core exposes
the latest as ``EngineCore.last_step_stats``. Anything more (a history, a trace file) is a
*step observer* registered with ``EngineCore.add_step_observer``: with none registered the
step does no extra work.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Annotated, Any, NamedTuple

if TYPE_CHECKING:
    from vlite.core.outputs import EngineCoreOutputs
    from vlite.core.request import Request


class Metric(NamedTuple):
    """How a statistics field is exposed (``Annotated[int, Metric(...)]`` on the field).

    ``name`` is vLLM's name for the same quantity, without its prefix (a counter's
    ``_total`` suffix is added by the exposition); ``kind`` is ``"counter"`` or ``"gauge"``.
    ``label``: the field is a tuple of values, exposed as one series per index with this
    label (``position="0"``, ...); ``None``: one value.
    """

    name: str
    kind: str
    documentation: str
    label: str | None = None


def metric_values(stats: Any) -> Iterator[tuple[Metric, float]]:
    """Every ``(Metric, value)`` of a statistics object: its annotated fields, and those of
    the statistics objects it holds, in declaration order."""
    for field_name, hint in typing.get_type_hints(type(stats), include_extras=True).items():
        value = getattr(stats, field_name)
        metrics = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Metric)]
        if metrics:
            yield metrics[0], value
        elif dataclasses.is_dataclass(value):
            yield from metric_values(value)


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step's batch and the scheduler decisions behind it.

    A request computing tokens of its prompt (a first prefill, a chunk, or the recompute of
    a preempted request) counts as prefill; one computing only generated tokens as decode.
    The KV block counts are taken once the batch is scheduled (its blocks allocated).

    Waits count decisions that held a request back for a reason other than its place in
    the queue, at most one per reason and phase per step (the requests queued behind the
    one held back wait for the queue):

    * ``num_waits_no_blocks``: the next waiting request could not get its KV blocks.
    * ``num_waits_budget``: a request (running, or next waiting) got no tokens because
      the step's token budget was spent.
    * ``num_waits_max_num_seqs``: the next waiting request found ``max_num_seqs`` running.
    """

    step_index: int
    num_prefill_requests: int
    num_decode_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    token_budget: int
    num_running_requests: int
    num_waiting_requests: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int
    num_prefix_cache_queried_tokens: int
    num_prefix_cache_hit_tokens: int
    num_preemptions: int
    #: Prompt tokens of the requests admitted for the first time in this step (a resumed,
    #: preempted request is not counted again; cached prefix tokens are).
    num_new_prompt_tokens: int
    num_waits_no_blocks: int
    num_waits_budget: int
    num_waits_max_num_seqs: int
    #: Speculative decoding: requests that verify drafts this step, and their drafts.
    num_drafts: int = 0
    num_draft_tokens: int = 0

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_scheduled_requests(self) -> int:
        return self.num_prefill_requests + self.num_decode_requests

    def as_dict(self) -> dict[str, int]:
        record = dataclasses.asdict(self)
        record["num_scheduled_tokens"] = self.num_scheduled_tokens
        return record


class BatchEntry(NamedTuple):
    """One request of a step's batch, as scheduled (before the step ran)."""

    request_id: str
    num_scheduled_tokens: int
    num_computed_tokens: int
    is_prefill: bool


@dataclass(frozen=True)
class CoreOccupancy:
    """What an engine core holds between steps: its KV blocks and its requests."""

    num_kv_blocks: int
    num_free_kv_blocks: int
    num_unfinished_requests: int
    num_running_requests: int
    #: Queued, or waiting for a grammar to compile.
    num_waiting_requests: int

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of KV blocks in use (0 to 1)."""
        return (self.num_kv_blocks - self.num_free_kv_blocks) / max(self.num_kv_blocks, 1)


@dataclass(frozen=True)
class StepRecord:
    """What a step observer receives once a step has finished.

    Attributes:
        stats: the step's statistics.
        batch: the scheduled requests in batch order.
        requests: every request the scheduler held after scheduling (finished ones in
            their final state), read after the step: status and counters are post-step.
        accepted_per_position: speculative decoding: ``[i]`` counts the requests whose
            draft ``i`` the step kept.
    """

    stats: StepStats
    batch: list[BatchEntry]
    requests: list[Request]
    accepted_per_position: tuple[int, ...] = ()


@dataclass
class StepTotals:
    """Running sums over the steps an engine ran; each field is one ``/metrics`` counter.

    A field named like a :class:`StepStats` field sums it; ``num_steps`` counts steps and
    ``num_generation_tokens`` the tokens the steps sampled.
    """

    num_steps: Annotated[int, Metric("engine_steps", "counter", "Engine steps run.")] = 0
    num_new_prompt_tokens: Annotated[
        int,
        Metric(
            "prompt_tokens",
            "counter",
            "Prompt tokens of the requests admitted, each request once (cached prefix tokens "
            "count; recomputation after preemption does not).",
        ),
    ] = 0
    num_generation_tokens: Annotated[
        int, Metric("generation_tokens", "counter", "Generated tokens (every sampled token).")
    ] = 0
    num_prefill_tokens: Annotated[
        int,
        Metric(
            "prefill_tokens_computed",
            "counter",
            "Prompt tokens computed, including chunks and recomputation after preemption.",
        ),
    ] = 0
    num_prefix_cache_queried_tokens: Annotated[
        int,
        Metric("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    ] = 0
    num_prefix_cache_hit_tokens: Annotated[
        int, Metric("prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.")
    ] = 0
    num_preemptions: Annotated[
        int, Metric("num_preemptions", "counter", "Requests preempted to free KV-cache blocks.")
    ] = 0
    num_drafts: Annotated[
        int,
        Metric("spec_decode_num_drafts", "counter", "Requests' steps that verified drafts."),
    ] = 0
    num_draft_tokens: Annotated[
        int, Metric("spec_decode_num_draft_tokens", "counter", "Draft tokens verified.")
    ] = 0
    num_accepted_tokens: Annotated[
        int,
        Metric("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted (kept)."),
    ] = 0
    num_accepted_tokens_per_pos: Annotated[
        tuple[int, ...],
        Metric(
            "spec_decode_num_accepted_tokens_per_pos",
            "counter",
            "Drafts accepted at each position (0: a request's first draft of a step).",
            label="position",
        ),
    ] = ()

    def add(
        self,
        stats: StepStats,
        outputs: EngineCoreOutputs,
        accepted_per_position: typing.Sequence[int] = (),
    ) -> None:
        """Add one step: its :class:`StepStats`, the tokens it sampled and the drafts it
        accepted at each position."""
        self.num_steps += 1
        self.num_accepted_tokens += sum(accepted_per_position)
        self.num_accepted_tokens_per_pos = add_counts(
            self.num_accepted_tokens_per_pos, accepted_per_position
        )
        self.num_generation_tokens += sum(len(o.new_token_ids) for o in outputs.outputs)
        for name in _SUMMED_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(stats, name))


def add_counts(a: typing.Sequence[int], b: typing.Sequence[int]) -> tuple[int, ...]:
    """Two per-index counts summed index by index (the shorter padded with zeros)."""
    length = max(len(a), len(b))
    return tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(length))


#: The StepTotals fields that sum the StepStats field of the same name.
_SUMMED_FIELDS = tuple(
    f.name for f in dataclasses.fields(StepTotals) if f.name in StepStats.__dataclass_fields__
)


#: Called by the engine core after each step it ran (in the engine core's process).
StepObserver = Callable[[StepRecord], None]


class TraceWriter:
    """A step observer that writes JSONL: per step, one ``step`` line then ``request`` lines.

    ``{"event": "step", "step_index": 3, "batch": [{"request_id": "0",
    "num_scheduled_tokens": 1, "num_computed_tokens": 17, "phase": "decode"}, ...],
    ...every StepStats field...}``

    ``{"event": "request", "step_index": 3, "request_id": "0", "status": "running",
    "num_computed_tokens": 18, "num_tokens": 19, "num_prompt_tokens": 17,
    "num_output_tokens": 2, "num_preemptions": 0}`` for every request held that step
    (counters after the step), so each request's lifecycle reads top to bottom.
    """

    def __init__(self, file: IO[str]) -> None:
        self.file = file

    def __call__(self, record: StepRecord) -> None:
        stats = record.stats
        batch = [
            {
                "request_id": entry.request_id,
                "num_scheduled_tokens": entry.num_scheduled_tokens,
                "num_computed_tokens": entry.num_computed_tokens,
                "phase": "prefill" if entry.is_prefill else "decode",
            }
            for entry in record.batch
        ]
        step = {**stats.as_dict(), "batch": batch}
        if record.accepted_per_position:
            step["num_accepted_tokens_per_pos"] = list(record.accepted_per_position)
        lines = [json.dumps({"event": "step", **step})]
        for request in record.requests:
            lines.append(
                json.dumps(
                    {
                        "event": "request",
                        "step_index": stats.step_index,
                        "request_id": request.request_id,
                        "status": request.status.value,
                        "num_computed_tokens": request.num_computed_tokens,
                        "num_tokens": request.num_tokens,
                        "num_prompt_tokens": request.num_prompt_tokens,
                        "num_output_tokens": request.num_output_tokens,
                        "num_preemptions": request.num_preemptions,
                    }
                )
            )
        self.file.write("\n".join(lines) + "\n")
