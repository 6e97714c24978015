"""WeightFormatConformance: a weight format's products, gathers and cuts against its own
dequantized values, and the refusals it owes.

For every tensor type the format takes (or the test class's :attr:`tensor_types`), the
suite loads random stored rows (:meth:`WeightFormatConformance.example_bytes`) and holds
every operation to the dense float64 computation over :meth:`WeightFormat.dequantize`:

- ``linear`` and ``expert_linear`` equal the dense product within float32 summation
  tolerance (at most ``4 * K * eps32`` of the sum of the terms' magnitudes), for batches of
  0, 1 and many rows and for expert groups of every size, empty ones included;
- ``embedding`` and cut weights dequantize to exactly the rows and slices of the whole;
- tensor-parallel shards (rows over 2 and 3 ranks, columns over 2 and 4 ranks on whole
  blocks) multiply to the matching columns (rows) and partial sums of the whole product;
- ``cat_rows`` and ``stack`` join exactly; joining different types or widths is refused;
- a column slice off the blocks and a row that is not a whole number of blocks are refused
  with :class:`~vlite.core.weight_format.WeightFormatError` naming the type and its block
  size; every weight reports ``nbytes``;
- where gguf-py knows the type, ``dequantize`` reads the bytes to exactly gguf-py's values;
- end to end: a tiny GGUF model of a type the format takes runs through the format (the
  quantization plan picks it) to the greedy tokens of its float32 path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from vlite.core.weight_format import QuantizedWeight, WeightFormat, WeightFormatError
from vlite.testing.conformance.base import PluginConformance

#: float32's machine epsilon.
EPS32 = torch.finfo(torch.float32).eps
#: Types the end-to-end test can write with gguf-py (which quantizes only some), in order
#: of preference.
WRITABLE_TYPES = ("Q8_0", "Q4_1", "Q4_0", "Q5_0", "Q5_1")


@functools.cache
def _gguf_quant_sizes() -> dict[str, tuple[int, int]]:
    """GGUF type name -> (values per block, bytes per block), from gguf-py."""
    import gguf

    return {kind.name: sizes for kind, sizes in gguf.GGML_QUANT_SIZES.items()}


def summation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far a float32 ``x @ weight^T`` may be from the float64 one: ``4 * K * eps32``
    times the sum of the terms' magnitudes (a little above 0 for exact zeros)."""
    magnitudes = x.double().abs() @ weight.double().abs().T
    return 4 * x.shape[-1] * EPS32 * magnitudes + 1e-30


def assert_product_close(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, what: str):
    """``out`` is ``x @ weight^T`` (float32 ``[M, N]``) within summation tolerance."""
    assert out.dtype == torch.float32, f"{what}: returned {out.dtype}, not float32"
    assert tuple(out.shape) == (x.shape[0], weight.shape[0]), f"{what}: shape {list(out.shape)}"
    expected = x.double() @ weight.double().T
    error = (out.double() - expected).abs()
    bound = summation_bound(x, weight)
    worst = int(torch.argmax(error - bound)) if error.numel() else 0
    assert bool((error <= bound).all()), (
        f"{what}: off by {error.flatten()[worst].item():.3g} where float32 sums allow "
        f"{bound.flatten()[worst].item():.3g} (element {worst})"
    )


class WeightFormatConformance(PluginConformance):
    """Conformance suite for ``register_weight_formats`` plugins.

    Attributes:
        tensor_types: the types to test (default: every type the format takes).
        rows: rows ``N`` of the test matrices (a multiple of 6: they split over 2 and 3 ranks).
        blocks_per_row: blocks per row (a multiple of 4: columns split over 2 and 4 ranks).
        batch_sizes: rows of ``x`` in the product tests (0 and 1 are always tried too).
        seed: the seed of the random bytes and activations.
    """

    plugin_kind = "weight_format"
    tensor_types: ClassVar[Sequence[str] | None] = None
    rows: ClassVar[int] = 24
    blocks_per_row: ClassVar[int] = 4
    batch_sizes: ClassVar[tuple[int, ...]] = (3, 17, 40)
    seed: ClassVar[int] = 0

    # ---- what to test with -----------------------------------------------------------

    def check_interface(self, plugin_cls: Any) -> None:
        assert issubclass(plugin_cls, WeightFormat), f"{plugin_cls!r} is not a WeightFormat"
        types = plugin_cls.tensor_types
        assert isinstance(types, frozenset) and types, "tensor_types must be a non-empty frozenset"
        assert all(isinstance(t, str) for t in types), f"tensor_types holds non-strings: {types}"

    @pytest.fixture(scope="class")
    @classmethod
    def weight_format(cls, plugin_cls: Any) -> WeightFormat:
        fmt = plugin_cls()
        reason = fmt.unavailable_reason(torch.device("cpu"))
        if reason is not None:
            pytest.skip(f"the format cannot run on this CPU: {reason}")
        return fmt

    @pytest.fixture(scope="class")
    @classmethod
    def types_under_test(cls, plugin_cls: Any) -> list[str]:
        types = sorted(plugin_cls.tensor_types if cls.tensor_types is None else cls.tensor_types)
        assert set(types) <= plugin_cls.tensor_types, (
            f"tensor_types {sorted(set(types) - plugin_cls.tensor_types)} are not taken by "
            f"{plugin_cls.__qualname__}"
        )
        return types

    def example_bytes(
        self, tensor_type: str, rows: int, cols: int, generator: torch.Generator
    ) -> torch.Tensor:
        """Stored bytes of a random ``[rows, cols]`` matrix of ``tensor_type``: ``uint8``
        ``[rows, row_bytes]``.

        Default: random bytes below ``0x3C`` in GGUF's layout of the type (gguf-py's block
        sizes): every float16/bfloat16 field they make is finite and below 1, so any GGUF
        type decodes to finite values. A format taking types gguf-py does not know
        overrides this."""
        sizes = _gguf_quant_sizes().get(tensor_type)
        if sizes is None:
            pytest.fail(
                f"the suite cannot write tensor type {tensor_type!r} (not a GGUF type); "
                "override example_bytes(tensor_type, rows, cols, generator)"
            )
        values, nbytes = sizes
        row_bytes = cols // values * nbytes
        return torch.randint(0, 0x3C, (rows, row_bytes), generator=generator, dtype=torch.uint8)

    def generator(self, salt: int = 0) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 7919 + salt)

    def matrix(
        self, fmt: WeightFormat, tensor_type: str, rows: int | None = None, salt: int = 0
    ) -> tuple[QuantizedWeight, torch.Tensor]:
        """``(weight, its dequantized float32 values)`` of a random ``[rows, K]`` matrix."""
        rows = self.rows if rows is None else rows
        cols = self.blocks_per_row * fmt.block_values(tensor_type)
        data = self.example_bytes(tensor_type, rows, cols, self.generator(salt))
        weight = fmt.load(tensor_type, data, (rows, cols))
        values = fmt.dequantize(weight)
        assert values.dtype == torch.float32 and tuple(values.shape) == (rows, cols), (
            f"{tensor_type}: dequantize gave {values.dtype} {list(values.shape)}, expected "
            f"float32 {[rows, cols]}"
        )
        assert bool(torch.isfinite(values).all()), f"{tensor_type}: non-finite values"
        return weight, values

    def activations(self, num_rows: int, cols: int, salt: int = 1) -> torch.Tensor:
        return torch.randn(num_rows, cols, generator=self.generator(salt))

    # ---- loading ---------------------------------------------------------------------

    def test_loads_report_their_shape_type_and_bytes(self, weight_format, types_under_test):
        for tensor_type in types_under_test:
            weight, _ = self.matrix(weight_format, tensor_type)
            cols = self.blocks_per_row * weight_format.block_values(tensor_type)
            assert isinstance(weight, QuantizedWeight), f"{tensor_type}: {weight!r}"
            assert tuple(weight.shape) == (self.rows, cols), f"{tensor_type}: {weight.shape}"
            assert weight.tensor_type == tensor_type
            assert isinstance(weight.format, type(weight_format))
            assert isinstance(weight.nbytes, int) and weight.nbytes > 0, (
                f"{tensor_type}: nbytes={weight.nbytes!r}"
            )

    def test_dequantize_reads_the_bytes_as_gguf_py_does(self, weight_format, types_under_test):
        import gguf
        import numpy as np

        checked = 0
        for tensor_type in types_under_test:
            kind = getattr(gguf.GGMLQuantizationType, tensor_type, None)
            if kind is None:
                continue
            cols = self.blocks_per_row * weight_format.block_values(tensor_type)
            data = self.example_bytes(tensor_type, self.rows, cols, self.generator())
            try:
                reference = gguf.quants.dequantize(data.numpy(), kind)
            except NotImplementedError:
                continue
            weight = weight_format.load(tensor_type, data, (self.rows, cols))
            values = weight_format.dequantize(weight)
            expected = torch.from_numpy(np.asarray(reference, dtype=np.float32))
            assert torch.equal(values, expected.reshape(values.shape)), (
                f"{tensor_type}: dequantized values differ from gguf-py's"
            )
            checked += 1
        if not checked:
            pytest.skip("gguf-py dequantizes none of the types under test")

    # ---- products --------------------------------------------------------------------

    def test_linear_equals_the_dense_product_of_the_dequantized_values(
        self, weight_format, types_under_test
    ):
        for tensor_type in types_under_test:
            weight, values = self.matrix(weight_format, tensor_type)
            for num_rows in (1, *self.batch_sizes):
                x = self.activations(num_rows, values.shape[1])
                out = weight_format.linear(weight, x)
                assert_product_close(out, x, values, f"{tensor_type} linear, {num_rows} rows")

    def test_empty_and_single_row_batches(self, weight_format, types_under_test):
        for tensor_type in types_under_test:
            weight, values = self.matrix(weight_format, tensor_type)
            empty = weight_format.linear(weight, torch.empty(0, values.shape[1]))
            assert tuple(empty.shape) == (0, self.rows) and empty.dtype == torch.float32, (
                f"{tensor_type}: a batch of 0 rows gave {empty.dtype} {list(empty.shape)}"
            )
            x = self.activations(5, values.shape[1])
            together = weight_format.linear(weight, x)
            for row in range(5):
                alone = weight_format.linear(weight, x[row : row + 1])
                assert_product_close(alone, x[row : row + 1], values, f"{tensor_type} row {row}")
                torch.testing.assert_close(alone[0], together[row], rtol=1e-5, atol=1e-5)
            rows = weight_format.embedding(weight, torch.empty(0, dtype=torch.int64))
            assert tuple(rows.shape) == (0, values.shape[1]), f"{tensor_type}: {rows.shape}"

    def test_embedding_gathers_exactly_the_dequantized_rows(self, weight_format, types_under_test):
        for tensor_type in types_under_test:
            weight, values = self.matrix(weight_format, tensor_type)
            ids = torch.tensor([3, 0, self.rows - 1, 3, 7], dtype=torch.int64)
            rows = weight_format.embedding(weight, ids)
            assert rows.dtype == torch.float32, f"{tensor_type}: {rows.dtype}"
            assert torch.equal(rows, values[ids]), f"{tensor_type}: gathered rows differ"

    def test_expert_linear_equals_each_experts_dense_product(self, weight_format, types_under_test):
        for tensor_type in types_under_test:
            experts = [self.matrix(weight_format, tensor_type, salt=10 + e) for e in range(3)]
            stacked = weight_format.stack([weight for weight, _ in experts])
            assert tuple(stacked.shape) == (3, *experts[0][1].shape), f"{stacked.shape}"
            assert torch.equal(
                weight_format.dequantize(stacked), torch.stack([v for _, v in experts])
            ), f"{tensor_type}: stacked experts dequantize differently"
            cols = experts[0][1].shape[1]
            for sizes in ([2, 0, 5], [0, 0, 0], [1, 1, 1], [0, 9, 0]):
                x = self.activations(sum(sizes), cols, salt=sum(sizes) + 2)
                out = weight_format.expert_linear(stacked, x, sizes)
                assert tuple(out.shape) == (sum(sizes), self.rows), f"{tensor_type}: {out.shape}"
                start = 0
                for expert, size in enumerate(sizes):
                    part = slice(start, start + size)
                    what = f"{tensor_type} expert {expert} of groups {sizes}"
                    assert_product_close(out[part], x[part], experts[expert][1], what)
                    start += size

    # ---- tensor parallelism ------------------------------------------------------------

    def test_row_shards_equal_the_rows_of_the_whole(self, weight_format, types_under_test):
        for tensor_type in types_under_test:
            weight, values = self.matrix(weight_format, tensor_type)
            x = self.activations(6, values.shape[1])
            for ranks in (2, 3):
                size = self.rows // ranks
                for rank in range(ranks):
                    shard = weight_format.narrow(weight, 0, rank * size, size)
                    rows = slice(rank * size, (rank + 1) * size)
                    assert tuple(shard.shape) == (size, values.shape[1])
                    assert torch.equal(weight_format.dequantize(shard), values[rows]), (
                        f"{tensor_type}: rows {rows} of {ranks} ranks differ"
                    )
                    what = f"{tensor_type} rows {rows.start}:{rows.stop}"
                    out = weight_format.linear(shard, x)
                    assert_product_close(out, x, values[rows], what)

    def test_column_shards_on_block_boundaries_equal_the_slices_of_the_whole(
        self, weight_format, types_under_test
    ):
        for tensor_type in types_under_test:
            weight, values = self.matrix(weight_format, tensor_type)
            cols = values.shape[1]
            x = self.activations(6, cols)
            for ranks in (2, 4):
                width = cols // ranks
                partial_sums = torch.zeros(6, self.rows, dtype=torch.float64)
                for rank in range(ranks):
                    part = slice(rank * width, (rank + 1) * width)
                    shard = weight_format.narrow(weight, 1, part.start, width)
                    assert tuple(shard.shape) == (self.rows, width)
                    assert torch.equal(weight_format.dequantize(shard), values[:, part]), (
                        f"{tensor_type}: columns {part.start}:{part.stop} of {ranks} ranks "
                        "differ from the whole's"
                    )
                    out = weight_format.linear(shard, x[:, part].contiguous())
                    what = f"{tensor_type} columns {part.start}:{part.stop}"
                    assert_product_close(out, x[:, part], values[:, part], what)
                    partial_sums += out.double()
                whole = x.double() @ values.double().T
                bound = summation_bound(x, values)
                assert bool(((partial_sums - whole).abs() <= bound).all()), (
                    f"{tensor_type}: the column shards' partial sums over {ranks} ranks do not "
                    "add up to the whole product"
                )

    def test_a_column_slice_off_the_blocks_is_refused_naming_the_type(
        self, weight_format, types_under_test
    ):
        tried = 0
        for tensor_type in types_under_test:
            values_per_block = weight_format.block_values(tensor_type)
            if values_per_block == 1:
                continue
            weight, _ = self.matrix(weight_format, tensor_type)
            for start, length in ((1, values_per_block), (0, values_per_block + 1)):
                with pytest.raises(WeightFormatError) as info:
                    weight_format.narrow(weight, 1, start, length)
                message = str(info.value)
                assert tensor_type in message and str(values_per_block) in message, (
                    f"{tensor_type}: the refusal does not name the type and its block size "
                    f"{values_per_block}: {message!r}"
                )
            tried += 1
        if not tried:
            pytest.skip("every type under test has 1-value blocks")

    def test_a_row_that_is_not_whole_blocks_is_refused_naming_the_type(
        self, weight_format, types_under_test
    ):
        tried = 0
        for tensor_type in types_under_test:
            values_per_block = weight_format.block_values(tensor_type)
            if values_per_block == 1:
                continue
            cols = self.blocks_per_row * values_per_block
            data = self.example_bytes(tensor_type, 4, cols, self.generator())
            with pytest.raises(WeightFormatError) as info:
                weight_format.load(tensor_type, data, (4, cols - 1))
            message = str(info.value)
            assert tensor_type in message and str(values_per_block) in message, (
                f"{tensor_type}: the refusal of {cols - 1} columns does not name the type and "
                f"its block size {values_per_block}: {message!r}"
            )
            tried += 1
        if not tried:
            pytest.skip("every type under test has 1-value blocks")

    # ---- joining -----------------------------------------------------------------------

    def test_cat_rows_joins_exactly_and_refuses_mixed_weights(
        self, weight_format, types_under_test
    ):
        for tensor_type in types_under_test:
            a, values_a = self.matrix(weight_format, tensor_type, rows=6, salt=3)
            b, values_b = self.matrix(weight_format, tensor_type, rows=12, salt=4)
            joined = weight_format.cat_rows([a, b])
            assert torch.equal(weight_format.dequantize(joined), torch.cat([values_a, values_b]))
            alone = weight_format.cat_rows([a])
            assert torch.equal(weight_format.dequantize(alone), values_a)
            with pytest.raises(WeightFormatError):
                weight_format.cat_rows([])
            narrow = weight_format.narrow(
                b, 1, 0, (self.blocks_per_row // 2) * weight_format.block_values(tensor_type)
            )
            with pytest.raises(WeightFormatError):
                weight_format.cat_rows([a, narrow])
        if len(types_under_test) > 1:
            first, second = types_under_test[:2]
            a, _ = self.matrix(weight_format, first)
            b, _ = self.matrix(weight_format, second)
            if a.shape == b.shape:
                with pytest.raises(WeightFormatError):
                    weight_format.cat_rows([a, b])

    def test_experts_narrow_to_the_stacks_experts(self, weight_format, types_under_test):
        for tensor_type in types_under_test:
            experts = [self.matrix(weight_format, tensor_type, salt=20 + e) for e in range(4)]
            stacked = weight_format.stack([weight for weight, _ in experts])
            local = weight_format.narrow(stacked, 0, 1, 2)
            assert tuple(local.shape) == (2, *experts[0][1].shape)
            expected = torch.stack([experts[1][1], experts[2][1]])
            assert torch.equal(weight_format.dequantize(local), expected), tensor_type

    # ---- end to end --------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_quantized_model(
        cls, types_under_test, weight_format, tmp_path_factory
    ) -> tuple[str, Path]:
        """``(type, a tiny GGUF model whose matrices are of that type)``."""
        writable = [t for t in WRITABLE_TYPES if t in types_under_test]
        if not writable:
            pytest.skip("the format takes no type the tiny GGUF writer can write")
        from vlite.testing.engine_runs import cached_tiny_model
        from vlite.testing.tiny_gguf import write_tiny_gguf

        tensor_type = writable[0]
        folder = cached_tiny_model("LlamaForCausalLM", num_kv_heads=2)
        path = tmp_path_factory.mktemp("weight-format") / f"tiny-{tensor_type}.gguf"
        return tensor_type, write_tiny_gguf(folder, path, quantize=(tensor_type, tensor_type))

    def test_greedy_tokens_of_a_tiny_model_equal_its_float32_path(
        self, tiny_quantized_model, conformance_plugin_name
    ):
        from vlite import LLM, SamplingParams
        from vlite.core.plugins import PluginRegistry

        tensor_type, path = tiny_quantized_model
        registry = PluginRegistry(self.build_plugin_manager())
        prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9], list(range(20, 60)), [3])]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        tokens = {}
        for quantization in ("auto", "none"):
            llm = LLM(
                model=str(path), quantization=quantization, registry=registry, num_kv_blocks=32
            )
            if quantization == "auto":
                chosen = llm.llm_engine.engine_core.quantization.format_names.get(tensor_type)
                if chosen != conformance_plugin_name:
                    pytest.skip(f"the plan keeps {tensor_type} in format {chosen!r} here")
            outputs = llm.generate(prompts, params, use_tqdm=False)
            tokens[quantization] = [output.outputs[0].token_ids for output in outputs]
        assert tokens["auto"] == tokens["none"]
