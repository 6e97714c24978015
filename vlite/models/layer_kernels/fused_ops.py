"""The fused layer steps in Triton: RMSNorm with its residual add, RoPE in place, SwiGLU's
activation (see the package docstring for why and how they match PyTorch).

Each kernel rounds to the tensors' dtype wherever the PyTorch ops it replaces do
(``x + residual``, the normalised value, each product of RoPE's formula, ``silu(gate)``), so
it gives what those ops give, up to the order of one sum (the RMS) and the compiler's
contractions (one unit in the last place, here and there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The combine function behind tl.sum: the kernels call only builtins of triton.language, so
# they run interpreted even where triton was imported compiled first (see
# vlite.plugins.attention.triton_kernels.paged_attention).
_ADD = tl.standard._sum_combine

#: dtypes the kernels take.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_interpreted() -> bool:
    """Whether this module's kernels were defined for the Triton interpreter."""
    return type(_add_rmsnorm_kernel).__name__ == "InterpretedFunction"


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H], updated in place (unused without HAS_RESIDUAL)
    weight_ptr,  # [H]
    out_ptr,  # [T, H]
    hidden,
    stride_x,
    stride_residual,
    stride_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < hidden
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + columns, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_row = residual_ptr + row * stride_residual + columns
        summed = tl.load(residual_row, mask=mask, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) + summed).to(dtype)  # rounded, as ``x + residual``
        tl.store(residual_row, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.reduce(x32 * x32, 0, _ADD) / hidden
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(dtype)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    out = (weight * normed.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_out + columns, out, mask=mask)


@triton.jit
def _rope_kernel(
    rows_ptr,  # [T, W]: heads of head_dim values, rotated in place
    positions_ptr,  # [T] int64: rows of the tables
    cos_ptr,  # [max_positions, HALF] float32
    sin_ptr,
    stride_row,
    stride_table,
    num_heads,
    head_dim,
    half,
    HEADS_P2: tl.constexpr,
    HALF_P2: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HALF_P2)[None, :]
    mask = (heads < num_heads) & (dims < half)
    dtype = rows_ptr.dtype.element_ty
    first = rows_ptr + token * stride_row + heads * head_dim + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    table = position * stride_table + dims
    cos = tl.load(cos_ptr + table, mask=dims < half, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + table, mask=dims < half, other=0.0).to(dtype).to(tl.float32)
    # PyTorch's ``x1 * cos - x2 * sin``: each product rounded, then the difference.
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, out1.to(dtype), mask=mask)
    tl.store(first + half, out2.to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2 * I]: gate then up
    out_ptr,  # [T, I]
    width,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < width
    dtype = gate_up_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + columns, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + columns, mask=mask, other=0.0)
    gate = gate.to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # rounded, as ``F.silu(gate)``
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_out + columns, out, mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last dim]`` with a unit last stride (a copy only if needed)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class TritonFusedOps:
    """:class:`vlite.kernels.native.FusedOps`' interface, in Triton, on any float dtype.

    Args:
        interpreted: the kernels run under the Triton interpreter (on CPU tensors).
    """

    #: RoPE on the first ``2 * table width`` dimensions of each head (partial rotary).
    rotates_partial_heads = True
    #: ``add_rmsnorm`` takes ``[..., H]`` (per-head norms too), not only ``[T, H]``.
    norms_any_rank = True

    def __init__(self, interpreted: bool) -> None:
        self.interpreted = interpreted

    def handles(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether tensors of ``dtype`` on ``device`` run here (CUDA; CPU when interpreted)."""
        on_device = device.type == ("cpu" if self.interpreted else "cuda")
        return on_device and dtype in FLOAT_DTYPES

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += x`` (if given), then RMSNorm of the sum (or of ``x``) times ``weight``.

        ``x``, ``residual``: ``[..., H]`` (``residual`` contiguous, ``weight`` ``[H]`` of
        ``x``'s dtype); returns a new tensor of ``x``'s shape.
        """
        hidden = x.shape[-1]
        rows = _rows(x)
        if residual is not None and not residual.is_contiguous():
            raise ValueError("add_rmsnorm updates residual in place: it must be contiguous")
        out = torch.empty_like(rows)
        block = triton.next_power_of_2(hidden)
        _add_rmsnorm_kernel[(rows.shape[0],)](
            rows,
            rows if residual is None else residual,
            weight,
            out,
            hidden,
            rows.stride(0),
            hidden,
            out.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )
        return out.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up`` of ``gate_up`` ``[T, 2 * I]`` (gate first) -> ``[T, I]``."""
        rows = _rows(gate_up)
        width = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], width, dtype=rows.dtype, device=rows.device)
        block = min(1024, triton.next_power_of_2(width))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
            rows, out, width, rows.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
        return out.view(*gate_up.shape[:-1], width)

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
        (unit stride within a row) by ``positions`` ``[T]``, with ``[max_positions,
        rotary_dim // 2]`` float32 tables: the first ``rotary_dim`` values of each head turn
        (HF's ``rotate_half``), the rest stay."""
        if rows.shape[0] == 0:
            return
        if rows.stride(-1) != 1:
            raise ValueError("rope_ rotates rows with a unit last stride")
        half = cos_table.shape[1]
        _rope_kernel[(rows.shape[0],)](
            rows,
            positions,
            cos_table,
            sin_table,
            rows.stride(0),
            cos_table.stride(0),
            num_heads,
            head_dim,
            half,
            HEADS_P2=triton.next_power_of_2(num_heads),
            HALF_P2=triton.next_power_of_2(half),
            num_warps=4,
        )
