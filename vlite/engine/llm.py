"""LLM: the offline front door (vLLM's ``LLM`` class)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError, InvalidRequestError
from vlite.core.outputs import RequestOutput
from vlite.core.plugins import PluginRegistry
from vlite.core.sampling_params import SamplingParams
from vlite.engine.input_processor import Prompt
from vlite.engine.llm_engine import LLMEngine


class LLM:
    """Generate text for batches of prompts with continuous batching.

    Keyword arguments are :class:`~vlite.core.config.VliteConfig` fields
    (``scheduler="fcfs"``, ``max_num_seqs=...``, ``num_kv_blocks=...``, ...).

    Example::

        llm = LLM(model="path/to/hf-folder")
        outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
        print(outputs[0].outputs[0].text)
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        config: VliteConfig | None = None,
        registry: PluginRegistry | None = None,
        **kwargs: Any,
    ) -> None:
        if config is not None and (model is not None or kwargs):
            raise ConfigError("pass either config=VliteConfig(...) or keyword settings, not both")
        self.config = config or VliteConfig(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.config, registry)

    @classmethod
    def from_engine(cls, llm_engine: LLMEngine) -> LLM:
        """An ``LLM`` around an engine the caller built (e.g. with a tokenizer it loaded)."""
        llm = cls.__new__(cls)
        llm.config = llm_engine.config
        llm.llm_engine = llm_engine
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate a completion for every prompt; outputs come back in input order.

        Args:
            prompts: strings, or dicts with ``prompt_token_ids`` (a single prompt is allowed).
            sampling_params: one for all prompts, or one per prompt; default
                ``SamplingParams()``.
            priority: one integer per prompt (lower is more urgent), for schedulers that
                use it.
            use_tqdm: show a progress bar (on stderr) for batches of more than one prompt.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = _per_prompt("sampling_params", sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidRequestError(
                f"priority has {len(priorities)} entries but there are {len(prompts)} prompts"
            )
        engine = self.llm_engine
        request_ids = []
        try:
            for prompt, params, prio in zip(prompts, params_list, priorities):
                request_ids.append(engine.new_request_id())
                engine.add_request(request_ids[-1], prompt, params, prio)
            return self._run_until_done(request_ids, use_tqdm and len(prompts) > 1)
        except BaseException:
            engine.abort_requests(request_ids)
            raise

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, formatted with the model's chat template.

        Args:
            messages: one conversation (a list of ``{"role": ..., "content": ...}``) or a
                list of conversations.
            sampling_params: as for :meth:`generate`.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.llm_engine.apply_chat_template(list(c)) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run_until_done(self, request_ids: list[str], show_progress: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(
            total=len(request_ids), desc="Generating", unit="req", disable=not show_progress
        ) as progress:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step(emit_unfinished=False):
                    finished[output.request_id] = output
                    progress.update(1)
        return [finished[request_id] for request_id in request_ids]


def _per_prompt(
    name: str, value: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if value is None:
        return [SamplingParams() for _ in range(num_prompts)]
    if isinstance(value, SamplingParams):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise InvalidRequestError(
            f"{name} has {len(values)} entries but there are {num_prompts} prompts"
        )
    return values
