"""LLMEngine: tokenizer + output processing around an in-process EngineCore."""

from __future__ import annotations

import itertools
import time
from typing import Any

from vlite.core.config import VliteConfig
from vlite.core.engine_core import EngineCore
from vlite.core.outputs import RequestOutput
from vlite.core.plugins import PluginRegistry
from vlite.core.request import EngineCoreRequest, RequestStatus
from vlite.core.sampling_params import SamplingParams
from vlite.core.stats import StepObserver, StepStats
from vlite.engine.output_processor import OutputProcessor


class LLMEngine:
    """The synchronous engine: add requests, call :meth:`step`, collect outputs."""

    def __init__(self, config: VliteConfig, registry: PluginRegistry | None = None) -> None:
        self.config = config
        self.engine_core = EngineCore(config, registry)
        self.tokenizer = self.engine_core.model_spec.load_tokenizer()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def new_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: str | dict,
        params: SamplingParams,
        priority: int = 0,
    ) -> None:
        """Tokenize (unless given ``{"prompt_token_ids": [...]}``) and queue a request."""
        text, token_ids = self._tokenize(prompt)
        core_request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.monotonic(),
            priority=priority,
        )
        self.engine_core.add_request(core_request)
        self.output_processor.add_request(core_request, text)

    def _tokenize(self, prompt: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        raise TypeError(
            f"prompt={prompt!r:.80} is invalid: expected a string or a dict with 'prompt_token_ids'"
        )

    def apply_chat_template(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        """A prompt dict (text and token ids) for a conversation, ready for a reply."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; send plain prompts")
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)
        self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self, emit_unfinished: bool = True) -> list[RequestOutput]:
        """Run one engine step; return the outputs it produced."""
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(core_outputs.outputs, emit_unfinished)
        if processed.request_ids_to_stop:
            self.engine_core.finish_requests(
                processed.request_ids_to_stop, RequestStatus.FINISHED_STOPPED
            )
        return processed.request_outputs

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
