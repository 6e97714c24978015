"""Percentiles of latency samples, one convention for every report."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) of ``values``, interpolating linearly between
    order statistics (numpy's default, as vLLM's benchmarks report); ``nan`` when empty."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
