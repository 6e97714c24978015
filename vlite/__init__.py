"""vlite: a small, fast, plugin-architected LLM inference engine on vLLM V1's architecture."""

from vlite.core.hookspecs import PLUGIN_API_VERSION, hookimpl
from vlite.core.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from vlite.core.plugins import vlite_version
from vlite.core.sampling_params import SamplingParams

__version__ = vlite_version()


def __getattr__(name: str):
    # LLM and AsyncLLM pull in torch and transformers; import them only when asked for.
    if name == "LLM":
        from vlite.engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from vlite.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'vlite' has no attribute {name!r}")


__all__ = [
    "LLM",
    "AsyncLLM",
    "PLUGIN_API_VERSION",
    "CompletionOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "hookimpl",
    "__version__",
]
