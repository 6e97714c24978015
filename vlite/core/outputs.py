"""What flows between the four stages of a step, and what the user gets back.

``SchedulerOutput`` (scheduler -> executor) is serializable: it crosses to worker
processes. It carries *diffs*: full data for requests the workers have not seen, and only
what changed for the others; workers keep their own per-request state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from vlite.core.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the workers see for the first time.

    ``token_ids`` are all its tokens, the first ``num_prompt_tokens`` the prompt (the
    penalties and ``min_tokens`` need to tell them from the output); ``eos_token_id`` is
    masked out until ``min_tokens`` output tokens exist (unless ``ignore_eos``).
    """

    request_id: str
    token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    eos_token_id: int | None = None


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request the workers already hold: its new blocks and computed-token count.

    When ``is_resumed`` (re-admitted after preemption), ``new_block_ids`` replaces the
    request's block table instead of extending it. ``new_token_ids`` are the tokens this
    step computes (positions ``num_computed_tokens`` on): a worker that samples already
    has them, one that does not (an earlier pipeline stage) learns the sampled ones here.
    ``num_kept_blocks``: the request gave back the blocks past its first this many (they
    held only draft tokens the last step rejected): its table is cut there before
    ``new_block_ids`` are appended (``None``: nothing given back).
    """

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    is_resumed: bool = False
    new_token_ids: list[int] = msgspec.field(default_factory=list)
    num_kept_blocks: int | None = None


class GrammarBitmask(msgspec.Struct, array_like=True):
    """The tokens each structured request that samples this step may sample.

    ``data`` holds ``int32 [len(request_ids), ceil(vocab_size / 32)]`` (native byte order),
    row ``i`` for ``request_ids[i]``: bit ``b`` of word ``w`` is set when token ``32w + b``
    is allowed (see :mod:`vlite.core.structured_output`). A request that verifies ``d``
    drafts has ``d + 1`` rows in a run, one per sampled row (row ``i`` after its first ``i``
    drafts).
    """

    request_ids: list[str]
    data: bytes


class SchedulerOutput(msgspec.Struct, array_like=True):
    """Who runs this step and how many new tokens each computes.

    ``num_scheduled_tokens`` is ordered: the model runner lays the batch out in this order.
    ``finished_request_ids`` are requests finished or aborted since the last step, whose
    worker-side state can be dropped. ``grammar_bitmask`` constrains the structured
    requests that sample this step (``None`` when there are none). ``spec_token_ids``: the
    draft tokens of requests that verify drafts this step (speculative decoding); they are
    the last of the request's ``num_scheduled_tokens``, after its last known token, and the
    worker samples every one of their positions. ``num_lookahead_tokens``: request id -> how
    many drafts the workers make for it after this step (a draft model's, see
    :class:`~vlite.core.proposer.WorkerProposer`), whose slots follow its scheduled ones.
    """

    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    finished_request_ids: list[str]
    num_preempted: int = 0
    grammar_bitmask: GrammarBitmask | None = None
    spec_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    num_lookahead_tokens: dict[str, int] = msgspec.field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class SampledLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities at one sampled position, from the model's raw logits.

    ``token_ids[0]`` is the sampled token and ``token_ids[1:]`` the ``k`` most likely
    tokens, most likely first (the sampled token may be among them too); ``logprobs`` and
    ``ranks`` (1 = the most likely token) go with them.
    """

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Log-probabilities of consecutive prompt tokens: ``entries[i]`` is the token at
    prompt position ``first_position + i`` (>= 1) after the tokens before it, then the top
    alternatives there (a :class:`SampledLogprobs` whose first token is the prompt's)."""

    first_position: int
    entries: list[SampledLogprobs]


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    """Tokens sampled this step.

    ``sampled_token_ids[request_id]`` holds the new tokens of each request that reached the
    end of its known tokens this step; a request in the middle of its prompt is absent.
    ``logprobs[request_id]`` holds one entry per new token, for requests that asked for
    ``logprobs``. ``draft_token_ids[request_id]``: the drafts a draft model made after the
    request's new tokens (``SchedulerOutput.num_lookahead_tokens``).
    ``prompt_logprobs[request_id]``: for a request that asked for ``prompt_logprobs``, the
    prompt positions whose logits the step computed.
    """

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[SampledLogprobs]] = msgspec.field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = msgspec.field(default_factory=dict)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    #: One entry per new token, when the request asked for ``logprobs``.
    new_logprobs: list[SampledLogprobs] | None = None
    #: On the output that brings a request's first tokens and on its last output: when it
    #: was first scheduled (``time.monotonic()``).
    first_scheduled_time: float | None = None
    #: With ``finish_reason="stop"``: the last token is part of the text (a grammar ended
    #: on it), not a stopping token (EOS or a stop token id, whose text is not shown).
    shows_last_token: bool = False
    #: On a request's first output, when it asked for ``prompt_logprobs``: one entry per
    #: prompt token from the second on.
    prompt_logprobs: list[SampledLogprobs] | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


class RequestFailure(msgspec.Struct, array_like=True):
    """A request the core ended because it cannot go on, and why.

    ``is_invalid_request``: the request's own fault (its grammar does not compile: an HTTP
    400), else the engine's (a sampled token its grammar forbids: a bug).
    """

    request_id: str
    message: str
    is_invalid_request: bool = True


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """One step's outputs, and the requests that failed since the previous step (they get
    no output: their consumers get the failure)."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    failures: list[RequestFailure] = msgspec.field(default_factory=list)


class RequestOutputKind(enum.Enum):
    """What a streaming consumer receives for each step (vLLM's names).

    * ``CUMULATIVE``: each RequestOutput holds all the text and tokens so far.
    * ``DELTA``: each holds only what is new since the previous one (for SSE streaming).
    * ``FINAL_ONLY``: a single RequestOutput, when the request finishes.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class Logprob:
    """A token's log-probability at one position (vLLM's names).

    Attributes:
        logprob: natural log of its probability under the model's raw logits.
        rank: 1 for the most likely token, 2 for the next, ...
        decoded_token: the token's text on its own.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: One position's log-probabilities: the sampled token and the top alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's field names).

    ``logprobs`` (when the request asked for them) has one dict per token of
    ``token_ids``; ``cumulative_logprob`` is the sum of the sampled tokens' logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic()``) of a request's milestones, and the gaps between
    its outputs: what ``/metrics``' latency histograms are made of."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    #: Seconds between consecutive outputs that brought tokens, after the first.
    inter_token_latencies: list[float] = field(default_factory=list)
    num_generation_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival until the engine core first scheduled the request."""
        if self.first_scheduled_time is None:
            return None
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def record_tokens(self, now: float, num_tokens: int) -> None:
        """An output with ``num_tokens`` new tokens arrived at ``now``."""
        self.num_generation_tokens += num_tokens
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns for one prompt (vLLM's field names)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    #: With ``SamplingParams.prompt_logprobs``: one entry per prompt token, ``None`` for the
    #: first, then its token's logprob and the top ones (once the prompt is computed).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
