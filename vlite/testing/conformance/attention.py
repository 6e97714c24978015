"""AttentionBackendConformance: paged attention that matches dense attention, end to end.

Stated tolerances (``torch.testing.assert_close`` of the backend's output against dense
float64 attention of the same rounded inputs): float32 ``atol = rtol = 1e-4``, bfloat16
``3e-2``, float16 ``1e-2``. A suite subclass may loosen them, and says so in its code.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest
import torch

from vlite.core.attention import AttentionBackend
from vlite.testing.attention_cases import (
    AttentionShape,
    StepResult,
    boundary_batch,
    decode_batch,
    random_batch,
    run_case,
    run_draft_case,
    run_replay_case,
)
from vlite.testing.conformance.base import PluginConformance
from vlite.testing.engine_runs import cached_tiny_model, generate_tokens, mixed_prompts

#: (atol, rtol) per dtype.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (1e-2, 1e-2),
}


class AttentionBackendConformance(PluginConformance):
    """Conformance suite for ``register_attention_backends`` plugins.

    Capability flags and limits (class attributes of the backend, see
    :class:`~vlite.core.attention.AttentionBackend`): ``supports_prefix_caching``,
    ``supports_sliding_window``, ``supports_logits_soft_cap``, ``supports_cuda_graphs``,
    ``kv_cache_dtypes``, ``supported_dtypes``, ``supported_head_dims``,
    ``supported_block_sizes``; shapes outside
    the backend's limits are skipped.

    Attributes:
        head_dims, gqa_ratios, block_sizes: the shapes tried (see :meth:`attention_shapes`),
            with two KV heads and ``gqa_ratio`` query heads per KV head.
        all_shape_combinations: try every combination of the three, not just every pair.
        tolerances: ``{dtype: (atol, rtol)}``.
        device: where tensors live (``"cpu"``; ``"cuda"`` for a GPU-only backend).
        reference_backend: whose greedy tokens the end-to-end check compares with.
    """

    plugin_kind = "attention_backend"
    reference_backend: ClassVar[str] = "torch"
    head_dims: ClassVar[tuple[int, ...]] = (32, 64, 128)
    gqa_ratios: ClassVar[tuple[int, ...]] = (1, 2, 4)
    block_sizes: ClassVar[tuple[int, ...]] = (16, 32)
    all_shape_combinations: ClassVar[bool] = False
    tolerances: ClassVar[dict[torch.dtype, tuple[float, float]]] = DEFAULT_TOLERANCES
    device: ClassVar[str] = "cpu"
    capability_defaults: ClassVar[dict[str, bool]] = {
        "supports_prefix_caching": True,
        "supports_sliding_window": False,
        "supports_logits_soft_cap": False,
        "supports_cuda_graphs": False,
    }
    supports_prefix_caching: ClassVar[bool | None] = None
    supports_sliding_window: ClassVar[bool | None] = None
    supports_logits_soft_cap: ClassVar[bool | None] = None
    supports_cuda_graphs: ClassVar[bool | None] = None

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "attention_shape" in metafunc.fixturenames:
            metafunc.parametrize("attention_shape", self.attention_shapes(), ids=str)

    @classmethod
    def attention_shapes(cls) -> list[AttentionShape]:
        """Every ``head_dim x gqa_ratio`` pair, with the block sizes taking turns.

        With the default values every pair of values (head dim and ratio, head dim and
        block size, ratio and block size) occurs; ``all_shape_combinations`` tries every
        triple instead.
        """
        pairs = [(head_dim, ratio) for head_dim in cls.head_dims for ratio in cls.gqa_ratios]
        if cls.all_shape_combinations:
            return [AttentionShape(h, r, b) for h, r in pairs for b in cls.block_sizes]
        sizes = cls.block_sizes
        return [AttentionShape(h, r, sizes[i % len(sizes)]) for i, (h, r) in enumerate(pairs)]

    def check_interface(self, plugin_cls: Any) -> None:
        assert isinstance(plugin_cls, type) and issubclass(plugin_cls, AttentionBackend), (
            f"{plugin_cls!r} must subclass vlite.core.attention.AttentionBackend"
        )
        head_dim = (getattr(plugin_cls, "supported_head_dims", None) or (64,))[0]
        block_size = (getattr(plugin_cls, "supported_block_sizes", None) or (16,))[0]
        backend = plugin_cls(4, 2, head_dim, head_dim**-0.5, block_size)
        one, two = backend.kv_cache_shape(1), backend.kv_cache_shape(2)
        assert torch.Size(two).numel() == 2 * torch.Size(one).numel(), (
            "kv_cache_shape(num_blocks) must grow linearly with num_blocks"
        )
        assert torch.float32 in plugin_cls.supported_dtypes

    # ---- helpers -----------------------------------------------------------------------

    def make_backend(self, plugin_cls: Any, shape: AttentionShape) -> AttentionBackend:
        """The backend for ``shape``; skips shapes outside the backend's declared limits."""
        head_dims = getattr(plugin_cls, "supported_head_dims", None)
        if head_dims is not None and shape.head_dim not in head_dims:
            pytest.skip(f"head_dim {shape.head_dim} is not in supported_head_dims")
        block_sizes = getattr(plugin_cls, "supported_block_sizes", None)
        if block_sizes is not None and shape.block_size not in block_sizes:
            pytest.skip(f"block_size {shape.block_size} is not in supported_block_sizes")
        return plugin_cls(
            shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale, shape.block_size
        )

    def check_case(
        self,
        backend: AttentionBackend,
        shape: AttentionShape,
        batch: list[tuple[int, int]],
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        results = run_case(
            backend,
            shape,
            batch,
            dtype,
            seed,
            self.device,
            sliding_window,
            soft_cap,
            cache_dtype=cache_dtype,
        )
        self.check_results(results, shape, dtype)

    def check_results(
        self, results: list[StepResult], shape: AttentionShape, dtype: torch.dtype
    ) -> None:
        """Each step's output has the reference's shape and ``dtype`` and is within the
        dtype's tolerance of it."""
        atol, rtol = self.tolerances[dtype]
        for result in results:
            assert result.output.shape == result.expected.shape, (
                f"{result.step} step: output shape {tuple(result.output.shape)}, "
                f"expected {tuple(result.expected.shape)}"
            )
            assert result.output.dtype == dtype
            torch.testing.assert_close(
                result.output.double(),
                result.expected,
                atol=atol,
                rtol=rtol,
                msg=lambda m, r=result: (
                    f"{shape}, {r.step} step of (num_cached, num_new) batch {r.batch}: {m}"
                ),
            )

    # ---- against dense attention -------------------------------------------------------

    def test_matches_dense_attention_around_block_boundaries(
        self, plugin_cls, attention_shape
    ) -> None:
        backend = self.make_backend(plugin_cls, attention_shape)
        cached_prefill = self.claims(plugin_cls, "supports_prefix_caching")
        self.check_case(
            backend, attention_shape, boundary_batch(attention_shape.block_size, cached_prefill)
        )

    def test_matches_dense_attention_on_random_batches(self, plugin_cls, attention_shape) -> None:
        backend = self.make_backend(plugin_cls, attention_shape)
        cached_prefill = self.claims(plugin_cls, "supports_prefix_caching")
        rng = random.Random(str(attention_shape))
        batch = random_batch(rng, attention_shape.block_size, cached_prefill)
        self.check_case(backend, attention_shape, batch, seed=rng.randrange(1 << 16))

    def test_matches_dense_attention_decoding_only(self, plugin_cls) -> None:
        shape = AttentionShape(self.head_dims[0], self.gqa_ratios[-1], self.block_sizes[0])
        backend = self.make_backend(plugin_cls, shape)
        self.check_case(backend, shape, decode_batch(shape.block_size))

    def test_draft_positions_as_one_token_sequences_over_one_block_table(self, plugin_cls) -> None:
        """A step verifying draft tokens (speculative decoding): one-token sequences that
        share a block table, each seeing the keys the step writes before it."""
        shape = AttentionShape(self.head_dims[0], self.gqa_ratios[-1], self.block_sizes[0])
        backend = self.make_backend(plugin_cls, shape)
        bs = shape.block_size
        for context, num_drafts in [(3, 4), (bs - 2, 5), (2 * bs + 1, 1)]:
            results = run_draft_case(backend, shape, context, num_drafts, device=self.device)
            self.check_results(results, shape, torch.float32)

    def test_uses_the_given_scale(self, plugin_cls) -> None:
        """The softmax scale the backend is built with, not ``head_dim ** -0.5`` (models set
        their own, e.g. Gemma's ``query_pre_attn_scalar``)."""
        shape = AttentionShape(
            self.head_dims[0], self.gqa_ratios[-1], self.block_sizes[0], softmax_scale=0.3
        )
        backend = self.make_backend(plugin_cls, shape)
        cached_prefill = self.claims(plugin_cls, "supports_prefix_caching")
        self.check_case(backend, shape, boundary_batch(shape.block_size, cached_prefill))

    def test_cached_prefix_prefill(self, plugin_cls) -> None:
        """Several new tokens after a cached prefix of whole blocks (prefix-cache hits)."""
        self.require(plugin_cls, "supports_prefix_caching")
        shape = AttentionShape(self.head_dims[0], self.gqa_ratios[-1], self.block_sizes[0])
        backend = self.make_backend(plugin_cls, shape)
        bs = shape.block_size
        self.check_case(backend, shape, [(bs, 3), (2 * bs, bs + 1), (3 * bs, 2 * bs)])

    @pytest.mark.parametrize("window", ["1", "block-1", "block+3", "3blocks"])
    def test_sliding_window_matches_dense_attention(self, plugin_cls, window) -> None:
        """A windowed layer sees only its last ``window`` keys, and never reads blocks wholly
        before its first query's window (they are refilled with garbage before each step)."""
        self.require(plugin_cls, "supports_sliding_window")
        shape = AttentionShape(self.head_dims[0], self.gqa_ratios[-1], self.block_sizes[0])
        backend = self.make_backend(plugin_cls, shape)
        bs = shape.block_size
        size = {"1": 1, "block-1": bs - 1, "block+3": bs + 3, "3blocks": 3 * bs}[window]
        cached_prefill = self.claims(plugin_cls, "supports_prefix_caching")
        batch = boundary_batch(bs, cached_prefill) + [(4 * bs + 2, 1), (0, 5 * bs + 1)]
        if cached_prefill:
            batch.append((4 * bs - 1, 2 * bs))
        self.check_case(backend, shape, batch, sliding_window=size)

    @pytest.mark.parametrize("window", [None, 5])
    def test_logits_soft_cap_matches_dense_attention(self, plugin_cls, window) -> None:
        """Scores capped at ``cap * tanh(score / cap)`` (a cap of 2 bites on these random
        scores), alone and with a sliding window (Gemma 2's local layers)."""
        self.require(plugin_cls, "supports_logits_soft_cap")
        if window is not None:
            self.require(plugin_cls, "supports_sliding_window")
        shape = AttentionShape(
            self.head_dims[0], self.gqa_ratios[-1], self.block_sizes[0], softmax_scale=1.0
        )
        backend = self.make_backend(plugin_cls, shape)
        cached_prefill = self.claims(plugin_cls, "supports_prefix_caching")
        batch = boundary_batch(shape.block_size, cached_prefill)
        self.check_case(backend, shape, batch, sliding_window=window, soft_cap=2.0)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
    def test_low_precision_matches_within_tolerance(self, plugin_cls, dtype) -> None:
        if dtype not in plugin_cls.supported_dtypes:
            pytest.skip(f"{dtype} is not in supported_dtypes")
        shape = AttentionShape(self.head_dims[0], self.gqa_ratios[-1], self.block_sizes[0])
        backend = self.make_backend(plugin_cls, shape)
        cached_prefill = self.claims(plugin_cls, "supports_prefix_caching")
        self.check_case(backend, shape, boundary_batch(shape.block_size, cached_prefill), dtype)

    def test_kv_cache_dtypes_match_attention_over_the_rounded_keys(self, plugin_cls) -> None:
        """Each cache dtype in ``kv_cache_dtypes`` holds the keys and values rounded to it,
        and attention over them matches the reference fed the same rounded keys and values
        (prefill, prefix hits, decodes; with a window and a soft cap where claimed)."""
        claimed = [d for d in plugin_cls.kv_cache_dtypes if d != torch.float32]
        if not claimed:
            pytest.skip("the backend takes no other KV-cache dtype than the model's")
        shape = AttentionShape(self.head_dims[0], self.gqa_ratios[-1], self.block_sizes[0])
        backend = self.make_backend(plugin_cls, shape)
        cached_prefill = self.claims(plugin_cls, "supports_prefix_caching")
        batch = boundary_batch(shape.block_size, cached_prefill)
        options: list[dict[str, Any]] = [{}]
        if self.claims(plugin_cls, "supports_sliding_window"):
            options.append({"sliding_window": shape.block_size + 3})
        if self.claims(plugin_cls, "supports_logits_soft_cap"):
            options.append({"soft_cap": 2.0})
        for cache_dtype in claimed:
            for layer_options in options:
                self.check_case(backend, shape, batch, cache_dtype=cache_dtype, **layer_options)

    def test_decode_replays_over_rewritten_metadata(self, plugin_cls) -> None:
        """A backend claiming ``supports_cuda_graphs`` computes every decode step right
        through one metadata object rewritten in place (padded rows, capture-time bounds
        as host ints), as a captured graph replays it."""
        self.require(plugin_cls, "supports_cuda_graphs")
        shape = AttentionShape(self.head_dims[0], self.gqa_ratios[-1], self.block_sizes[0])
        backend = self.make_backend(plugin_cls, shape)
        bs = shape.block_size
        steps = [[5, 3 * bs + 2, bs + 1], [bs], [2, 4 * bs + 1, bs, 9]]
        results = run_replay_case(backend, shape, steps, capacity=4, device=self.device)
        self.check_results(results, shape, torch.float32)

    # ---- end to end --------------------------------------------------------------------

    def engine_block_size(self, plugin_cls: Any) -> int:
        supported = getattr(plugin_cls, "supported_block_sizes", None)
        return 16 if supported is None or 16 in supported else min(supported)

    def test_greedy_tokens_equal_the_reference_backend(
        self, plugin_cls, plugin_registry, conformance_plugin_name
    ) -> None:
        from vlite.engine.llm import LLM

        head_dims = getattr(plugin_cls, "supported_head_dims", None)
        head_dim = 32 if head_dims is None or 32 in head_dims else min(head_dims)
        model = str(cached_tiny_model("LlamaForCausalLM", head_dim=head_dim))
        block_size = self.engine_block_size(plugin_cls)
        prefix_caching = self.claims(plugin_cls, "supports_prefix_caching")
        # Prompts cross block boundaries, decodes cross one more, and the second round hits
        # the prefix cache the first round filled.
        cases = mixed_prompts(
            num_prompts=5,
            max_prompt_len=3 * block_size,
            shared_prefix_len=2 * block_size + 1,
            max_tokens=(block_size // 2, block_size + 2),
        )
        rounds = [cases, cases]
        tokens = {}
        for backend_name in (self.reference_backend, conformance_plugin_name):
            llm = LLM(
                model=model,
                registry=plugin_registry,
                attention_backend=backend_name,
                block_size=block_size,
                enable_prefix_caching=prefix_caching,
                num_kv_blocks=64,
                device=self.device,
                dtype="float32",
            )
            tokens[backend_name] = [generate_tokens(llm, cases) for cases in rounds]
            if backend_name == conformance_plugin_name and prefix_caching:
                kv_cache = llm.llm_engine.engine_core.kv_cache_manager
                assert kv_cache.num_prefix_hit_tokens > 0, "the run never hit the prefix cache"
        assert tokens[conformance_plugin_name] == tokens[self.reference_backend], (
            f"greedy tokens with attention backend {conformance_plugin_name!r} differ from "
            f"{self.reference_backend!r}'s"
        )
