"""The plugin conformance suites: pytest base classes a plugin's tests subclass.

``CONFORMANCE_SUITES`` maps a plugin kind (as in :data:`vlite.core.plugins.PLUGIN_KINDS`)
to the dotted path of its suite class; ``vlite plugins check`` uses it.
"""

from __future__ import annotations

CONFORMANCE_SUITES: dict[str, str] = {
    "scheduler": "vlite.testing.conformance.scheduler.SchedulerConformance",
    "attention_backend": "vlite.testing.conformance.attention.AttentionBackendConformance",
    "sampler": "vlite.testing.conformance.sampler.SamplerConformance",
    "executor": "vlite.testing.conformance.executor.ExecutorConformance",
    "structured_output_backend": (
        "vlite.testing.conformance.structured_output.StructuredOutputBackendConformance"
    ),
    "logits_processor": "vlite.testing.conformance.logits_processor.LogitsProcessorConformance",
    "weight_format": "vlite.testing.conformance.weight_format.WeightFormatConformance",
    "model": "vlite.testing.conformance.model.ModelConformance",
}
