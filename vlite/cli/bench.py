"""``vlite bench``: throughput and latency of the engine on a synthetic workload."""

from __future__ import annotations

import json
import random
from typing import Any

import click
from tqdm.auto import tqdm

from vlite.cli.options import build_config, engine_options, pop_engine_overrides
from vlite.core.errors import InvalidRequestError


@click.command("bench")
@click.option("--num-prompts", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--input-len", type=click.IntRange(min=1), default=128, show_default=True, help="Prompt tokens."
)
@click.option(
    "--output-len",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Tokens generated per request (end-of-sequence is ignored).",
)
@click.option(
    "--arrive-every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Engine steps between arrivals; 0: all requests arrive at once (offline throughput).",
)
@click.option(
    "--warmup/--no-warmup", default=True, show_default=True, help="Run a short request first."
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as one JSON object.")
@engine_options
def bench_command(
    num_prompts, input_len, output_len, arrive_every, warmup, as_json, config_file, **options
):
    """Measure throughput, time to first token and inter-token latency.

    Random prompts (token ids drawn with the engine seed) are decoded greedily for exactly
    --output-len tokens each. Arrivals are placed at engine steps, so a run is repeatable
    and two configurations see the same batches.

    \b
    Examples:
      vlite bench
      vlite bench --num-prompts 64 --input-len 512 --output-len 128 --scheduler chunked-prefill
      vlite bench --arrive-every 4 --attn triton --json
    """
    from vlite.bench.workload import Arrival, random_token_ids, run_workload
    from vlite.cli.run import _construct
    from vlite.engine.llm import LLM

    config = build_config(config_file, pop_engine_overrides(options))
    engine = _construct(LLM, config).llm_engine
    rng = random.Random(config.seed)
    vocab_size = min(len(engine.tokenizer), engine.model_spec.hf_config.vocab_size)
    arrivals = [
        Arrival(
            index * arrive_every,
            f"bench-{index}",
            random_token_ids(rng, input_len, vocab_size),
            output_len,
        )
        for index in range(num_prompts)
    ]
    try:
        if warmup:
            run_workload(engine, [Arrival(0, "warmup", arrivals[0].prompt_token_ids[:16], 4)])
        totals = engine.engine_core.step_totals
        drafted, accepted = totals.num_draft_tokens, totals.num_accepted_tokens
        with tqdm(total=num_prompts, desc="Benchmarking", unit="req", disable=as_json) as bar:
            result = run_workload(engine, arrivals, on_request_finished=lambda: bar.update(1))
        drafted = totals.num_draft_tokens - drafted
        accepted = totals.num_accepted_tokens - accepted
    except InvalidRequestError as exc:  # a prompt that cannot fit the model or the cache
        raise click.ClickException(str(exc)) from None
    finally:
        engine.shutdown()
    summary = summarize(result)
    summary["attention_backend"] = engine.engine_core.attention_backend_name
    summary["scheduler"] = config.scheduler
    if config.speculative_config is not None:
        summary["speculative"] = {
            "method": config.speculative_config.method,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None,
        }
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(format_summary(summary, num_prompts, input_len, output_len, arrive_every))


def summarize(result) -> dict[str, Any]:
    """The figures of a :class:`~vlite.bench.workload.WorkloadResult`, times in ms."""
    from vlite.bench.percentiles import percentile

    ttfts = list(result.ttft_s.values())
    gaps = result.all_token_gaps_s()

    def stats_ms(values: list[float]) -> dict[str, float]:
        mean = sum(values) / len(values) if values else float("nan")
        return {
            "mean": mean * 1e3,
            "p50": percentile(values, 50) * 1e3,
            "p99": percentile(values, 99) * 1e3,
        }

    return {
        "num_requests": len(result.ttft_s),
        "num_prompt_tokens": result.num_prompt_tokens,
        "num_output_tokens": result.num_output_tokens,
        "wall_s": result.wall_s,
        "requests_per_s": result.requests_per_s,
        "output_tokens_per_s": result.output_tokens_per_s,
        "total_tokens_per_s": result.total_tokens_per_s,
        "ttft_ms": stats_ms(ttfts),
        "itl_ms": stats_ms(gaps),
        "num_steps": result.num_steps,
        "num_preemptions": result.num_preemptions,
    }


def format_summary(
    summary: dict[str, Any], num_prompts: int, input_len: int, output_len: int, arrive_every: int
) -> str:
    arrival = f"one every {arrive_every} steps" if arrive_every else "all at once"
    ttft, itl = summary["ttft_ms"], summary["itl_ms"]
    return "\n".join(
        [
            f"{num_prompts} requests of {input_len} prompt + {output_len} output tokens, "
            f"arriving {arrival}; scheduler {summary['scheduler']}, attention backend "
            f"{summary['attention_backend']}",
            f"  throughput  {summary['requests_per_s']:8.2f} req/s  "
            f"{summary['output_tokens_per_s']:9.1f} output tok/s  "
            f"{summary['total_tokens_per_s']:9.1f} total tok/s",
            _latency_line("TTFT (ms)", ttft),
            _latency_line("ITL (ms)", itl),
            f"  {summary['num_steps']} steps, {summary['num_preemptions']} preemptions, "
            f"{summary['wall_s']:.2f} s",
            *_speculative_lines(summary.get("speculative")),
        ]
    )


def _speculative_lines(speculative: dict[str, Any] | None) -> list[str]:
    if speculative is None:
        return []
    acceptance = speculative["acceptance"]
    share = f" ({acceptance:.0%} accepted)" if acceptance is not None else ""
    return [
        f"  speculative decoding ({speculative['method']}): "
        f"{speculative['num_draft_tokens']} draft tokens verified, "
        f"{speculative['num_accepted_tokens']} kept{share}"
    ]


def _latency_line(name: str, stats_ms: dict[str, float]) -> str:
    return "  {:<11} mean {mean:8.1f}  p50 {p50:8.1f}  p99 {p99:8.1f}".format(name, **stats_ms)
