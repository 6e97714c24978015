"""vlite's conformance suites, run on this package's plugins as installed (entry point)."""

from vlite.testing import LogitsProcessorConformance, SamplerConformance, SchedulerConformance


class TestShortestPromptFirstPolicy(SchedulerConformance):
    plugin_name = "shortest-prompt-first"


class TestMultinomialSampler(SamplerConformance):
    plugin_name = "multinomial"


class TestNoRepeatNgram(LogitsProcessorConformance):
    plugin_name = "no-repeat-ngram"
