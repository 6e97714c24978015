"""``GET /metrics``: the engine's state and counters, rendered by ``prometheus_client``.

Nothing is listed here: every field of the engine core's statistics that carries a
:class:`~vlite.core.stats.Metric` (:class:`~vlite.engine.core_messages.EngineCoreStats`
and its :class:`~vlite.core.stats.StepTotals`) becomes one metric. Names are vLLM's under
the ``vlite:`` prefix, so dashboards built for one read the other; every sample carries a
``model_name`` label. Gauges are read from the engine core when scraped (one
:class:`~vlite.engine.core_messages.GetStats` round trip); counters are sums over the steps
the core has run since it started.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vlite.core.stats import metric_values
from vlite.engine.core_messages import EngineCoreStats

#: The content type of what :func:`render_metrics` returns.
CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "vlite:"
_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class _StatsCollector:
    """A one-scrape ``prometheus_client`` collector over an :class:`EngineCoreStats`."""

    def __init__(self, stats: EngineCoreStats, model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for metric, value in metric_values(self.stats):
            family = _FAMILIES[metric.kind](
                PREFIX + metric.name, metric.documentation, labels=["model_name"]
            )
            family.add_metric([self.model_name], value)
            yield family


def render_metrics(stats: EngineCoreStats, model_name: str) -> str:
    """The exposition text for one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, model_name))
    return generate_latest(registry).decode()
