"""AsyncLLM: the online front door (vLLM's ``AsyncLLM``), streaming over an engine-core process.

::

    generate() --tokenize--> EngineCoreRequest --ZMQ--> EngineCoreProc (step loop)
        ^                                                     |
        | RequestOutputCollector <- OutputProcessor <--ZMQ-- EngineCoreOutputs
        +-- output handler task (one per engine) ------------+

Tokenizing, detokenizing and stop strings run here, in the front end; the core process
only schedules and runs the model, so HTTP handling never stalls the step loop. With
``data_parallel_size > 1`` the front end drives several core processes through a
:class:`~vlite.engine.data_parallel_client.DataParallelClient` (each new request goes to
the least-loaded core); everything above the client stays one.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError, InvalidRequestError
from vlite.core.outputs import EngineCoreOutput, RequestOutput, RequestOutputKind
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.request import RequestStatus
from vlite.core.sampling_params import SamplingParams
from vlite.engine.core_client import AsyncMPClient
from vlite.engine.core_messages import EngineCoreInfo, EngineCoreStats, RequestErrors
from vlite.engine.data_parallel_client import DataParallelClient
from vlite.engine.engine_core_proc import EngineCoreFactory
from vlite.engine.exceptions import EngineDeadError, EngineGenerateError
from vlite.engine.input_processor import InputProcessor, Prompt
from vlite.engine.output_collector import RequestOutputCollector
from vlite.engine.output_controls import StructuredOutputValidator
from vlite.engine.output_processor import OutputProcessor
from vlite.models.spec import ModelSpec

logger = logging.getLogger(__name__)

#: Threads that tokenize and template prompts for :meth:`AsyncLLM.tokenize`.
TOKENIZER_THREADS = 2


class AsyncLLM:
    """Generate text online: many concurrent, streaming requests on one engine core (or on
    ``data_parallel_size`` of them).

    Construction starts the engine-core process(es) and returns once they are ready. One
    AsyncLLM serves one asyncio event loop (the loop of its first ``generate()``).

    Args:
        config: the engine configuration (every core gets the same).
        engine_core_factory: builds the EngineCore inside the core process; must be
            picklable (a class or a module-level function). Default: ``EngineCore``.
        startup_timeout_s: most seconds to wait for the core to start (``None``: no limit
            while its process lives).
        data_parallel_size: how many engine-core processes (each a whole engine with its
            own executor) share the requests; 1 (the default) talks to one core directly.
        data_parallel_backend: where those cores run: ``"mp"`` (local processes, each
            with its own GPUs on CUDA) or ``"ray"`` (Ray actors over the cluster's nodes).
        data_parallel_resources: with ``"ray"``, ``NAME=AMOUNT`` custom Ray resources each
            core's actor reserves (e.g. one per node, to put one core on each).

    Raises:
        ValueError: ``data_parallel_size`` is less than 1, or a data-parallel setting the
            machine or cluster cannot take (see :class:`DataParallelClient`).

    Example::

        engine = AsyncLLM.from_config(VliteConfig(model="path/to/model"))
        async for output in engine.generate("Hello", SamplingParams(max_tokens=16)):
            print(output.outputs[0].text)
        engine.shutdown()
    """

    def __init__(
        self,
        config: VliteConfig,
        *,
        engine_core_factory: EngineCoreFactory | None = None,
        startup_timeout_s: float | None = None,
        data_parallel_size: int = 1,
        data_parallel_backend: str = "mp",
        data_parallel_resources: tuple[str, ...] = (),
    ) -> None:
        if data_parallel_size < 1:
            raise ConfigError(
                f"data_parallel_size must be at least 1 (engine-core processes), "
                f"got {data_parallel_size}"
            )
        self.config = config
        self._data_parallel_size = data_parallel_size
        self._collectors: dict[str, RequestOutputCollector] = {}
        self._output_handler: asyncio.Task | None = None
        self._handler_error: EngineDeadError | None = None
        self._request_counter = itertools.count()
        self._finished_observers: list[Callable[[RequestOutput], None]] = []
        # Start the core first: it loads the model while this process loads the tokenizer.
        self.engine_core: AsyncMPClient | DataParallelClient = (
            AsyncMPClient(config, engine_core_factory)
            if data_parallel_size == 1
            else DataParallelClient(
                config,
                data_parallel_size,
                engine_core_factory,
                backend=data_parallel_backend,
                resources=data_parallel_resources,
            )
        )
        try:
            model_spec = ModelSpec.from_config(config)
            self.tokenizer = model_spec.load_tokenizer()
            self.engine_core.wait_until_ready(startup_timeout_s)
        except BaseException:
            self.engine_core.shutdown()
            raise
        validate = StructuredOutputValidator(
            config.structured_outputs_backend, lambda: PluginRegistry(build_plugin_manager())
        )
        self.input_processor = InputProcessor(self.tokenizer, model_spec.vocab_size, validate)
        self.output_processor = OutputProcessor(self.tokenizer)
        #: Tokenizes and templates prompts off the event loop (see :meth:`tokenize`).
        self._tokenizer_pool = ThreadPoolExecutor(
            TOKENIZER_THREADS, thread_name_prefix="vlite-tokenizer"
        )

    @classmethod
    def from_config(cls, config: VliteConfig, **kwargs: Any) -> AsyncLLM:
        """vLLM-style constructor: ``AsyncLLM.from_config(config)``."""
        return cls(config, **kwargs)

    # ---- properties ----------------------------------------------------------------

    @property
    def engine_info(self) -> EngineCoreInfo:
        """What the core reported at startup: attention backend, KV blocks, context length
        (core 0's, with several: they all run the same config)."""
        return self.engine_core.info

    @property
    def engine_infos(self) -> list[EngineCoreInfo]:
        """Every core's startup report, in core order (one without data parallelism)."""
        return self.engine_core.infos

    @property
    def data_parallel_size(self) -> int:
        """How many engine-core processes serve the requests."""
        return self._data_parallel_size

    @property
    def attention_backend_name(self) -> str:
        return self.engine_core.info.attention_backend_name

    @property
    def max_model_len(self) -> int:
        return self.engine_core.info.max_model_len

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why this engine can no longer serve (``None`` while it can)."""
        return self._handler_error or self.engine_core.dead_error

    @property
    def is_running(self) -> bool:
        return self.dead_error is None and not self.engine_core.is_shut_down

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """A prompt dict (text and token ids) for a conversation, ready for a reply."""
        return self.input_processor.apply_chat_template(messages)

    async def tokenize(self, prompt: Prompt, *, add_special_tokens: bool = True) -> dict[str, Any]:
        """``{"prompt": text, "prompt_token_ids": ids}`` for a prompt, tokenized on a worker
        thread so that a long prompt does not hold up the event loop (``generate`` then
        uses the ids as they are). ``add_special_tokens``: see
        :meth:`InputProcessor.tokenize <vlite.engine.input_processor.InputProcessor.tokenize>`."""
        tokenize = functools.partial(
            self.input_processor.tokenize, prompt, add_special_tokens=add_special_tokens
        )
        text, ids = await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, tokenize)
        return {"prompt": text, "prompt_token_ids": ids}

    async def apply_chat_template_async(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> dict[str, Any]:
        """:meth:`apply_chat_template` on a worker thread (``tools``: for the template; the
        other options: see :meth:`InputProcessor.apply_chat_template
        <vlite.engine.input_processor.InputProcessor.apply_chat_template>`)."""
        apply = functools.partial(
            self.input_processor.apply_chat_template,
            messages,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            add_special_tokens=add_special_tokens,
        )
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, apply)

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens included), decoded on a worker thread.

        Raises:
            InvalidRequestError: an id outside the model's vocabulary.
        """
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_pool, self.input_processor.detokenize, token_ids
        )

    # ---- requests ------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs as tokens arrive; the last one has ``finished=True``.

        The request is sent when iteration starts. Cancelling the consumer (or closing
        the iterator early) aborts the request in the core, which frees its KV blocks.

        With ``sampling_params.n > 1`` each output holds the samples: in ``DELTA`` mode
        only the sample(s) that changed (``CompletionOutput.index`` says which), otherwise
        all of them; it is finished when every sample is, and aborting it aborts them all.

        Args:
            prompt: text, or ``{"prompt_token_ids": [...]}``.
            sampling_params: default ``SamplingParams()``.
            request_id: unique among live requests; default: a fresh number.
            priority: lower is more urgent, for schedulers that use it.
            output_kind: ``CUMULATIVE`` (all text so far), ``DELTA`` (only the new text
                and tokens) or ``FINAL_ONLY``.

        Raises:
            InvalidRequestError: the prompt or request is invalid (the core may reject it too).
            EngineGenerateError: the engine failed while running this request.
            EngineDeadError: the engine-core process is gone.
        """
        request_id = str(next(self._request_counter)) if request_id is None else request_id
        collector = self._add_request(
            request_id, prompt, sampling_params or SamplingParams(), priority, output_kind
        )
        is_finished = False
        try:
            while not is_finished:
                output = await collector.get()
                is_finished = output.finished
                yield output
        except BaseException:  # cancelled, closed early, or failed: stop it in the core
            if not is_finished:
                self._abort_now([request_id])
            raise
        finally:
            self._collectors.pop(request_id, None)

    def _add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int,
        output_kind: RequestOutputKind,
    ) -> RequestOutputCollector:
        self._ensure_output_handler()
        if request_id in self._collectors:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        core_request, text = self.input_processor.process(request_id, prompt, params, priority)
        collector = RequestOutputCollector(output_kind)
        core_requests = self.output_processor.add_request(core_request, text, output_kind)
        self._collectors[request_id] = collector
        try:  # n > 1: the n samples, as separate requests (to one core)
            self.engine_core.add_requests(core_requests)
        except BaseException:
            self._abort_now([request_id])
            del self._collectors[request_id]
            raise
        return collector

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests: their consumers get a last output with ``finish_reason="abort"``."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        core_request_ids = self.output_processor.core_request_ids(request_ids)
        for output in self.output_processor.abort_requests(request_ids):
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
        self.engine_core.abort_requests(core_request_ids)

    def _abort_now(self, request_ids: list[str]) -> None:
        core_request_ids = self.output_processor.core_request_ids(request_ids)
        self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(core_request_ids)

    async def get_stats(self) -> EngineCoreStats:
        """The core's counters now (KV blocks free, requests running and waiting, steps);
        with several cores, their sum (:meth:`EngineCoreStats.combined`)."""
        self._ensure_output_handler()
        return await self.engine_core.get_stats()

    async def get_engine_stats(self) -> list[EngineCoreStats | None]:
        """Each core's counters now, in core order; ``None`` for a core that cannot
        answer (dead, or the engine shut down). Never raises for a dead engine."""
        if self._handler_error is not None:  # nothing would read the answers
            return [None] * self._data_parallel_size
        if self.dead_error is None:
            self._ensure_output_handler()
        return await self.engine_core.get_stats_per_core()

    # ---- the output handler --------------------------------------------------------

    def _ensure_output_handler(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(
                self._run_output_handler(), name="vlite-async-llm-output-handler"
            )

    async def _run_output_handler(self) -> None:
        """Pull core outputs, turn them into RequestOutputs and route them to collectors."""
        try:
            while True:
                message = await self.engine_core.get_output()
                if isinstance(message, RequestErrors):
                    self._fail_requests(message)
                else:
                    self._process_outputs(message.outputs)
        except EngineDeadError as exc:
            self._fail_all(exc)
        except Exception as exc:
            logger.exception("AsyncLLM's output handler failed")
            self._handler_error = EngineDeadError(f"the output handler failed: {exc!r}")
            self._fail_all(self._handler_error)

    def add_finished_request_observer(self, observer: Callable[[RequestOutput], None]) -> None:
        """Call ``observer(output)`` with the last output of every request that finishes
        (stopped or length-capped, not aborted), whose ``metrics`` hold its timings; it
        runs on the event loop and must be quick (``/metrics``' histograms use it)."""
        self._finished_observers.append(observer)

    def _process_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        processed = self.output_processor.process_outputs(outputs)
        for output in processed.request_outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
            if output.finished:
                for observer in self._finished_observers:
                    observer(output)
        if processed.request_ids_to_stop:  # stop strings: finish them in the core too
            self.engine_core.finish_requests(
                processed.request_ids_to_stop, RequestStatus.FINISHED_STOPPED
            )

    def _fail_requests(self, errors: RequestErrors) -> None:
        # A failed sample fails its whole request: the other samples are aborted too.
        request_ids = self.output_processor.caller_request_ids(errors.request_ids)
        failed = set(errors.request_ids)
        others = [
            core_id
            for core_id in self.output_processor.core_request_ids(request_ids)
            if core_id not in failed
        ]
        self.output_processor.abort_requests(request_ids)
        if others:
            self.engine_core.abort_requests(others)
        error_cls = InvalidRequestError if errors.is_invalid_request else EngineGenerateError
        for request_id in request_ids:
            collector = self._collectors.get(request_id)
            if collector is not None:
                collector.put_error(error_cls(errors.message))

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with ``error`` (their consumers raise it) and abort
        them in the core, which frees their KV blocks (used by a server's shutdown)."""
        core_request_ids = self.output_processor.core_request_ids(list(self._collectors))
        self._fail_all(error)
        if core_request_ids and self.dead_error is None:
            self.engine_core.abort_requests(core_request_ids)

    def _fail_all(self, error: BaseException) -> None:
        self.output_processor.abort_requests(list(self._collectors))
        for collector in self._collectors.values():
            collector.put_error(error)

    # ---- shutdown ------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engine-core process and the output handler. Idempotent."""
        task = self._output_handler
        if task is not None and not task.done():
            task.cancel()
            loop = task.get_loop()
            if not loop.is_running() and not loop.is_closed():  # called from outside the loop
                loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
        self._fail_all(EngineDeadError("the engine has been shut down"))
        self.engine_core.shutdown()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
