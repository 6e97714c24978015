"""``vlite run``: generate completions for prompts from arguments, a file or stdin."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import click

from vlite.cli.options import build_config, engine_options, pop_engine_overrides
from vlite.cli.sampling_flags import given_sampling, sampling_flags
from vlite.core.config import VliteConfig
from vlite.core.errors import InvalidRequestError, VliteError
from vlite.core.memory import kv_cache_tokens_for_requests
from vlite.core.outputs import CompletionOutput, RequestOutput
from vlite.core.sampling_params import SAMPLING_PARAM_NAMES, SamplingParams

#: JSONL fields that set a request's own sampling options.
SAMPLING_FIELDS = SAMPLING_PARAM_NAMES

#: New tokens per completion when ``--max-tokens`` is not given: plain completion.
COMPLETION_MAX_TOKENS = 64

#: ... and with ``--chat``, which generates until the model ends its answer: this cap (and
#: the model's context length, which always ends a request) bounds an answer that never ends.
CHAT_MAX_TOKENS = 1024


@dataclass
class PromptSpec:
    """One request read from the command line, ``--input`` or stdin."""

    prompt: str
    sampling: dict[str, Any] = field(default_factory=dict)
    priority: int = 0


@click.command("run")
@click.argument("prompts", nargs=-1)
@click.option(
    "--input",
    "input_file",
    type=click.File("r"),
    help="File of prompts: plain lines, or JSONL with 'prompt' and optional per-request "
    f"fields (every SamplingParams field: {', '.join(SAMPLING_FIELDS)}; and priority). "
    "'-' reads stdin.",
)
@click.option("--chat", is_flag=True, help="Send each prompt as a user message (chat template).")
@click.option(
    "--max-tokens",
    type=int,
    default=None,
    help=f"Most new tokens each. Default: {COMPLETION_MAX_TOKENS} for plain completion; with "
    f"--chat, until the model ends its answer, at most {CHAT_MAX_TOKENS} (the model's "
    "context length ends any request).",
)
@sampling_flags
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per request.")
@click.option(
    "--trace",
    "trace_file",
    type=click.File("w"),
    help="Write JSONL: each step's batch and statistics, and each request's status and "
    "counters after every step.",
)
@engine_options
def run_command(prompts, input_file, chat, as_json, trace_file, config_file, **options):
    """Generate completions for PROMPTS (or --input FILE, or lines on stdin).

    The prompts are tokenized first, and the KV cache holds what they can use: every
    sample min(prompt + max_tokens, max_model_len) tokens in whole blocks, the
    --max-num-seqs largest at once, within --kv-cache-memory-gib (--num-kv-blocks or
    --kv-cache-tokens set it instead). The memory plan is printed on stderr at start.

    \b
    Examples:
      vlite run "The capital of France is"
      vlite run --chat "Tell me a joke." --max-tokens 48
      vlite run --input prompts.jsonl --json --scheduler fcfs --attn torch
      vlite run --scheduler chunked-prefill --trace trace.jsonl "Hello"
    """
    overrides = pop_engine_overrides(options)
    defaults = _default_sampling(options, chat)
    specs = _read_prompts(prompts, input_file)
    config = build_config(config_file, overrides)
    params = [_sampling_params(defaults, spec.sampling) for spec in specs]

    from vlite.engine.input_processor import InputProcessor

    # The prompts are tokenized before the engine is built, so that the KV cache holds
    # what these requests can use and no more (see sized_for_requests).
    model_spec, tokenizer = _guarded(_load_model_spec_and_tokenizer, config)
    processor = InputProcessor(tokenizer, model_spec.vocab_size)
    inputs = [_to_engine_prompt(processor, spec.prompt, chat) for spec in specs]
    config = sized_for_requests(config, model_spec.max_model_len, inputs, params)
    llm = _guarded(_build_llm, config, tokenizer)
    core = llm.llm_engine.engine_core
    click.echo(
        f"attention backend: {core.attention_backend_name} "
        f"(KV cache in {core.config.kv_cache_dtype})",
        err=True,
    )
    click.echo(f"quantization: {core.quantization.describe(config.torch_dtype)}", err=True)
    if core.memory_plan is not None:
        click.echo(f"memory: {core.memory_plan.describe()}", err=True)
    if trace_file is not None:
        from vlite.core.stats import TraceWriter

        llm.llm_engine.add_step_observer(TraceWriter(trace_file))
    start = time.perf_counter()
    try:
        outputs = llm.generate(inputs, params, priority=[spec.priority for spec in specs])
    except InvalidRequestError as exc:
        raise Refused(str(exc)) from None
    elapsed = time.perf_counter() - start
    for index, output in enumerate(outputs):
        click.echo(_format_output(index, specs[index].prompt, output, as_json))
    click.echo(summary_line(outputs, elapsed), err=True)


def _default_sampling(options: dict[str, Any], chat: bool) -> dict[str, Any]:
    defaults = given_sampling(options)
    defaults["max_tokens"] = options.pop("max_tokens")
    if defaults["max_tokens"] is None:
        defaults["max_tokens"] = CHAT_MAX_TOKENS if chat else COMPLETION_MAX_TOKENS
    return defaults


def _sampling_params(defaults: dict[str, Any], own: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**{**defaults, **own})
    except (ValueError, TypeError) as exc:
        raise click.UsageError(str(exc)) from None


class Refused(click.ClickException):
    """A request, setting or plugin vlite refuses: one line on stderr, exit status 2."""

    exit_code = 2


def _guarded(build, *args):
    """``build(*args)``; a refused setting or a missing model or package becomes a one-line
    error. Anything else is a bug and keeps its traceback."""
    try:
        return build(*args)
    except (VliteError, FileNotFoundError) as exc:
        raise Refused(str(exc)) from None
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None


def _construct(llm_cls, config):
    """``llm_cls(config=config)``, its refusals as one-line errors (``vlite bench``)."""
    return _guarded(lambda: llm_cls(config=config))


def _load_model_spec_and_tokenizer(config):
    from vlite.models.spec import ModelSpec

    model_spec = ModelSpec.from_config(config)
    return model_spec, model_spec.load_tokenizer()


def _build_llm(config, tokenizer):
    from vlite.engine.llm import LLM
    from vlite.engine.llm_engine import LLMEngine

    return LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))


def sized_for_requests(
    config: VliteConfig,
    max_model_len: int,
    prompts: list[dict[str, Any]],
    params: list[SamplingParams],
) -> VliteConfig:
    """``config`` with ``kv_cache_tokens`` set to what these requests can use, and
    ``max_num_seqs`` to at most their sequences (the worker then prepares no larger batch,
    e.g. records no larger decode step for the CPU step replay).

    Every sample of every request (``n`` samples: ``n`` sequences) may hold
    ``min(prompt tokens + max_tokens, max_model_len)`` tokens, rounded up to blocks; the
    cache holds the ``max_num_seqs`` largest at once
    (:func:`~vlite.core.memory.kv_cache_tokens_for_requests`), within the memory budget
    (``kv_cache_memory_gib``). A size the user set (``num_kv_blocks`` or ``kv_cache_tokens``,
    by flag, environment or config file) is kept as it is.
    """
    sequences = [
        (len(prompt["prompt_token_ids"]), request.max_tokens)
        for prompt, request in zip(prompts, params, strict=True)
        for _ in range(request.n)
    ]
    config = config.model_copy(
        update={"max_num_seqs": max(1, min(config.max_num_seqs, len(sequences)))}
    )
    if config.num_kv_blocks is not None or config.kv_cache_tokens is not None:
        return config
    tokens = kv_cache_tokens_for_requests(
        sequences,
        max_model_len=max_model_len,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
    )
    return config.model_copy(update={"kv_cache_tokens": tokens})


def _read_prompts(prompts: tuple[str, ...], input_file) -> list[PromptSpec]:
    if prompts and input_file:
        raise click.UsageError("give prompts as arguments or with --input, not both")
    if prompts:
        return [PromptSpec(p) for p in prompts]
    if input_file is None:
        if sys.stdin.isatty():
            raise click.UsageError("no prompts: pass PROMPTS, --input FILE, or pipe lines on stdin")
        input_file = sys.stdin
    specs = [
        _parse_line(line, number) for number, line in enumerate(input_file, start=1) if line.strip()
    ]
    if not specs:
        raise click.UsageError("the input holds no prompts")
    return specs


def _parse_line(line: str, number: int) -> PromptSpec:
    text = line.rstrip("\n")
    if not text.lstrip().startswith("{"):
        return PromptSpec(text)
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.UsageError(f"input line {number} is not valid JSON: {exc}") from None
    if not isinstance(record.get("prompt"), str):
        raise click.UsageError(f"input line {number} has no string field 'prompt'")
    unknown = set(record) - {"prompt", "priority", *SAMPLING_FIELDS}
    if unknown:
        allowed = ", ".join(("prompt", "priority", *SAMPLING_FIELDS))
        raise click.UsageError(
            f"input line {number} has unknown fields {sorted(unknown)}; allowed: {allowed}"
        )
    sampling = {k: v for k, v in record.items() if k in SAMPLING_FIELDS}
    return PromptSpec(record["prompt"], sampling, int(record.get("priority", 0)))


def _to_engine_prompt(processor, prompt: str, chat: bool) -> dict[str, Any]:
    """The prompt's text and token ids (with ``chat``: as a user message in the chat
    template), tokenized as the engine would."""
    try:
        if chat:
            return processor.apply_chat_template([{"role": "user", "content": prompt}])
        text, token_ids = processor.tokenize(prompt)
    except InvalidRequestError as exc:
        raise Refused(str(exc)) from None
    return {"prompt": text, "prompt_token_ids": token_ids}


def _format_output(index: int, prompt: str, output: RequestOutput, as_json: bool) -> str:
    """One request's output: a JSON object, or a header and the text.

    The first sample's fields are at the top level; a request with several samples
    (``n > 1``) also lists them all under ``"samples"`` (or prints each under a rule).
    """
    completion = output.outputs[0]
    if as_json:
        ttft = output.metrics.time_to_first_token if output.metrics else None
        record = {
            "index": index,
            "prompt": prompt,
            **_completion_record(completion),
            "num_prompt_tokens": len(output.prompt_token_ids),
            "num_cached_tokens": output.num_cached_tokens,
            "ttft_s": ttft,
        }
        if len(output.outputs) > 1:
            record["samples"] = [_completion_record(c) for c in output.outputs]
        return json.dumps(record)
    header = click.style(f"[{index}] {prompt}", bold=True)
    if len(output.outputs) == 1:
        return f"{header}\n{completion.text}\n"
    samples = [f"--- sample {c.index} ---\n{c.text}\n" for c in output.outputs]
    return "\n".join([header, *samples])


def _completion_record(completion: CompletionOutput) -> dict[str, Any]:
    record: dict[str, Any] = {
        "text": completion.text,
        "token_ids": completion.token_ids,
        "finish_reason": completion.finish_reason,
        "num_output_tokens": len(completion.token_ids),
    }
    if completion.logprobs is not None:
        record["cumulative_logprob"] = completion.cumulative_logprob
        # Per token: the sampled token first, then the alternatives.
        record["logprobs"] = [
            [
                {
                    "token_id": token_id,
                    "token": lp.decoded_token,
                    "logprob": lp.logprob,
                    "rank": lp.rank,
                }
                for token_id, lp in position.items()
            ]
            for position in completion.logprobs
        ]
    return record


def summary_line(outputs: list[RequestOutput], elapsed: float) -> str:
    """Requests, prompt and output tokens, wall time, output tokens/s, mean TTFT."""
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ttfts = [
        o.metrics.time_to_first_token
        for o in outputs
        if o.metrics and o.metrics.time_to_first_token is not None
    ]
    mean_ttft = sum(ttfts) / len(ttfts) if ttfts else float("nan")
    return (
        f"{len(outputs)} requests, {num_prompt} prompt tokens, {num_output} output tokens "
        f"in {elapsed:.2f} s: {num_output / max(elapsed, 1e-9):.1f} output tokens/s, "
        f"mean TTFT {mean_ttft * 1000:.0f} ms"
    )
