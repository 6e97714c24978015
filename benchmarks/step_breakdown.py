"""Where a decode step's time goes: the host's share of each stage, and the device's.

``B`` requests of ``--input-len`` random prompt tokens decode ``--output-len`` tokens each;
after a warm-up run, every decode step's wall time is split by the stage it was in (timers
wrapped around the engine's functions, no extra synchronisation):

- ``schedule``: the scheduler's ``schedule()``;
- ``prepare``: the worker's state update and input building (``update_states``,
  ``prepare_inputs``);
- ``forward``: launching the model's forward (a CUDA graph's replay, or eager kernels), and
  the LM head;
- ``sample``: building the sampling inputs and launching the sampler;
- ``wait``: bringing the sampled tokens to the host (on a GPU this waits for the device,
  so it holds whatever device time the host's work did not hide);
- ``update``: ``update_from_output`` (stops, the KV cache's bookkeeping);
- ``outputs``: the front end's output processing (detokenizing, ``RequestOutput`` objects);
- ``other``: the rest of the step.

On CUDA, ``--device-profile`` also runs ``torch.profiler`` over some steps and reports the
device's busy time per step (the kernels' sum): a step's wall time above it is the host's.

    python benchmarks/random_model.py llama-1b /tmp/llama-1b --config-only
    python benchmarks/step_breakdown.py --model /tmp/llama-1b --batch-sizes 1 64 --device-profile
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

import vlite.worker.model_runner as model_runner_module
from vlite import LLM
from vlite.bench.workload import Arrival, random_token_ids, run_workload
from vlite.worker.sampled_tokens import SampledTokens

#: Kernels listed by ``--device-profile`` (by total time).
TOP_KERNELS = 15

STAGES = ("schedule", "prepare", "forward", "sample", "wait", "update", "outputs", "other")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model folder (config.json suffices)")
    parser.add_argument("--load-format", default="dummy", help="vlite's load_format")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-gib", type=float, default=4.0)
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a further engine setting (repeatable), e.g. enforce_eager=true",
    )
    parser.add_argument(
        "--device-profile", action="store_true", help="also time the device's kernels (CUDA)"
    )
    parser.add_argument(
        "--cprofile", type=int, default=0, metavar="N", help="print the host's top N functions"
    )
    return parser.parse_args()


class StageTimer:
    """Seconds spent inside each stage, summed over the steps since :meth:`reset`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    def wrap(self, stage: str, function: Callable) -> Callable:
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[stage] += time.perf_counter() - start

        return timed


def instrument(llm: LLM, timer: StageTimer) -> None:
    """Wrap the stages' functions of ``llm``'s (in-process, uniproc) engine in ``timer``."""
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.executor.worker.runner
    core.scheduler.schedule = timer.wrap("schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = timer.wrap("update", core.scheduler.update_from_output)
    runner.update_states = timer.wrap("prepare", runner.update_states)
    model_runner_module.prepare_inputs = timer.wrap("prepare", model_runner_module.prepare_inputs)
    runner.forward = timer.wrap("forward", runner.forward)
    runner.model.compute_logits = timer.wrap("forward", runner.model.compute_logits)
    runner.sample_tokens_deferred = timer.wrap("sample", runner.sample_tokens_deferred)
    SampledTokens.result = timer.wrap("wait", SampledTokens.result)
    processor = engine.output_processor
    processor.process_outputs = timer.wrap("outputs", processor.process_outputs)
    step = engine.step

    def counted_step(*args, **kwargs):
        timer.steps += 1
        return timer.wrap("step", step)(*args, **kwargs)

    engine.step = counted_step


def workload(llm: LLM, batch: int, args: argparse.Namespace, seed: int, output_len: int):
    rng = random.Random(seed)
    vocab = llm.llm_engine.model_spec.vocab_size
    arrivals = [
        Arrival(0, f"r{seed}-{i}", random_token_ids(rng, args.input_len, vocab), output_len)
        for i in range(batch)
    ]
    return run_workload(llm.llm_engine, arrivals)


@contextlib.contextmanager
def device_profile(enabled: bool) -> Iterator[list[float]]:
    """Yields a list that receives the device's kernel seconds over the block (CUDA)."""
    total: list[float] = []
    if not enabled or not torch.cuda.is_available():
        yield total
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield total
    torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total.append(sum(e.device_time for e in kernels) / 1e6)
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in kernels:
        by_name[event.name].append(event.device_time)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    for name, times in top:
        print(
            f"  {sum(times) / 1e3:9.1f} ms  {len(times):6d} x {statistics.mean(times):7.1f} us  "
            f"{name[:90]}"
        )


def report(batch: int, timer: StageTimer, gaps: list[float], device_s: list[float]) -> None:
    steps = max(timer.steps, 1)
    seconds = dict(timer.seconds)
    step_total = seconds.pop("step", 0.0)
    seconds["other"] = step_total - sum(seconds.get(stage, 0.0) for stage in STAGES[:-1])
    per_step = {stage: seconds.get(stage, 0.0) / steps * 1e6 for stage in STAGES}
    line = ", ".join(f"{stage} {per_step[stage]:.0f}" for stage in STAGES)
    print(f"batch {batch}: {steps} steps, {step_total / steps * 1e6:.0f} us/step: {line} (us)")
    print(f"batch {batch}: median token gap {statistics.median(gaps) * 1e6:.0f} us")
    if device_s:
        print(f"batch {batch}: device busy {device_s[0] / steps * 1e6:.0f} us/step (kernels' sum)")


def main() -> None:
    args = parse_args()
    settings = {}
    for item in args.setting:
        key, _, value = item.partition("=")
        settings[key] = {"true": True, "false": False}.get(value.lower(), value)
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        kv_cache_memory_gib=args.kv_cache_gib,
        max_num_seqs=max(args.batch_sizes),
        **settings,
    )
    timer = StageTimer()
    instrument(llm, timer)
    for batch in args.batch_sizes:
        workload(llm, batch, args, seed=0, output_len=8)  # compile and warm up
        # The prefill step is in the workload too; with many decode steps it is noise.
        timer.reset()
        with device_profile(args.device_profile) as device_s:
            result = workload(llm, batch, args, seed=1, output_len=args.output_len)
        report(batch, timer, result.all_token_gaps_s(), device_s)
        if args.cprofile:
            profiler = cProfile.Profile()
            profiler.runcall(workload, llm, batch, args, 2, args.output_len)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
