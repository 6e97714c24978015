"""A mixture-of-experts layer: top-k routing, SwiGLU experts, tokens grouped by expert.

:class:`FusedMoE` holds one layer's experts as two stacked parameters, ``w13``
``[num_local_experts, 2 * intermediate, hidden]`` (gate and up, fused) and ``w2``
``[num_local_experts, hidden, intermediate]`` (down). Its forward pass sorts the step's
(token, expert) pairs by expert once and runs each expert on its contiguous slice of
tokens with two matrix products — a loop over experts, never over tokens — then adds the
weighted results back into each token's row.

Expert parallelism: with a ``tp_group`` of world size ``n``, rank ``r`` holds whole experts
``[r * E / n, (r + 1) * E / n)``, computes their share of every token's output, and one
all-reduce sums the shares. Routing is computed on every rank from the same replicated
router, so all ranks agree on it without communicating.

Two implementations of the experts' computation, chosen by ``FusedMoE.impl``:

- ``"torch"``: the loop over experts above (the reference);
- ``"triton"``: a grouped GEMM in Triton (:mod:`vlite.models.moe_kernels`): the pairs are
  aligned into per-expert blocks and two launches compute every expert at once, the first
  fusing ``SiLU(gate) * up``, the second the routed weights. float32 is computed exactly
  (no tf32); bfloat16 and float16 accumulate in float32. On CPU tensors it runs under the
  Triton interpreter (slow; for tests);
- ``"auto"`` (default): ``"triton"`` for CUDA tensors in float32, bfloat16 or float16 when
  ``triton`` is installed, ``"torch"`` otherwise.

Quantized experts: when every local expert's three matrices arrive as quantized weights of
one weight format (a GGUF file's blocks: :mod:`vlite.core.weight_format`), gate and up of
one type and down of one type, the layer keeps them in that format as :attr:`FusedMoE.quantized`
(stacked ``w13`` and ``w2``, the float parameters dropped) and runs the experts through the
format's grouped product (``expert_linear``) whatever ``impl`` says; otherwise quantized
matrices are dequantized into the float parameters.

The environment variable ``VLITE_MOE_IMPL`` (``auto``, ``torch`` or ``triton``) sets the
default of every layer built after it is set, e.g. ``VLITE_MOE_IMPL=torch vlite ...`` to
compare with the reference, or ``VLITE_MOE_IMPL=triton`` to run the kernels on CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlite.core.errors import ConfigError
from vlite.core.weight_format import QuantizedWeight, joinable
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup

#: The checkpoint's names for an expert's three matrices, by role (Mixtral: w1, w3, w2).
PIECES = ("gate", "up", "down")

#: The implementations of the experts' computation (see the module docstring).
IMPLS = ("auto", "torch", "triton")
#: The environment variable giving the default implementation.
IMPL_ENV = "VLITE_MOE_IMPL"
#: The dtypes the Triton implementation computes in.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def triton_is_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_impl(impl: str, source: str = "impl") -> str:
    """``impl`` if it is one of :data:`IMPLS`, else a ``ValueError`` naming ``source``."""
    if impl not in IMPLS:
        raise ConfigError(f"unknown MoE implementation {source}={impl!r}; expected one of {IMPLS}")
    return impl


def default_impl() -> str:
    """The implementation :data:`IMPL_ENV` names (``"auto"`` when it is unset or empty)."""
    return check_impl(os.environ.get(IMPL_ENV) or "auto", IMPL_ENV)


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, top_k] float32, experts [T, top_k] int64)`` for router logits
    ``[T, num_experts]``: the softmax's ``top_k`` largest probabilities (renormalized to sum
    to 1 when ``renormalize``) and their experts."""
    probabilities = F.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


@dataclass(frozen=True)
class QuantizedExperts:
    """A layer's local experts kept in a weight format.

    Attributes:
        w13: ``[num_local_experts, 2 * intermediate, hidden]``: each expert's gate rows,
            then its up rows.
        w2: ``[num_local_experts, hidden, intermediate]``: each expert's down matrix.
    """

    w13: QuantizedWeight
    w2: QuantizedWeight

    @property
    def nbytes(self) -> int:
        """Bytes both stacks hold."""
        return self.w13.nbytes + self.w2.nbytes


class FusedMoE(nn.Module):
    """One layer's experts (see the module docstring).

    Args:
        num_experts: experts in the layer (all ranks together).
        top_k: experts each token is routed to.
        hidden_size, intermediate_size: one expert's input/output and inner widths.
        renormalize: whether the top-k weights are rescaled to sum to 1.
        tp_group: the ranks the experts are spread over (whole experts per rank).
        impl: ``"auto"``, ``"torch"`` or ``"triton"`` (see the module docstring); default:
            :data:`IMPL_ENV`'s value, else ``"auto"``. Settable later as ``moe.impl``.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        impl: str | None = None,
    ) -> None:
        super().__init__()
        self.impl = default_impl() if impl is None else impl
        if num_experts % tp_group.world_size:
            raise ConfigError(
                f"{num_experts} experts do not split over tensor_parallel_size="
                f"{tp_group.world_size} (whole experts per rank)"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_group = tp_group
        self.first_expert, self.end_expert = tp_group.shard_range(num_experts)
        num_local = self.end_expert - self.first_expert
        self.intermediate_size = intermediate_size
        self.hidden_size = hidden_size
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, intermediate_size))
        #: The local experts in their weight format, when they arrived quantized (then
        #: ``w13`` and ``w2`` are ``None``); a memory report sums its ``nbytes``.
        self.quantized: QuantizedExperts | None = None
        self._loaded: set[tuple[int, str]] = set()
        #: Quantized matrices of local experts, (local expert, piece) -> weight, until all
        #: have come.
        self._pending: dict[tuple[int, str], QuantizedWeight] = {}

    #: Its parameters are filled by :meth:`load_expert`, not by the generic loader.
    loads_own_weights = True

    @property
    def impl(self) -> str:
        """The experts' implementation: ``"auto"``, ``"torch"`` or ``"triton"``."""
        return self._impl

    @impl.setter
    def impl(self, impl: str) -> None:
        self._impl = check_impl(impl)

    # ---- weights -----------------------------------------------------------------------

    def expected_shape(self, piece: str) -> tuple[int, int]:
        """The checkpoint shape of one expert's ``piece`` (``"gate"``, ``"up"``, ``"down"``)."""
        hidden, inner = self.hidden_size, self.intermediate_size
        return (hidden, inner) if piece == "down" else (inner, hidden)

    def load_expert(self, expert: int, piece: str, tensor: torch.Tensor | QuantizedWeight) -> None:
        """Take one expert's matrix (experts of other ranks are skipped): a float one is
        copied in at once, a quantized one waits for the others (see the module docstring)."""
        if piece not in PIECES:
            raise ValueError(f"unknown expert matrix {piece!r}; expected one of {PIECES}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside the layer's {self.num_experts} experts")
        if tuple(tensor.shape) != self.expected_shape(piece):
            raise ConfigError(
                f"expert {expert} {piece} matrix has shape {tuple(tensor.shape)}, expected "
                f"{self.expected_shape(piece)}"
            )
        self._loaded.add((expert, piece))
        if not self.first_expert <= expert < self.end_expert:
            return
        local = expert - self.first_expert
        if isinstance(tensor, QuantizedWeight):
            self._pending[(local, piece)] = tensor
        else:
            self._copy_expert(local, piece, tensor)
        num_local_loaded = sum(self.first_expert <= e < self.end_expert for e, _ in self._loaded)
        if num_local_loaded == (self.end_expert - self.first_expert) * len(PIECES):
            self._settle_quantized()

    def _copy_expert(self, local: int, piece: str, tensor: torch.Tensor) -> None:
        inner = self.intermediate_size
        with torch.no_grad():
            if piece == "gate":
                self.w13[local, :inner].copy_(tensor)
            elif piece == "up":
                self.w13[local, inner:].copy_(tensor)
            else:
                self.w2[local].copy_(tensor)

    def _settle_quantized(self) -> None:
        """Every local matrix has come: keep the quantized ones in their format when all
        are (gate and up joinable, the downs joinable), else dequantize them in."""
        pending, self._pending = self._pending, {}
        if not pending or self.quantized is not None:
            return
        num_local = self.end_expert - self.first_expert
        gate_up = [[pending.get((e, "gate")), pending.get((e, "up"))] for e in range(num_local)]
        down = [pending.get((e, "down")) for e in range(num_local)]
        if joinable([m for pair in gate_up for m in pair]) and joinable(down):
            w13_format, w2_format = gate_up[0][0].format, down[0].format
            w13 = w13_format.stack([w13_format.cat_rows(pair) for pair in gate_up])
            self.quantized = QuantizedExperts(w13, w2_format.stack(down))
            self.w13 = None
            self.w2 = None
            return
        for (local, piece), weight in pending.items():
            self._copy_expert(local, piece, weight.dequantize())

    def missing_weights(self) -> list[str]:
        """``"expert 3 up"`` for every expert matrix not loaded yet."""
        return [
            f"expert {expert} {piece}"
            for expert in range(self.num_experts)
            for piece in PIECES
            if (expert, piece) not in self._loaded
        ]

    # ---- forward -----------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[T, hidden]`` and ``router_logits`` ``[T, num_experts]`` ->
        ``[T, hidden]``: the routed experts' outputs, weighted and summed per token."""
        weights, experts = route(router_logits, self.top_k, self.renormalize)
        if self.quantized is not None:
            out = self._quantized_experts(hidden, weights, experts)
        elif self.uses_triton(hidden):
            out = self._triton_experts(hidden, weights, experts)
        else:
            out = self._torch_experts(hidden, weights, experts)
        return self.tp_group.all_reduce(out)

    def uses_triton(self, hidden: torch.Tensor) -> bool:
        """Whether :meth:`forward` runs the Triton kernels for ``hidden``.

        Raises:
            ValueError: ``impl="triton"`` and ``hidden``'s dtype is not one it computes in.
        """
        if self.impl == "torch":
            return False
        supported = hidden.dtype in TRITON_DTYPES
        if self.impl == "triton":
            if not supported:
                raise ConfigError(
                    f"the triton MoE implementation does not compute in {hidden.dtype}; "
                    f"it supports {TRITON_DTYPES} (use impl='torch')"
                )
            return True
        return hidden.is_cuda and supported and triton_is_installed()

    def _triton_experts(
        self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        from vlite.models.moe_kernels import load_moe_kernels
        from vlite.models.moe_kernels.experts import grouped_experts

        if hidden.shape[0] == 0:
            return torch.zeros_like(hidden)
        kernels = load_moe_kernels(hidden.device)
        return grouped_experts(
            kernels.grouped_gemm,
            hidden,
            self.w13,
            self.w2,
            weights,
            experts,
            self.first_expert,
            self.num_experts,
            interpreted=kernels.interpreted,
        )

    def _quantized_experts(
        self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The local experts through their weight format: the (token, expert) pairs sorted
        by expert, two grouped products (``expert_linear``) in float32."""
        flat_experts = experts.flatten()  # [T * top_k], pair i is token i // top_k
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        sizes = counts[self.first_expert : self.end_expert]
        start = sum(counts[: self.first_expert])
        pairs = order[start : start + sum(sizes)]
        tokens = pairs // self.top_k
        w13, w2 = self.quantized.w13, self.quantized.w2
        gate, up = w13.format.expert_linear(w13, hidden[tokens].float(), sizes).chunk(2, dim=-1)
        expert_out = w2.format.expert_linear(w2, F.silu(gate) * up, sizes)
        expert_out = expert_out * weights.flatten()[pairs, None]
        out = torch.zeros_like(hidden)
        out.index_add_(0, tokens, expert_out.to(out.dtype))
        return out

    def _torch_experts(
        self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """The reference: a loop over the local experts, each on its tokens."""
        flat_experts = experts.flatten()  # [T * top_k], pair i is token i // top_k
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(hidden)
        start = sum(counts[: self.first_expert])
        for expert in range(self.first_expert, self.end_expert):
            count = counts[expert]
            if not count:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // self.top_k
            local = expert - self.first_expert
            gate, up = F.linear(hidden[tokens], self.w13[local]).chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate) * up, self.w2[local])
            expert_out = expert_out * flat_weights[pairs, None]
            out.index_add_(0, tokens, expert_out.to(out.dtype))
        return out


class MoEBlock(nn.Module):
    """A replicated router (``gate``, ``[num_experts, hidden]``) and its :class:`FusedMoE`
    experts: one layer's mixture, ``[T, hidden]`` -> ``[T, hidden]``.

    Args:
        hidden_size, num_experts, top_k, expert_size, renormalize, tp_group: as
            :class:`FusedMoE` takes them (``expert_size``: one expert's inner width).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        expert_size: int,
        renormalize: bool,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, expert_size, renormalize, tp_group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))
