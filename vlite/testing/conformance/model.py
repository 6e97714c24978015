"""ModelConformance: a model plugin's greedy tokens equal transformers' on a tiny model.

For the architecture the plugin registers (:attr:`PluginConformance.plugin_name`, a name
as in a ``config.json``'s ``architectures``), the suite writes a tiny random-weight
Hugging Face model of it (:func:`~vlite.testing.engine_runs.cached_tiny_model`, with the
test class's :attr:`ModelConformance.tiny_config` overrides) and holds the float32 greedy
tokens ``vlite.LLM`` generates through the plugin, and each token's log-probability, to
those of ``transformers``' greedy ``generate`` on the same folder
(:func:`~vlite.testing.engine_runs.transformers_greedy`):

- one prompt at a time (``max_num_seqs=1``);
- several prompts in one batch (confirmed: a step held two requests or more);
- prefix-cache hits: requests sharing a prefix that an earlier request computed
  (confirmed: the steps report prefix-cache hit tokens);
- forced preemption: a KV cache too small for the batch (confirmed: the steps report
  preemptions);
- ``tensor_parallel_size`` ranks of the ``multiproc`` executor, when the class claims
  ``supports_tensor_parallel`` and its ``check_tensor_parallel_size`` accepts the tiny
  config (skipped, naming the refusal, otherwise).

The log-probabilities catch what greedy tokens cannot: a logit scale (the argmax does not
change) and small errors that flip no token of a short run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from vlite.core.sampling_params import SamplingParams
from vlite.core.stats import StepRecord, StepStats
from vlite.testing.conformance.base import PluginConformance
from vlite.testing.engine_runs import (
    Continuation,
    cached_tiny_model,
    call_with_timeout,
    transformers_greedy,
)


class StepLog:
    """A step observer keeping every step's :class:`~vlite.core.stats.StepStats`."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def __call__(self, record: StepRecord) -> None:
        self.steps.append(record.stats)

    def total(self, field: str) -> int:
        """The sum of ``field`` over the steps (``num_preemptions``, ...)."""
        return sum(getattr(stats, field) for stats in self.steps)

    @property
    def max_batch(self) -> int:
        """The most requests one step scheduled."""
        return max((stats.num_scheduled_requests for stats in self.steps), default=0)


class ModelConformance(PluginConformance):
    """Conformance suite for ``register_models`` plugins (see the module docstring).

    Capability flag (a class attribute of the model class): ``supports_tensor_parallel``
    (default ``False``, as the loader reads it).

    Attributes:
        tiny_config: config fields of the tiny model, over
            :func:`~vlite.testing.tiny_models.make_tiny_model`'s defaults (and its
            ``num_kv_heads``, ``tie_word_embeddings`` and ``seed``), e.g. Granite's
            multipliers, so that what the model does differently is exercised. Default
            (``None``): the model class's own ``tiny_config`` attribute, which is what
            ``vlite plugins check`` uses, else ``make_tiny_model``'s defaults.
        prompt_lengths: the prompts run alone, in a batch and under preemption.
        prefix_len: tokens the prefix-cache prompts share (whole blocks are cached).
        prefix_tail_lengths: each prefix-cache prompt's own tokens after the prefix.
        num_new_tokens: greedy tokens generated per prompt.
        block_size: tokens per KV-cache block.
        preemption_kv_blocks: the KV blocks of the preemption run: enough for the longest
            request alone, too few for all of ``prompt_lengths`` at once.
        logprob_atol: how far a token's log-probability may be from transformers'.
        tensor_parallel_size: the size tried when the class supports tensor parallelism.
        hang_timeout_s: how long one engine call may take before it counts as a hang.
        seed: the seed of the random prompts.
    """

    plugin_kind = "model"
    tiny_config: ClassVar[dict[str, Any] | None] = None
    prompt_lengths: ClassVar[tuple[int, ...]] = (1, 6, 19, 33)
    prefix_len: ClassVar[int] = 24
    prefix_tail_lengths: ClassVar[tuple[int, ...]] = (3, 10)
    num_new_tokens: ClassVar[int] = 8
    block_size: ClassVar[int] = 4
    preemption_kv_blocks: ClassVar[int] = 12
    logprob_atol: ClassVar[float] = 1e-3
    tensor_parallel_size: ClassVar[int] = 2
    hang_timeout_s: ClassVar[float] = 120.0
    seed: ClassVar[int] = 0
    capability_defaults: ClassVar[dict[str, bool]] = {"supports_tensor_parallel": False}
    supports_tensor_parallel: ClassVar[bool | None] = None

    def check_interface(self, plugin_cls: Any) -> None:
        assert isinstance(plugin_cls, type), f"{plugin_cls!r} is not a class"
        for member in ("forward", "compute_logits", "load_weights"):
            assert callable(getattr(plugin_cls, member, None)), (
                f"{plugin_cls.__qualname__} has no {member}() (vlite.core.model.CausalLM)"
            )

    # ---- the tiny model, its prompts and transformers' answers -------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_model_settings(cls, plugin_cls) -> dict[str, Any]:
        """:attr:`tiny_config`, else the model class's own ``tiny_config`` (else none)."""
        if cls.tiny_config is not None:
            return dict(cls.tiny_config)
        return dict(getattr(plugin_cls, "tiny_config", None) or {})

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_model_folder(cls, conformance_plugin_name, tiny_model_settings) -> Path:
        """A tiny random-weight model of the architecture, made once per process."""
        try:
            return cached_tiny_model(conformance_plugin_name, **tiny_model_settings)
        except ValueError as error:
            pytest.fail(
                f"the suite cannot write a tiny {conformance_plugin_name}: {error}; override "
                "the class-scoped fixture tiny_model_folder to return a model folder"
            )

    @pytest.fixture(scope="class")
    @classmethod
    def suite_prompts(cls, tiny_model_folder) -> dict[str, list[list[int]]]:
        """``"plain"``: one prompt per :attr:`prompt_lengths`; ``"prefixed"``: prompts
        sharing :attr:`prefix_len` tokens. Ids avoid the special ids below 4."""
        from transformers import AutoConfig

        vocab_size = AutoConfig.from_pretrained(tiny_model_folder).vocab_size
        rng = random.Random(cls.seed)

        def tokens(count: int) -> list[int]:
            return [rng.randrange(4, vocab_size) for _ in range(count)]

        prefix = tokens(cls.prefix_len)
        return {
            "plain": [tokens(length) for length in cls.prompt_lengths],
            "prefixed": [prefix + tokens(length) for length in cls.prefix_tail_lengths],
        }

    @pytest.fixture(scope="class")
    @classmethod
    def expected(cls, tiny_model_folder, suite_prompts) -> dict[str, list[Continuation]]:
        """transformers' greedy continuations of :meth:`suite_prompts`, by group."""
        return {
            group: transformers_greedy(tiny_model_folder, prompts, cls.num_new_tokens)
            for group, prompts in suite_prompts.items()
        }

    # ---- running vlite -----------------------------------------------------------------

    def make_llm(self, folder: Path, registry: Any, **overrides: Any) -> Any:
        """A float32 ``LLM`` on the tiny model, with the plugin in its registry."""
        from vlite.engine.llm import LLM

        settings: dict[str, Any] = dict(
            block_size=self.block_size, seed=0, dtype="float32", enable_prefix_caching=False
        )
        settings.update(overrides)
        return call_with_timeout(
            lambda: LLM(model=str(folder), registry=registry, **settings),
            self.hang_timeout_s,
            "constructing an LLM",
        )

    def generate(self, llm: Any, prompts: Sequence[list[int]]) -> list[Continuation]:
        """Each prompt's greedy tokens and their log-probabilities (one batch)."""
        params = SamplingParams(
            max_tokens=self.num_new_tokens, temperature=0.0, ignore_eos=True, logprobs=0
        )
        outputs = call_with_timeout(
            lambda: llm.generate(
                [{"prompt_token_ids": prompt} for prompt in prompts], params, use_tqdm=False
            ),
            self.hang_timeout_s,
            "LLM.generate",
        )
        continuations = []
        for output in outputs:
            completion = output.outputs[0]
            logprobs = [
                position[token].logprob
                for token, position in zip(completion.token_ids, completion.logprobs, strict=True)
            ]
            continuations.append(Continuation(list(completion.token_ids), logprobs))
        return continuations

    def run_logged(self, llm: Any, prompts: Sequence[list[int]]) -> tuple[list, StepLog]:
        """:meth:`generate` with every step's statistics kept."""
        log = StepLog()
        llm.llm_engine.add_step_observer(log)
        try:
            return self.generate(llm, prompts), log
        finally:
            llm.llm_engine.remove_step_observer(log)

    def assert_continuations_equal(
        self, got: list[Continuation], expected: list[Continuation], name: str, what: str
    ) -> None:
        """Same tokens as transformers, each within :attr:`logprob_atol` of its logprob."""
        assert len(got) == len(expected)
        for index, (mine, theirs) in enumerate(zip(got, expected)):
            assert mine.token_ids == theirs.token_ids, (
                f"{what}, prompt {index}: {name} generated {mine.token_ids}, transformers "
                f"{theirs.token_ids}"
            )
            worst = max(
                (abs(a - b), position)
                for position, (a, b) in enumerate(zip(mine.logprobs, theirs.logprobs))
            )
            assert worst[0] <= self.logprob_atol, (
                f"{what}, prompt {index}: the log-probability of token {worst[1]} is "
                f"{mine.logprobs[worst[1]]:.6f} in {name}, {theirs.logprobs[worst[1]]:.6f} "
                f"in transformers (allowed: {self.logprob_atol:g})"
            )

    def shutdown(self, llm: Any) -> None:
        call_with_timeout(llm.llm_engine.shutdown, self.hang_timeout_s, "shutdown()")

    # ---- the cases ---------------------------------------------------------------------

    def test_one_prompt_at_a_time_equals_transformers(
        self, plugin_registry, conformance_plugin_name, tiny_model_folder, suite_prompts, expected
    ) -> None:
        llm = self.make_llm(tiny_model_folder, plugin_registry, max_num_seqs=1)
        try:
            got = [self.generate(llm, [prompt])[0] for prompt in suite_prompts["plain"]]
        finally:
            self.shutdown(llm)
        self.assert_continuations_equal(
            got, expected["plain"], conformance_plugin_name, "one at a time"
        )

    def test_a_batch_equals_transformers(
        self, plugin_registry, conformance_plugin_name, tiny_model_folder, suite_prompts, expected
    ) -> None:
        llm = self.make_llm(tiny_model_folder, plugin_registry)
        try:
            got, log = self.run_logged(llm, suite_prompts["plain"])
        finally:
            self.shutdown(llm)
        assert log.max_batch >= 2, "no step held two requests: the batch was never batched"
        self.assert_continuations_equal(got, expected["plain"], conformance_plugin_name, "batch")

    def test_prefix_cache_hits_equal_transformers(
        self, plugin_registry, conformance_plugin_name, tiny_model_folder, suite_prompts, expected
    ) -> None:
        prompts = suite_prompts["prefixed"]
        llm = self.make_llm(tiny_model_folder, plugin_registry, enable_prefix_caching=True)
        try:
            first, _ = self.run_logged(llm, prompts[:1])  # computes and caches the prefix
            rest, log = self.run_logged(llm, prompts[1:])
        finally:
            self.shutdown(llm)
        hits = log.total("num_prefix_cache_hit_tokens")
        assert hits >= self.prefix_len // self.block_size * self.block_size, (
            f"the later requests found {hits} prompt tokens in the prefix cache, expected "
            f"the {self.prefix_len}-token shared prefix's whole blocks"
        )
        self.assert_continuations_equal(
            first + rest, expected["prefixed"], conformance_plugin_name, "prefix-cache hits"
        )

    def test_forced_preemption_equals_transformers(
        self, plugin_registry, conformance_plugin_name, tiny_model_folder, suite_prompts, expected
    ) -> None:
        llm = self.make_llm(
            tiny_model_folder, plugin_registry, num_kv_blocks=self.preemption_kv_blocks
        )
        try:
            got, log = self.run_logged(llm, suite_prompts["plain"])
        finally:
            self.shutdown(llm)
        assert log.total("num_preemptions") > 0, (
            f"no request was preempted with {self.preemption_kv_blocks} KV blocks of "
            f"{self.block_size}: lower preemption_kv_blocks"
        )
        self.assert_continuations_equal(
            got, expected["plain"], conformance_plugin_name, "forced preemption"
        )

    def test_tensor_parallel_equals_transformers(
        self,
        plugin_cls,
        plugin_registry,
        conformance_plugin_name,
        tiny_model_folder,
        suite_prompts,
        expected,
    ) -> None:
        self.require(plugin_cls, "supports_tensor_parallel")
        from transformers import AutoConfig

        tp = self.tensor_parallel_size
        check = getattr(plugin_cls, "check_tensor_parallel_size", None)
        if check is not None:
            try:
                check(AutoConfig.from_pretrained(tiny_model_folder), tp)
            except ValueError as refusal:  # ConfigError is a ValueError
                pytest.skip(
                    f"{plugin_cls.__qualname__}.check_tensor_parallel_size refuses "
                    f"tensor_parallel_size={tp} for the tiny config: {refusal}"
                )
        llm = self.make_llm(
            tiny_model_folder, plugin_registry, executor="multiproc", tensor_parallel_size=tp
        )
        try:
            got, log = self.run_logged(llm, suite_prompts["plain"])
        finally:
            self.shutdown(llm)
        assert log.max_batch >= 2, "no step held two requests"
        self.assert_continuations_equal(
            got, expected["plain"], conformance_plugin_name, f"tensor_parallel_size={tp}"
        )
