"""The messages between a front end and its EngineCoreProc, and their msgpack codecs.

Every message is a tagged msgspec struct, so one decoder per direction turns bytes back
into the right type. Front end -> core (:data:`CoreInput`): add a request, finish
requests (abort, or stop at a stop string found by the OutputProcessor), ask for
statistics, shut down. Core -> front end (:data:`CoreOutput`): one step's outputs,
requests that failed, a utility result, or a fatal error just before the process exits.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence
from typing import Annotated

import msgspec

from vlite.core.memory import MemoryPlan
from vlite.core.outputs import EngineCoreOutput
from vlite.core.request import EngineCoreRequest, RequestStatus
from vlite.core.stats import Metric, StepTotals, add_counts

# ---- front end -> engine core ---------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request: EngineCoreRequest


class FinishRequests(msgspec.Struct, tag="finish", array_like=True):
    """End requests early; ``status`` is FINISHED_ABORTED or FINISHED_STOPPED."""

    request_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED


class GetStats(msgspec.Struct, tag="stats", array_like=True):
    """A utility call: answered by a :class:`UtilityResult` holding :class:`EngineCoreStats`."""

    call_id: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = AddRequest | FinishRequests | GetStats | Shutdown

# ---- engine core -> front end ---------------------------------------------------------


class EngineCoreInfo(msgspec.Struct, array_like=True):
    """What the core reports once it is ready (the startup handshake)."""

    attention_backend_name: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    pid: int
    #: :meth:`QuantizationPlan.describe` of the weights the core runs with.
    quantization: str = ""
    #: The address the core's input socket is bound to (the front end connects to it).
    input_address: str = ""
    #: Where the core runs: ``"local"``, or a Ray actor's node address.
    node: str = "local"
    #: ``CUDA_VISIBLE_DEVICES`` as the core saw it (``None``: not set).
    visible_devices: str | None = None
    #: What the weights and the KV cache hold (``None``: the executor does not report it).
    memory_plan: MemoryPlan | None = None
    #: The dtype the KV cache stores (``kv_cache_dtype`` as the core resolved it).
    kv_cache_dtype: str = ""


class EngineCoreStats(msgspec.Struct, array_like=True):
    """The core's state between steps (the answer to :class:`GetStats`).

    Every field annotated with a :class:`~vlite.core.stats.Metric`, and every counter of
    ``totals``, is exposed by ``/metrics`` (:func:`vlite.core.stats.metric_values`).
    """

    num_kv_blocks: Annotated[int, Metric("num_kv_cache_blocks", "gauge", "KV-cache blocks in all.")]
    num_free_kv_blocks: int
    kv_cache_usage: Annotated[
        float,
        Metric("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (0 to 1)."),
    ]
    num_unfinished_requests: int
    num_running_requests: Annotated[
        int, Metric("num_requests_running", "gauge", "Requests in the running batch.")
    ]
    num_waiting_requests: Annotated[
        int,
        Metric(
            "num_requests_waiting", "gauge", "Requests waiting to be scheduled (new or preempted)."
        ),
    ]
    num_failed_steps: Annotated[
        int,
        Metric(
            "engine_failed_steps",
            "counter",
            "Engine steps that raised (their requests finished with an error).",
        ),
    ]
    #: Sums over the steps run so far.
    totals: StepTotals

    @classmethod
    def combined(cls, parts: Sequence[EngineCoreStats]) -> EngineCoreStats:
        """Several cores' statistics as one engine's (data parallelism): every count and
        counter summed, ``kv_cache_usage`` the fraction of all their blocks in use.

        Raises:
            ValueError: ``parts`` is empty.
        """
        if not parts:
            raise ValueError("combined() needs the statistics of at least one engine core")
        fields = {
            name: sum(getattr(part, name) for part in parts)
            for name in cls.__struct_fields__
            if name not in ("kv_cache_usage", "totals")
        }
        num_blocks = fields["num_kv_blocks"]
        used_blocks = sum(part.kv_cache_usage * part.num_kv_blocks for part in parts)
        totals = StepTotals(
            **{
                field.name: functools.reduce(
                    add_counts if field.name == "num_accepted_tokens_per_pos" else operator.add,
                    (getattr(part.totals, field.name) for part in parts),
                )
                for field in dataclasses.fields(StepTotals)
            }
        )
        return cls(kv_cache_usage=used_blocks / max(num_blocks, 1), totals=totals, **fields)


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[EngineCoreOutput]


class RequestErrors(msgspec.Struct, tag="errors", array_like=True):
    """Requests the core finished with an error.

    ``is_invalid_request``: the request itself was rejected (a prompt too long, a duplicate
    id) rather than failed by the engine.
    """

    request_ids: list[str]
    message: str
    is_invalid_request: bool = False


class UtilityResult(msgspec.Struct, tag="utility", array_like=True):
    call_id: int
    stats: EngineCoreStats | None = None
    error: str | None = None


class FatalError(msgspec.Struct, tag="fatal", array_like=True):
    """The core's loop failed; the process exits after sending this."""

    message: str


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    message: str


class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: EngineCoreInfo


CoreOutput = StepOutputs | RequestErrors | UtilityResult | FatalError
Handshake = Ready | StartupFailed

encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_decoder = msgspec.msgpack.Decoder(CoreOutput)
handshake_decoder = msgspec.msgpack.Decoder(Handshake)
