"""A workload of requests arriving at engine steps, and the latencies it measures.

Arrivals are placed at engine steps, not wall-clock times, so two engines (or two
configurations) given the same workload see the same batches: a comparison between them
measures the engine, not the timing of a load generator.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from vlite.core.sampling_params import SamplingParams
from vlite.engine.llm_engine import LLMEngine


@dataclass
class Arrival:
    """A request added to the engine just before step ``at_step``."""

    at_step: int
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int = 0


@dataclass
class WorkloadResult:
    """Timings of one run of a workload.

    Attributes:
        wall_s: from the first step to the last.
        num_prompt_tokens / num_output_tokens: over all finished requests.
        ttft_s: request id -> seconds from its arrival to its first token.
        token_gaps_s: request id -> seconds between its consecutive tokens (inter-token
            latencies; a step that yields several tokens counts one gap).
        num_steps / num_preemptions: engine steps run, requests preempted.
    """

    wall_s: float = 0.0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: dict[str, float] = field(default_factory=dict)
    token_gaps_s: dict[str, list[float]] = field(default_factory=dict)
    num_steps: int = 0
    num_preemptions: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        total = self.num_prompt_tokens + self.num_output_tokens
        return total / self.wall_s if self.wall_s else 0.0

    @property
    def requests_per_s(self) -> float:
        return len(self.ttft_s) / self.wall_s if self.wall_s else 0.0

    def all_token_gaps_s(self, request_id_prefix: str = "") -> list[float]:
        """Every inter-token gap, of the requests whose id starts with the prefix."""
        return [
            gap
            for request_id, gaps in self.token_gaps_s.items()
            if request_id.startswith(request_id_prefix)
            for gap in gaps
        ]


def run_workload(
    engine: LLMEngine,
    arrivals: list[Arrival],
    on_request_finished: Callable[[], None] | None = None,
) -> WorkloadResult:
    """Step the engine, adding each arrival before its step; time every token.

    Requests are greedy and ignore end-of-sequence, so each makes exactly ``max_tokens``.
    ``on_request_finished`` is called once per finished request (a progress bar).
    """
    pending = sorted(arrivals, key=lambda arrival: arrival.at_step)
    added_at: dict[str, float] = {}
    last_token_at: dict[str, float] = {}
    result = WorkloadResult()
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].at_step <= result.num_steps:
            arrival = pending.pop(0)
            params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0.0, ignore_eos=True)
            prompt = {"prompt_token_ids": arrival.prompt_token_ids}
            engine.add_request(arrival.request_id, prompt, params, arrival.priority)
            added_at[arrival.request_id] = time.perf_counter()
        outputs = _step(engine, result)
        now = time.perf_counter()
        for output in outputs:
            request_id = output.request_id
            num_tokens = len(output.outputs[0].token_ids)
            if request_id not in result.ttft_s and num_tokens:
                result.ttft_s[request_id] = now - added_at[request_id]
            elif request_id in last_token_at:
                result.token_gaps_s.setdefault(request_id, []).append(
                    now - last_token_at[request_id]
                )
            last_token_at[request_id] = now
            if output.finished:
                result.num_output_tokens += num_tokens
                result.num_prompt_tokens += len(output.prompt_token_ids)
                if on_request_finished is not None:
                    on_request_finished()
        result.num_steps += 1
    result.wall_s = time.perf_counter() - start
    return result


def _step(engine: LLMEngine, result: WorkloadResult) -> list:
    """One engine step (none while waiting for the next arrival); counts preemptions."""
    if not engine.has_unfinished_requests():
        return []
    outputs = engine.step()
    result.num_preemptions += engine.last_step_stats.num_preemptions
    return outputs


def random_token_ids(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    """Random prompt token ids, avoiding the lowest ids (often special tokens)."""
    low = min(4, vocab_size - 1)
    return [rng.randrange(low, vocab_size) for _ in range(num_tokens)]
