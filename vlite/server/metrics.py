"""``GET /metrics``: the engine's state, counters and request latencies, rendered by
``prometheus_client``.

Three sources, all with vLLM's names under the ``vlite:`` prefix (so dashboards built for
one read the other) and a ``model_name`` label on every sample:

- the engine core's statistics: every field that carries a
  :class:`~vlite.core.stats.Metric` (:class:`~vlite.engine.core_messages.EngineCoreStats`
  and its :class:`~vlite.core.stats.StepTotals`) becomes one metric; gauges are read when
  scraped (one :class:`~vlite.engine.core_messages.GetStats` round trip), counters are sums
  over the steps the core has run since it started;
- :class:`RequestHistograms`: time to first token, inter-token latency, end-to-end latency,
  queue time, prompt and generation lengths of finished requests (vLLM's buckets);
- ``vlite:engine_healthy``: 1, or 0 once the engine is dead (then the core's statistics
  are missing, and the answer is still a valid exposition).

Data parallelism (``--data-parallel-size N``, N > 1): every statistic and
``engine_healthy`` has one series per engine core, labelled ``engine="0"`` ...
``engine="N-1"``, and beside them the server's total as the series *without* an
``engine`` label, the same series a one-core server exposes (which has no per-engine
series). So a dashboard reading the unlabeled series reads the whole server at any N, and
``{engine!=""}`` selects the per-core ones (summing every series counts each core twice).
A total is the sum of the per-engine series, except ``kv_cache_usage_perc`` (the fraction
of all the cores' blocks in use) and ``engine_healthy`` (1 only while every core is
alive, as ``/health`` says). While a core is dead its statistics are missing and so are
the totals; the cores still alive keep their series.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vlite.core.outputs import RequestOutput
from vlite.core.stats import metric_values
from vlite.engine.core_messages import EngineCoreStats

#: The content type of what :func:`render_metrics` returns.
CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "vlite:"
_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


#: vLLM's buckets for each latency histogram, in seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def one_two_five_buckets(largest: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``largest`` (vLLM's buckets for token counts)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > largest:
                return buckets
            buckets.append(step * scale)
        scale *= 10


class RequestHistograms:
    """Latency and length histograms of finished requests (one server, one model).

    Feed it with :meth:`observe` (an ``AsyncLLM`` finished-request observer).
    """

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        lengths = one_two_five_buckets(max_model_len)

        def histogram(name: str, documentation: str, buckets) -> Histogram:
            metric = Histogram(
                PREFIX + name,
                documentation,
                ["model_name"],
                buckets=buckets,
                registry=self.registry,
            )
            return metric.labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive outputs.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue = histogram(
            "request_queue_time_seconds", "Time from arrival to first being scheduled.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of finished requests.", lengths
        )
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of finished requests.", lengths
        )

    def observe(self, output: RequestOutput) -> None:
        """Take in a finished request's timings and lengths."""
        metrics = output.metrics
        if metrics is None:
            return
        for histogram, value in (
            (self.ttft, metrics.time_to_first_token),
            (self.e2e, metrics.e2e_latency),
            (self.queue, metrics.queue_time),
        ):
            if value is not None:
                histogram.observe(value)
        for gap in metrics.inter_token_latencies:
            self.itl.observe(gap)
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(metrics.num_generation_tokens)


#: Extra labels of a series: ``{}`` for the server's total, ``{"engine": "i"}`` for core i.
Labels = dict[str, str]


class _ScrapeCollector:
    """One scrape: the engine cores' statistics (those that answered), their health, and
    the request histograms."""

    def __init__(
        self,
        per_engine: Sequence[EngineCoreStats | None],
        model_name: str,
        histograms: RequestHistograms | None,
    ) -> None:
        self.per_engine = per_engine
        self.model_name = model_name
        self.histograms = histograms

    def collect(self) -> Iterator[Metric]:
        yield self._health()
        yield from self._statistics()
        if self.histograms is not None:
            yield from self.histograms.registry.collect()

    def _health(self) -> Metric:
        healthy = GaugeMetricFamily(
            PREFIX + "engine_healthy",
            "1 while the engine core serves, 0 once it is dead.",
            labels=["model_name"],
        )
        alive = [stats is not None for stats in self.per_engine]
        self._add(healthy, {}, int(all(alive)))
        if len(alive) > 1:
            for index, is_alive in enumerate(alive):
                self._add(healthy, {"engine": str(index)}, int(is_alive))
        return healthy

    def _statistics(self) -> Iterator[Metric]:
        series = self._labelled_statistics()
        if not series:
            return
        columns = [(labels, list(metric_values(stats))) for labels, stats in series]
        for position, (metric, _) in enumerate(columns[0][1]):
            names = ["model_name"] + ([metric.label] if metric.label else [])
            family = _FAMILIES[metric.kind](
                PREFIX + metric.name, metric.documentation, labels=names
            )
            for labels, values in columns:
                value = values[position][1]
                if metric.label is None:
                    self._add(family, labels, value)
                    continue
                for index, count in enumerate(value):  # one series per index
                    self._add(family, {**labels, metric.label: str(index)}, count)
            yield family

    def _labelled_statistics(self) -> list[tuple[Labels, EngineCoreStats]]:
        """The statistics to expose: one core's unlabeled; with several, the total
        (only when every core answered) and then each core's that answered."""
        if len(self.per_engine) == 1:
            stats = self.per_engine[0]
            return [] if stats is None else [({}, stats)]
        answered = [stats for stats in self.per_engine if stats is not None]
        series: list[tuple[Labels, EngineCoreStats]] = []
        if len(answered) == len(self.per_engine):
            series.append(({}, EngineCoreStats.combined(answered)))
        for index, stats in enumerate(self.per_engine):
            if stats is not None:
                series.append(({"engine": str(index)}, stats))
        return series

    def _add(self, family: Metric, labels: Labels, value: float) -> None:
        name = family.name + ("_total" if family.type == "counter" else "")
        family.add_sample(name, {"model_name": self.model_name, **labels}, value)


def render_metrics(
    stats: EngineCoreStats | None | Sequence[EngineCoreStats | None],
    model_name: str,
    histograms: RequestHistograms | None = None,
) -> str:
    """The exposition text for one scrape.

    ``stats``: one engine core's statistics (``None``: it is dead), or a list of each
    core's (``None`` for a dead one): a list of several gives per-engine series and totals
    (see the module docstring), a list of one is the same as its item.
    """
    per_engine = list(stats) if isinstance(stats, Sequence) else [stats]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ScrapeCollector(per_engine, model_name, histograms))
    return generate_latest(registry).decode()
