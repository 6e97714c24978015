"""Build-on-first-use CPU kernels: C files compiled by the machine's C compiler.

``gguf_blocks.c`` (next to this file) multiplies float32 activations by GGUF
block-quantized weights (every type of :data:`BLOCK_LAYOUTS`: the legacy 32-value types, the
K-quants, IQ4, F16/BF16) without dequantizing them to memory;
``fused_ops.c`` does a decoder layer's small elementwise steps (residual add + RMSNorm,
rotary embedding) in one call each; ``paged_attention.c`` writes a step's keys/values
into the paged cache and attends straight from its blocks. Each file is compiled once per
machine with ``cc -O3 -march=native -fopenmp -ffp-contract=off`` (about a second) into
``~/.cache/vlite/kernels/`` (``$VLITE_CACHE_DIR/kernels`` when set; see
:mod:`vlite.kernels.build` for the key, the lock and the fallback directory), and loaded
with :mod:`ctypes`. The library names ``libgomp.so.1``, which PyTorch has already loaded,
so its OpenMP threads are PyTorch's. A cached library that does not load is built again,
once.

No compiler, or a failed build, raises :class:`NativeKernelsUnavailable` naming the step
that failed; callers fall back to dequantized weights and say so.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from vlite.kernels.build import (  # noqa: F401  (re-exported: the kernels' public names)
    FLAGS,
    NativeKernelsUnavailable,
    build_library,
    cache_dir,
    rebuild_library,
)

SOURCE = Path(__file__).with_name("gguf_blocks.c")
FUSED_OPS_SOURCE = Path(__file__).with_name("fused_ops.c")
PAGED_ATTENTION_SOURCE = Path(__file__).with_name("paged_attention.c")


@dataclass(frozen=True)
class BlockLayout:
    """How one GGUF tensor type stores a row: ``cols / values`` blocks of ``nbytes`` each.

    Attributes:
        code: the type's id in the C functions (their ``qtype`` argument).
        values: values per block (32; 256 for the K-quants and IQ4_XS). A row's length,
            and a column slice's start and length, must be multiples of it.
        nbytes: bytes per block.
    """

    code: int
    values: int
    nbytes: int


#: Every GGUF type the kernels multiply by without dequantizing, and its block layout (the
#: codes are ``gguf_blocks.c``'s). F16 and BF16 are read 32 values at a time.
BLOCK_LAYOUTS: dict[str, BlockLayout] = {
    "Q4_0": BlockLayout(0, 32, 18),
    "Q4_1": BlockLayout(1, 32, 20),
    "Q8_0": BlockLayout(2, 32, 34),
    "Q5_0": BlockLayout(3, 32, 22),
    "Q5_1": BlockLayout(4, 32, 24),
    "IQ4_NL": BlockLayout(5, 32, 18),
    "F16": BlockLayout(6, 32, 64),
    "BF16": BlockLayout(7, 32, 64),
    "Q2_K": BlockLayout(8, 256, 84),
    "Q3_K": BlockLayout(9, 256, 110),
    "Q4_K": BlockLayout(10, 256, 144),
    "Q5_K": BlockLayout(11, 256, 176),
    "Q6_K": BlockLayout(12, 256, 210),
    "IQ4_XS": BlockLayout(13, 256, 136),
}
#: Rows of x from which a product of a type without a GEMM of its own (``vl_has_gemm``)
#: decodes the weight in panels and multiplies densely.
GEMM_ROWS = 32
#: Rows of x below which a 256-value type (the K-quants, IQ4_XS) with quantized activations
#: keeps its integer tiles rather than the panels: they stay faster up to about here (int16,
#: 4096 x 2048, AVX-512 EPYC, 2 threads: 2-2.8x the panels at 64 rows, 1.4-1.8x at 128,
#: about even at 256; the 32-value types are even at 64 rows).
QUANTIZED_ROWS_256 = 128
#: The same for the 32-value types in a build without the int16 GEMM (AVX2): their int16
#: tiles beat the float32 panels up to about here (AMD EPYC without AVX-512, 2 threads:
#: 1.37x at 32 rows, 1.08-1.3x at 64 on 576 x 1536, 1536 x 576 and 2048 x 2048, about even
#: at 96-128). Builds with the GEMM keep :data:`GEMM_ROWS` for int8 activations.
QUANTIZED_ROWS_32 = 64

#: ``GGUFBlockKernels.product``'s ``activations``: the bits they are quantized to (0: kept
#: float32).
ACTIVATION_BITS = {"float32": 0, "int8": 8, "int16": 16}
#: The size of one such decoded float32 panel.
PANEL_BYTES = 8 << 20
#: Kernel id of each GGUF block type (the ``qtype`` argument of the C functions).
BLOCK_TYPES = {name: layout.code for name, layout in BLOCK_LAYOUTS.items()}
#: Bytes per block.
BLOCK_BYTES = {name: layout.nbytes for name, layout in BLOCK_LAYOUTS.items()}


class _ThreadCount:
    """Stands for ``torch.get_num_threads()`` in a recorded call's arguments: read when the
    call runs, and again at every replay (the thread count may change between steps)."""

    def __repr__(self) -> str:
        return "THREADS"


#: Pass as a C function's thread-count argument (see :func:`recording`).
THREADS = _ThreadCount()

#: The calls being recorded (:func:`recording`), or ``None``.
_recorded: list[RecordedCall] | None = None
#: Whether recorded calls run (:func:`recording`).
_executing = True


@dataclass(frozen=True)
class RecordedCall:
    """One C call of a recorded forward: ``function(*args)``, with :data:`THREADS` at
    ``threads_at`` (``None``: no thread-count argument). A nonzero result is an error."""

    function: Callable[..., int | None]
    args: tuple
    threads_at: int | None

    def __call__(self, threads: int) -> None:
        args = self.args
        if self.threads_at is not None:
            args = args[: self.threads_at] + (threads,) + args[self.threads_at + 1 :]
        if self.function(*args):
            raise RuntimeError(f"{self.function.__name__} failed on replay")


@contextlib.contextmanager
def recording(execute: bool = True) -> Iterator[list[RecordedCall]]:
    """Record every C call the kernels make inside the block, in order; they run too, unless
    ``execute`` is false (each then returns 0, success: for a caller whose control flow
    cannot depend on the kernels' results, as a recorded forward's cannot).

    The list can be replayed (:class:`RecordedCall`) as long as every pointer it holds
    stays valid: the caller keeps the tensors alive and rewrites inputs in place.
    """
    global _recorded, _executing
    if _recorded is not None:
        raise RuntimeError("the kernels are already being recorded")
    calls: list[RecordedCall] = []
    _recorded, _executing = calls, execute
    try:
        yield calls
    finally:
        _recorded, _executing = None, True


def _call(function: Callable[..., int | None], *args) -> int | None:
    """``function(*args)`` with :data:`THREADS` resolved, recorded when recording."""
    try:
        threads_at: int | None = args.index(THREADS)
    except ValueError:
        threads_at = None
    if _recorded is not None:
        _recorded.append(RecordedCall(function, args, threads_at))
        if not _executing:
            return 0
    if threads_at is not None:
        args = args[:threads_at] + (torch.get_num_threads(),) + args[threads_at + 1 :]
    return function(*args)


class GGUFBlockKernels:
    """The loaded library: products, dequantization and row gathers over GGUF blocks.

    Every ``blocks`` argument is a contiguous ``uint8`` tensor ``[N, K / 32 * block_bytes]``:
    row ``n`` of a ``[N, K]`` matrix as the file stores it.
    """

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.vl_matmul.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr, i32]
        lib.vl_dequantize.argtypes = [i32, ptr, i64, i64, ptr, i32]
        lib.vl_gather_rows.argtypes = [i32, ptr, i64, i64, ptr, i64, ptr]
        lib.vl_gather_rows.restype = i32
        for function in (lib.vl_matmul, lib.vl_dequantize):
            function.restype = None
        lib.vl_has_gemm.argtypes = [i32]
        lib.vl_has_gemm.restype = i32
        lib.vl_has_quantized_activations.argtypes = [i32]
        lib.vl_has_quantized_activations.restype = i32
        lib.vl_matmul_quantized.argtypes = [i32, i32, ptr, i64, i64, ptr, i64, ptr, i32]
        lib.vl_matmul_quantized.restype = i32
        lib.vl_int16_gemm_rows.argtypes = [i32]
        lib.vl_int16_gemm_rows.restype = i32
        lib.vl_int16_matches_gemm.argtypes = [i32]
        lib.vl_int16_matches_gemm.restype = i32
        self._lib = lib
        self.path = path

    def has_gemm(self, qtype: str) -> bool:
        """Whether the library multiplies many rows (>= :data:`GEMM_ROWS`) of ``qtype`` by a
        blocked GEMM of its own; otherwise :meth:`product` decodes the weight in panels and
        multiplies them densely (PyTorch's GEMM), which is faster there."""
        return bool(self._lib.vl_has_gemm(BLOCK_TYPES[qtype]))

    def quantized_rows(self, qtype: str) -> int:
        """Products of fewer rows of ``qtype`` than this take quantized activations (when
        asked for and :meth:`has_quantized_activations`): :data:`QUANTIZED_ROWS_256` for
        the 256-value types; for the others :data:`GEMM_ROWS` in a build with the int16
        GEMM, :data:`QUANTIZED_ROWS_32` without it."""
        if BLOCK_LAYOUTS[qtype].values == 256:
            return QUANTIZED_ROWS_256
        return GEMM_ROWS if self.int16_gemm_rows(qtype) else QUANTIZED_ROWS_32

    def int16_gemm_rows(self, qtype: str) -> int:
        """Rows from which products of ``qtype`` with int16 activations run as the library's
        int16 GEMM (``int16_gemm.h``: AVX-512 VNNI; 12), rather than the tiles; 0 where the
        library has none, so those products keep the tiles up to :meth:`quantized_rows` and
        the float32 panels beyond. A row's bits do not depend on the batch on either side of
        it; across it they do unless :meth:`int16_matches_gemm`."""
        return int(self._lib.vl_int16_gemm_rows(BLOCK_TYPES[qtype]))

    def int16_matches_gemm(self, qtype: str) -> bool:
        """Whether int16 products of ``qtype`` below :meth:`int16_gemm_rows` compute as the
        GEMM does (the 32-value types: their tiles for one row, the row-lane tiles of
        ``row_lanes.h`` for more), so a row of x gets the same bits in a batch of any size."""
        return bool(self._lib.vl_int16_matches_gemm(BLOCK_TYPES[qtype]))

    def has_quantized_activations(self, qtype: str) -> bool:
        """Whether :meth:`product` can multiply ``qtype`` by integer-quantized activations
        (AVX2 builds: every quantized type; not F16/BF16)."""
        return bool(self._lib.vl_has_quantized_activations(BLOCK_TYPES[qtype]))

    def matmul(
        self,
        qtype: str,
        x: torch.Tensor,
        blocks: torch.Tensor,
        out_features: int,
        activations: str = "float32",
    ):
        """``x`` ``[M, K]`` float32 @ ``W^T`` -> ``[M, out_features]`` float32."""
        return self.product(qtype, blocks, out_features, x.shape[-1], activations)(x)

    def product(
        self,
        qtype: str,
        blocks: torch.Tensor,
        out_features: int,
        in_features: int,
        activations: str = "float32",
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x -> x @ W^T`` for one weight matrix, checked once here rather than per call
        (a decode step multiplies by every matrix; each check costs microseconds).

        The function holds ``blocks`` and checks each ``x``: float32 CPU ``[M, K]``. With
        ``activations`` ``"int8"`` or ``"int16"`` (and :meth:`has_quantized_activations`),
        products of fewer than :meth:`quantized_rows` rows quantize each row of ``x`` per 32
        values to int8 (llama.cpp's precision) or int16 (about 15 bits) and use integer dot
        products (``quantized_activations.h``), and with ``"int16"`` every product does
        where the library has :meth:`int16_gemm_rows` (its GEMM beyond them, about twice the
        float32 panels' speed); ``"float32"``: float32 activations. The file's weight values
        either way.
        """
        _check_blocks(qtype, blocks, out_features, in_features)
        code = BLOCK_TYPES[qtype]
        exact = functools.partial(_call, self._lib.vl_matmul, code)
        quantized, quantized_rows = exact, self._quantized_rows_of(qtype, activations)
        if quantized_rows:
            bits = ACTIVATION_BITS[activations]
            quantized = functools.partial(_call, self._lib.vl_matmul_quantized, code, bits)
        panel_rows = self.panel_rows(qtype, activations)
        many_rows = None if panel_rows == sys.maxsize else self._panel_product(qtype, blocks)

        def product(x: torch.Tensor) -> torch.Tensor:
            if (
                x.dtype != torch.float32
                or x.device.type != "cpu"
                or x.dim() != 2
                or x.shape[1] != in_features
            ):
                raise ValueError(
                    f"expected a CPU float32 [M, {in_features}] input, got {x.device.type} "
                    f"{x.dtype} {list(x.shape)}"
                )
            x = x.contiguous()
            num_rows = x.shape[0]
            if many_rows is not None and num_rows >= panel_rows:
                return many_rows(x)
            out = torch.empty(num_rows, out_features, dtype=torch.float32)
            call = quantized if num_rows < quantized_rows else exact
            failed = call(x.data_ptr(), x.shape[0], in_features, blocks.data_ptr(),
                          out_features, out.data_ptr(), THREADS)  # fmt: skip
            if failed:
                raise MemoryError(f"no scratch memory for a {qtype} product's {activations}")
            return out

        return product

    def _quantized_rows_of(self, qtype: str, activations: str) -> int:
        """Rows below which :meth:`product` quantizes the activations (0: never;
        ``sys.maxsize``: always, the library's int16 GEMM taking the many rows)."""
        if activations not in ACTIVATION_BITS:
            raise ValueError(f"activations={activations!r}; allowed: {', '.join(ACTIVATION_BITS)}")
        if not (ACTIVATION_BITS[activations] and self.has_quantized_activations(qtype)):
            return 0
        if ACTIVATION_BITS[activations] == 16 and self.int16_gemm_rows(qtype):
            return sys.maxsize
        return self.quantized_rows(qtype)

    def panel_rows(self, qtype: str, activations: str = "float32") -> int:
        """Rows from which :meth:`product` of ``qtype`` decodes the weight into float32
        panels for PyTorch's GEMM (``sys.maxsize``: never, the library multiplies any
        number of rows itself). A forward whose products all stay in the library can be
        recorded for replay (:mod:`vlite.worker.cpu_graphs`) at that many rows."""
        quantized_rows = self._quantized_rows_of(qtype, activations)
        if self.has_gemm(qtype) or quantized_rows == sys.maxsize:
            return sys.maxsize
        return max(GEMM_ROWS, quantized_rows)

    def _panel_product(
        self, qtype: str, blocks: torch.Tensor
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x [M, K] -> x @ W^T`` for many rows: W decoded :data:`PANEL_BYTES` at a time
        (exactly the file's values) into a float32 panel, multiplied by PyTorch's GEMM."""
        in_features = blocks.shape[1] // BLOCK_LAYOUTS[qtype].nbytes * BLOCK_LAYOUTS[qtype].values
        out_features = blocks.shape[0]
        panel_rows = max(1, min(out_features, PANEL_BYTES // (4 * in_features)))

        def product(x: torch.Tensor) -> torch.Tensor:
            out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
            panel = torch.empty(panel_rows, in_features, dtype=torch.float32)
            for start in range(0, out_features, panel_rows):
                rows = min(panel_rows, out_features - start)
                weights = panel[:rows]
                _call(
                    self._lib.vl_dequantize,
                    BLOCK_TYPES[qtype],
                    blocks[start].data_ptr(),
                    rows,
                    in_features,
                    weights.data_ptr(),
                    THREADS,
                )
                if rows == out_features:
                    torch.mm(x, weights.t(), out=out)
                else:
                    out[:, start : start + rows] = x @ weights.t()
            return out

        return product

    def dequantize(self, qtype: str, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
        """The whole matrix ``[N, in_features]`` as float32."""
        _check_blocks(qtype, blocks, blocks.shape[0], in_features)
        out = torch.empty(blocks.shape[0], in_features, dtype=torch.float32)
        _call(
            self._lib.vl_dequantize,
            BLOCK_TYPES[qtype],
            blocks.data_ptr(),
            blocks.shape[0],
            in_features,
            out.data_ptr(),
            THREADS,
        )
        return out

    def gather_rows(
        self, qtype: str, blocks: torch.Tensor, in_features: int, row_ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows ``row_ids`` ``[T]`` (int64) of the matrix as ``[T, in_features]`` float32."""
        row_ids = row_ids.contiguous()
        _require(row_ids, dtype=torch.int64)
        _check_blocks(qtype, blocks, blocks.shape[0], in_features)
        out = torch.empty(row_ids.numel(), in_features, dtype=torch.float32)
        status = _call(
            self._lib.vl_gather_rows,
            BLOCK_TYPES[qtype],
            blocks.data_ptr(),
            len(blocks),
            in_features,
            row_ids.data_ptr(),
            row_ids.numel(),
            out.data_ptr(),
        )
        if status:  # checked in C, so a replayed lookup checks its ids too
            raise IndexError(f"row ids out of range for a matrix of {len(blocks)} rows")
        return out


class FusedOps:
    """Fused elementwise steps on contiguous float32 CPU tensors (see ``fused_ops.c``)."""

    #: RoPE turns whole heads only (a partial rotary model keeps PyTorch's ops).
    rotates_partial_heads = False
    #: ``add_rmsnorm`` takes ``[T, H]`` only.
    norms_any_rank = False

    @staticmethod
    def handles(dtype: torch.dtype, device: torch.device) -> bool:
        """Whether tensors of ``dtype`` on ``device`` run here (float32 on the CPU)."""
        return dtype == torch.float32 and device.type == "cpu"

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        lib.vl_add_rmsnorm.argtypes = [ptr, ptr, ptr, i64, i64, f32, ptr]
        lib.vl_rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr]
        lib.vl_silu_mul.argtypes = [ptr, i64, i64, ptr]
        lib.vl_copy_columns.argtypes = [ptr, i64, i64, ptr, i64]
        lib.vl_rmsnorm_heads.argtypes = [ptr, i64, i64, i64, i64, ptr, f32]
        lib.vl_scale.argtypes = [ptr, i64, f32]
        lib.vl_gelu_tanh_mul.argtypes = [ptr, i64, i64, ptr]
        returning_nothing = ("vl_add_rmsnorm", "vl_rope", "vl_silu_mul", "vl_copy_columns")
        for name in (*returning_nothing, "vl_rmsnorm_heads", "vl_scale", "vl_gelu_tanh_mul"):
            getattr(lib, name).restype = None
        self._lib = lib

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += x`` (if given), then RMSNorm of the sum (or of ``x``) times ``weight``.

        ``x``, ``residual``: ``[T, H]`` contiguous; returns a new ``[T, H]`` tensor.
        """
        num_tokens, hidden = x.shape
        out = torch.empty_like(x)
        _call(
            self._lib.vl_add_rmsnorm,
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            num_tokens,
            hidden,
            eps,
            out.data_ptr(),
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up`` of the fused product ``gate_up`` ``[T, 2 * I]``
        (gate first, contiguous float32) -> ``[T, I]``."""
        return self._gated(self._lib.vl_silu_mul, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU's ``gelu_tanh(gate) * up`` of ``gate_up`` ``[T, 2 * I]`` -> ``[T, I]``
        (as :meth:`silu_mul`)."""
        return self._gated(self._lib.vl_gelu_tanh_mul, gate_up)

    def _gated(self, function: Callable[..., None], gate_up: torch.Tensor) -> torch.Tensor:
        _require(gate_up, dtype=torch.float32)
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
            raise ValueError(f"expected a contiguous [T, 2 * I] tensor, got {list(gate_up.shape)}")
        num_tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(num_tokens, width, dtype=torch.float32)
        _call(function, gate_up.data_ptr(), num_tokens, width, out.data_ptr())
        return out

    def rmsnorm_heads_(
        self, rows: torch.Tensor, num_heads: int, head_dim: int, weight: torch.Tensor, eps: float
    ) -> None:
        """RMSNorm, in place and times ``weight`` ``[head_dim]``, of each of the first
        ``num_heads`` heads of each row of ``rows`` ``[T, W]`` (unit stride within a row)."""
        _require(rows, weight, dtype=torch.float32)
        if rows.dim() != 2 or rows.stride(1) != 1 or num_heads * head_dim > rows.shape[1]:
            raise ValueError(
                f"expected [T, W] rows with unit column stride holding {num_heads} heads of "
                f"{head_dim}, got {list(rows.shape)}"
            )
        _call(
            self._lib.vl_rmsnorm_heads,
            rows.data_ptr(),
            rows.shape[0],
            rows.stride(0),
            num_heads,
            head_dim,
            weight.contiguous().data_ptr(),
            eps,
        )

    def scale_(self, x: torch.Tensor, factor: float) -> None:
        """``x *= factor`` in place (``x`` contiguous float32)."""
        _require(x, dtype=torch.float32)
        if not x.is_contiguous():
            raise ValueError(f"expected a contiguous tensor, got strides {x.stride()}")
        _call(self._lib.vl_scale, x.data_ptr(), x.numel(), factor)

    def copy_columns_(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """``destination[:] = source``, both float32 ``[M, n]``: ``source`` contiguous,
        ``destination`` with a unit column stride (columns of a wider tensor)."""
        _require(source, destination, dtype=torch.float32)
        if (
            source.dim() != 2
            or destination.shape != source.shape
            or not source.is_contiguous()
            or destination.stride(1) != 1
        ):
            raise ValueError(
                f"expected a contiguous [M, n] source and an [M, n] destination with unit "
                f"column stride, got {list(source.shape)} and {list(destination.shape)}"
            )
        rows, cols = source.shape
        _call(
            self._lib.vl_copy_columns,
            source.data_ptr(),
            rows,
            cols,
            destination.data_ptr(),
            destination.stride(0),
        )

    def rope_(
        self,
        rows: torch.Tensor,
        num_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
    ) -> None:
        """Rotate, in place, the first ``num_heads`` heads of each row of ``rows`` ``[T, W]``
        (row stride ``rows.stride(0)``, unit stride within a row) by ``positions`` ``[T]``
        (int64), with ``[max_positions, head_dim // 2]`` float32 tables."""
        _call(
            self._lib.vl_rope,
            rows.data_ptr(),
            rows.shape[0],
            rows.stride(0),
            num_heads,
            head_dim,
            positions.data_ptr(),
            cos_table.data_ptr(),
            sin_table.data_ptr(),
        )


class PagedAttentionKernel:
    """Paged causal attention over float32 or float16 CPU caches (see ``paged_attention.c``)."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        lib.vl_paged_attention.argtypes = [ptr, i64, i64] * 3 + [ptr, i64, ptr, ptr]
        lib.vl_paged_attention.argtypes += [ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, f32]
        lib.vl_paged_attention.argtypes += [i64, i64, ptr, i32]
        lib.vl_paged_attention.restype = i32
        self._lib = lib

    def step(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
    ) -> Callable[..., torch.Tensor]:
        """The attention of one step, for every layer: the step's cache layout is checked
        once here, and each layer's call then checks only its own tensors.

        ``slot_mapping`` ``[T]`` int64; ``block_tables`` ``[S, B]``, ``seq_lens`` ``[S]``
        and ``query_start_loc`` ``[S + 1]`` int32. The function takes ``query``
        ``[T, H, D]``, ``key`` and ``value`` ``[T, Hkv, D]`` (any token/head strides, unit
        stride within a head), ``kv_cache`` ``[2, num_blocks, block_size, Hkv, D]``
        (contiguous; float32, or float16, which the keys and values are rounded to as they
        are written) and an optional ``sliding_window`` (keys ``(p - window, p]``), writes the
        keys and values at ``slot_mapping``, attends and returns ``[T, H, D]`` float32.
        """
        _require(block_tables, seq_lens, query_start_loc, dtype=torch.int32)
        _require(slot_mapping, dtype=torch.int64)
        num_tokens, num_seqs = slot_mapping.shape[0], seq_lens.shape[0]
        if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
            raise ValueError(
                f"{num_seqs} sequences need query_start_loc [{num_seqs + 1}] and block_tables "
                f"[{num_seqs}, B]; got {list(query_start_loc.shape)} and "
                f"{list(block_tables.shape)}"
            )
        block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
        query_start_loc, slot_mapping = query_start_loc.contiguous(), slot_mapping.contiguous()
        call = self._lib.vl_paged_attention

        def attend(
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            sliding_window: int | None = None,
        ) -> torch.Tensor:
            _, num_heads, head_dim = query.shape
            num_kv_heads = key.shape[1]
            _require(query, key, value, dtype=torch.float32)
            if (
                kv_cache.dtype not in (torch.float32, torch.float16)
                or kv_cache.device.type != "cpu"
            ):
                raise ValueError(
                    f"paged attention needs a float32 or float16 CPU cache, got "
                    f"{kv_cache.dtype} on {kv_cache.device.type}"
                )
            if query.shape[0] != num_tokens or key.shape[0] != num_tokens:
                raise ValueError(f"expected {num_tokens} tokens, got {query.shape[0]}")
            if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
                raise ValueError("paged attention needs a contiguous [2, blocks, ...] KV cache")
            if query.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1:
                raise ValueError("paged attention needs unit stride within each head")
            out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
            keys = kv_cache.data_ptr()
            status = _call(
                call,
                query.data_ptr(), query.stride(0), query.stride(1),
                key.data_ptr(), key.stride(0), key.stride(1),
                value.data_ptr(), value.stride(0), value.stride(1),
                slot_mapping.data_ptr(), num_tokens,
                keys, keys + kv_cache.stride(0) * kv_cache.element_size(),
                block_tables.data_ptr(), block_tables.stride(0),
                seq_lens.data_ptr(), query_start_loc.data_ptr(), num_seqs,
                num_heads, num_kv_heads, head_dim, kv_cache.shape[2],
                scale, sliding_window or 0, int(kv_cache.dtype == torch.float16),
                out.data_ptr(), THREADS,
            )  # fmt: skip
            if status == -2:
                raise MemoryError(f"paged attention: no memory for {num_tokens} tokens' chunks")
            if status != 0:
                raise RuntimeError(
                    f"paged attention kernel refused the shape (heads {num_heads}/"
                    f"{num_kv_heads}, head dim {head_dim}, block size {kv_cache.shape[2]})"
                )
            return out

        return attend


_LIBRARIES = {
    "gguf_blocks": (SOURCE, GGUFBlockKernels),
    "fused_ops": (FUSED_OPS_SOURCE, FusedOps),
    "paged_attention": (PAGED_ATTENTION_SOURCE, PagedAttentionKernel),
}


def _require(*tensors: torch.Tensor, dtype: torch.dtype) -> None:
    """The C code reads raw memory: every tensor must be a CPU tensor of ``dtype``."""
    for tensor in tensors:
        if tensor.dtype != dtype or tensor.device.type != "cpu":
            raise TypeError(
                f"expected a CPU {dtype} tensor, got {tensor.device.type} {tensor.dtype}"
            )


def _check_blocks(qtype: str, blocks: torch.Tensor, rows: int, cols: int) -> None:
    layout = BLOCK_LAYOUTS[qtype]
    expected = (rows, cols // layout.values * layout.nbytes)
    _require(blocks, dtype=torch.uint8)
    if cols % layout.values or tuple(blocks.shape) != expected or not blocks.is_contiguous():
        raise ValueError(
            f"{qtype} blocks of a [{rows}, {cols}] matrix must be a contiguous uint8 tensor "
            f"{list(expected)}, got {list(blocks.shape)}"
        )


@functools.cache
def _load(name: str) -> GGUFBlockKernels | FusedOps | NativeKernelsUnavailable:
    if sys.platform == "win32":
        return NativeKernelsUnavailable("the C kernels are built for Linux and macOS only")
    source, wrapper = _LIBRARIES[name]
    try:
        path = build_library(source)
        try:
            return wrapper(path)
        except OSError:  # a damaged cached file: build it once more
            path = rebuild_library(source)
        try:
            return wrapper(path)
        except OSError as error:  # it does not load even when freshly built
            return NativeKernelsUnavailable(f"loading {path} failed: {error}")
    except NativeKernelsUnavailable as error:
        return error


def _loaded(name: str):
    loaded = _load(name)
    if isinstance(loaded, NativeKernelsUnavailable):
        raise loaded
    return loaded


def gguf_block_kernels() -> GGUFBlockKernels:
    """The block-quantized kernels, built on first use; raises
    :class:`NativeKernelsUnavailable`."""
    return _loaded("gguf_blocks")


def fused_ops() -> FusedOps:
    """The fused elementwise kernels, built on first use; raises
    :class:`NativeKernelsUnavailable`."""
    return _loaded("fused_ops")


def paged_attention_kernel() -> PagedAttentionKernel:
    """The paged attention kernel, built on first use; raises
    :class:`NativeKernelsUnavailable`."""
    return _loaded("paged_attention")


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here, or ``None`` when they can."""
    for name in _LIBRARIES:
        loaded = _load(name)
        if isinstance(loaded, NativeKernelsUnavailable):
            return str(loaded)
    return None
