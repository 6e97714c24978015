"""``GET /metrics``: the engine's state and counters in Prometheus' text format.

Names follow vLLM's (with the ``vlite:`` prefix), so dashboards built for one read the
other. Every sample carries a ``model_name`` label. Gauges are read from the engine core
when scraped (one :class:`~vlite.engine.core_messages.GetStats` round trip); counters are
sums over the steps the core has run since it started.
"""

from __future__ import annotations

from collections.abc import Iterator

from vlite.engine.core_messages import EngineCoreStats

#: Prometheus' content type for the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, value of the stats)
_METRICS = (
    (
        "vlite:num_requests_running",
        "gauge",
        "Requests in the running batch.",
        lambda s: s.num_running_requests,
    ),
    (
        "vlite:num_requests_waiting",
        "gauge",
        "Requests waiting to be scheduled (new or preempted).",
        lambda s: s.num_waiting_requests,
    ),
    (
        "vlite:kv_cache_usage_perc",
        "gauge",
        "Fraction of KV-cache blocks in use (0 to 1).",
        lambda s: 1 - s.num_free_kv_blocks / s.num_kv_blocks if s.num_kv_blocks else 0.0,
    ),
    (
        "vlite:num_kv_cache_blocks",
        "gauge",
        "KV-cache blocks in all.",
        lambda s: s.num_kv_blocks,
    ),
    (
        "vlite:engine_steps_total",
        "counter",
        "Engine steps run.",
        lambda s: s.num_steps,
    ),
    (
        "vlite:engine_failed_steps_total",
        "counter",
        "Engine steps that raised (their requests finished with an error).",
        lambda s: s.num_failed_steps,
    ),
    (
        "vlite:prompt_tokens_total",
        "counter",
        "Prompt tokens computed (prefill, including recomputation after preemption).",
        lambda s: s.num_prefill_tokens,
    ),
    (
        "vlite:generation_tokens_total",
        "counter",
        "Tokens computed for generated tokens (decode).",
        lambda s: s.num_decode_tokens,
    ),
    (
        "vlite:prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        lambda s: s.num_prefix_cache_queried_tokens,
    ),
    (
        "vlite:prefix_cache_hits_total",
        "counter",
        "Prompt tokens found in the prefix cache.",
        lambda s: s.num_prefix_cache_hit_tokens,
    ),
    (
        "vlite:num_preemptions_total",
        "counter",
        "Requests preempted to free KV-cache blocks.",
        lambda s: s.num_preemptions,
    ),
)


def render_metrics(stats: EngineCoreStats, model_name: str) -> str:
    """The exposition text for one scrape."""
    return "".join(_lines(stats, model_name))


def _lines(stats: EngineCoreStats, model_name: str) -> Iterator[str]:
    labels = f'{{model_name="{_escape_label(model_name)}"}}'
    for name, kind, help_text, value_of in _METRICS:
        yield f"# HELP {name} {help_text}\n"
        yield f"# TYPE {name} {kind}\n"
        yield f"{name}{labels} {_format_value(value_of(stats))}\n"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))
