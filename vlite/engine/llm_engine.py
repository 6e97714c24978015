"""LLMEngine: tokenizer + output processing around an in-process EngineCore."""

from __future__ import annotations

import itertools
from typing import Any

from vlite.core.config import VliteConfig
from vlite.core.engine_core import EngineCore
from vlite.core.errors import InvalidRequestError
from vlite.core.memory import MemoryPlan
from vlite.core.outputs import RequestFailure, RequestOutput
from vlite.core.plugins import PluginRegistry
from vlite.core.request import RequestStatus
from vlite.core.sampling_params import SamplingParams
from vlite.core.stats import StepObserver, StepStats
from vlite.engine.exceptions import EngineGenerateError
from vlite.engine.input_processor import InputProcessor, Prompt
from vlite.engine.output_controls import StructuredOutputValidator
from vlite.engine.output_processor import OutputProcessor
from vlite.models.spec import ModelSpec


class LLMEngine:
    """The synchronous engine: add requests, call :meth:`step`, collect outputs.

    Args:
        config: the engine configuration.
        registry: plugin classes to draw from; by default a fresh plugin manager's.
        tokenizer: the model's tokenizer (``ModelSpec.load_tokenizer()``) when the caller
            has loaded it already (``vlite run`` tokenizes its prompts to size the KV cache
            before the engine is built); by default it is loaded here.
    """

    def __init__(
        self,
        config: VliteConfig,
        registry: PluginRegistry | None = None,
        *,
        tokenizer: Any | None = None,
    ) -> None:
        self.config = config
        self.model_spec = model_spec = ModelSpec.from_config(config)
        # The tokenizer first: building a large vocabulary's (Gemma 3's 262,144 tokens) peaks
        # at a few hundred MiB it then frees, which would otherwise come on top of the
        # weights the engine has touched by then.
        self.tokenizer = tokenizer if tokenizer is not None else model_spec.load_tokenizer()
        self.engine_core = EngineCore(config, model_spec, registry)
        validate = StructuredOutputValidator(
            config.structured_outputs_backend, self.engine_core.registry
        )
        self.input_processor = InputProcessor(self.tokenizer, model_spec.vocab_size, validate)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    @property
    def eos_token_id(self) -> int | None:
        return self.input_processor.eos_token_id

    def new_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
    ) -> None:
        """Tokenize (unless given ``{"prompt_token_ids": [...]}``) and queue a request
        (``params.n > 1``: its ``n`` samples, which finish together as one output)."""
        core_request, text = self.input_processor.process(request_id, prompt, params, priority)
        core_requests = self.output_processor.add_request(core_request, text)
        added: list[str] = []
        try:
            for request in core_requests:
                self.engine_core.add_request(request)
                added.append(request.request_id)
        except BaseException:
            self.engine_core.abort_requests(added)
            self.output_processor.abort_requests([request_id])
            raise

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """A prompt dict (text and token ids) for a conversation, ready for a reply."""
        return self.input_processor.apply_chat_template(messages)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests (with all the samples of an ``n > 1`` request)."""
        self.engine_core.abort_requests(self.output_processor.core_request_ids(request_ids))
        self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self, emit_unfinished: bool = True) -> list[RequestOutput]:
        """Run one engine step; return the outputs it produced.

        Raises:
            InvalidRequestError: a request could not go on (its grammar did not compile);
                its other samples are aborted, the other requests go on with later steps.
            EngineGenerateError: the core ended a request for its own fault.
        """
        core_outputs = self.engine_core.step()
        if core_outputs.failures:
            self._fail_requests(core_outputs.failures)
        processed = self.output_processor.process_outputs(core_outputs.outputs, emit_unfinished)
        if processed.request_ids_to_stop:
            self.engine_core.finish_requests(
                processed.request_ids_to_stop, RequestStatus.FINISHED_STOPPED
            )
        return processed.request_outputs

    def _fail_requests(self, failures: list[RequestFailure]) -> None:
        failure = failures[0]
        request_ids = self.output_processor.caller_request_ids([f.request_id for f in failures])
        self.abort_requests(request_ids)
        error_cls = InvalidRequestError if failure.is_invalid_request else EngineGenerateError
        raise error_cls(f"request {request_ids[0]!r}: {failure.message}")

    @property
    def memory_plan(self) -> MemoryPlan | None:
        """What the weights and the KV cache hold (see :class:`~vlite.core.memory.MemoryPlan`)."""
        return self.engine_core.memory_plan

    @property
    def last_step_stats(self) -> StepStats | None:
        """The latest step's statistics (see :class:`~vlite.core.stats.StepStats`)."""
        return self.engine_core.last_step_stats

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call ``observer`` with a :class:`~vlite.core.stats.StepRecord` after each step."""
        self.engine_core.add_step_observer(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        self.engine_core.remove_step_observer(observer)

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    def get_tokenizer(self) -> Any:
        return self.tokenizer
