"""Measuring the engine: workloads stepped through an ``LLMEngine``, and their latencies."""
