"""FusedMoE's Triton grouped GEMM against its torch reference.

Without a GPU the kernel runs under the Triton interpreter on CPU, so the cases are small
(a few to 40 tokens, hidden 32-64, 4-8 experts). float32 must match the reference to
``1e-5`` relative (no tf32); bfloat16 to ``3e-2``. The last test runs the compiled kernel
at realistic sizes on a GPU (``pytest -m gpu``).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from vlite.distributed.parallel_state import TensorParallelGroup
from vlite.models.fused_moe import IMPL_ENV, FusedMoE, route
from vlite.models.moe_kernels import load_moe_kernels
from vlite.models.moe_kernels.align import align_pairs_to_blocks
from vlite.models.moe_kernels.config import MoETiles

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@dataclasses.dataclass(frozen=True)
class LocalShare(TensorParallelGroup):
    """A rank's view without the collective: its share of the output, not the sum."""

    def all_reduce(self, tensor):
        return tensor


def make_moe(
    num_experts: int = 8,
    top_k: int = 2,
    hidden: int = 64,
    inner: int = 32,
    renormalize: bool = True,
    dtype: torch.dtype = torch.float32,
    group: TensorParallelGroup | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> FusedMoE:
    """A FusedMoE with random experts scaled to keep activations of order one."""
    moe = FusedMoE(num_experts, top_k, hidden, inner, renormalize, group or LocalShare())
    generator = torch.Generator().manual_seed(seed)
    for expert in range(num_experts):
        for piece in ("gate", "up", "down"):
            rows, columns = moe.expected_shape(piece)
            matrix = torch.randn(rows, columns, generator=generator) / columns**0.5
            moe.load_expert(expert, piece, matrix)
    return moe.to(device=device, dtype=dtype)


def make_inputs(
    num_tokens: int,
    hidden: int,
    num_experts: int,
    only_experts: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [T, hidden], router logits [T, num_experts])``; with ``only_experts`` the
    others get ``-inf`` logits, so no token is routed to them."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(num_tokens, hidden, generator=generator)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    if only_experts is not None:
        excluded = torch.ones(num_experts, dtype=torch.bool)
        excluded[only_experts] = False
        logits[:, excluded] = float("-inf")
    return states.to(device=device, dtype=dtype), logits.to(device)


def both_impls(moe: FusedMoE, states: torch.Tensor, logits: torch.Tensor):
    """``(triton output, torch reference output)`` of the same layer."""
    with torch.no_grad():
        moe.impl = "torch"
        expected = moe(states, logits)
        moe.impl = "triton"
        actual = moe(states, logits)
    return actual, expected


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to ``tolerance`` relative, elementwise and to the output's scale."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tolerance = TOLERANCES[expected.dtype]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(
        actual.float(), expected.float(), rtol=tolerance, atol=tolerance * max(scale, 1e-30)
    )


# ---- the layer, Triton against torch, under the interpreter on CPU ---------------------


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2])
def test_triton_equals_the_reference(top_k, renormalize):
    moe = make_moe(top_k=top_k, renormalize=renormalize)
    actual, expected = both_impls(moe, *make_inputs(7, 64, 8))
    assert_matches(actual, expected)


def test_experts_without_tokens_and_a_single_token():
    moe = make_moe(num_experts=8)
    states, logits = make_inputs(6, 64, 8, only_experts=[1, 2, 6])
    assert set(route(logits, 2, True)[1].unique().tolist()) == {1, 2, 6}
    assert_matches(*both_impls(moe, states, logits))
    assert_matches(*both_impls(moe, *make_inputs(1, 64, 8, seed=4)))


def test_experts_with_more_pairs_than_a_block():
    moe = make_moe(num_experts=4, hidden=32)
    states, logits = make_inputs(40, 32, 4)
    counts = torch.bincount(route(logits, 2, True)[1].flatten(), minlength=4)
    assert counts.max() > 16  # the interpreter's block_m: experts span several blocks
    assert_matches(*both_impls(moe, states, logits))


def test_an_expert_parallel_share_counts_only_its_own_experts():
    shares = [
        make_moe(group=LocalShare(rank=rank, world_size=2, process_group=object()))
        for rank in range(2)
    ]
    assert shares[1].first_expert == 4
    states, logits = make_inputs(9, 64, 8)
    totals = []
    for share in shares:
        actual, expected = both_impls(share, states, logits)
        assert_matches(actual, expected)
        totals.append(actual)
    assert_matches(sum(totals), make_moe()(states, logits).detach())
    # Tokens routed only to rank 0's experts contribute nothing on rank 1.
    states, logits = make_inputs(5, 64, 8, only_experts=[0, 3])
    actual, _ = both_impls(shares[1], states, logits)
    assert torch.equal(actual, torch.zeros_like(actual))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_in_float32(dtype):
    moe = make_moe(dtype=dtype)
    actual, expected = both_impls(moe, *make_inputs(12, 64, 8, dtype=dtype))
    assert_matches(actual, expected)


# ---- the kernel's launches -------------------------------------------------------------


def test_align_puts_each_pair_once_in_a_block_of_its_expert():
    pair_experts = torch.tensor([5, 2, 2, 7, 3, 2, 0, 5, 3, 2])
    blocks = align_pairs_to_blocks(pair_experts, num_experts=8, block_m=2)
    rows = blocks.pair_ids.view(blocks.num_blocks, 2)
    seen = []
    for block, expert in enumerate(blocks.block_experts.tolist()):
        pairs = [p for p in rows[block].tolist() if p != len(pair_experts)]
        seen += pairs
        assert all(pair_experts[p] == expert for p in pairs)
        assert pairs or expert == 8  # only the unused blocks are empty
    assert sorted(seen) == list(range(len(pair_experts)))
    # Expert 0: 1 pair, 2: 4, 3: 2, 5: 2, 7: 1 -> 6 blocks of the bound's (10 + 8) // 2.
    assert blocks.block_experts.tolist() == [0, 2, 2, 3, 5, 7] + [8] * 3


def test_launches_write_every_routed_row_into_a_poisoned_buffer():
    """Small tiles over odd sizes: several N blocks, a K remainder, padded M blocks."""
    top_k, hidden, inner, num_local, first_expert = 2, 40, 24, 3, 1
    generator = torch.Generator().manual_seed(7)
    states = torch.randn(11, hidden, generator=generator)
    pair_experts = torch.randint(0, 5, (11 * top_k,), generator=generator)  # 0, 4: elsewhere
    routed = torch.rand(11 * top_k, generator=generator)
    w13 = torch.randn(num_local, 2 * inner, hidden, generator=generator)
    w2 = torch.randn(num_local, hidden, inner, generator=generator)
    tiles = MoETiles(block_m=16, block_n=16, block_k=16)
    blocks = align_pairs_to_blocks(pair_experts, 5, tiles.block_m)
    gemm = load_moe_kernels("cpu").grouped_gemm
    local = (pair_experts >= first_expert) & (pair_experts < first_expert + num_local)
    assert local.any() and not local.all()

    activations = torch.full((11 * top_k, inner), float("nan"))
    common = {"first_expert": first_expert}
    gemm(states, w13, activations, blocks, tiles, pairs_per_a_row=top_k, gated=True, **common)
    outputs = torch.full((11 * top_k, hidden), float("nan"))
    gemm(activations, w2, outputs, blocks, tiles, pairs_per_a_row=1, routed_weights=routed,
         zero_unrouted=True, **common)  # fmt: skip

    for pair in range(11 * top_k):
        if not local[pair]:
            assert activations[pair].isnan().all()  # not computed
            assert torch.equal(outputs[pair], torch.zeros(hidden))
            continue
        w13_e, w2_e = (w[pair_experts[pair] - first_expert].double() for w in (w13, w2))
        gate, up = F.linear(states[pair // top_k].double(), w13_e).chunk(2)
        expected_activation = F.silu(gate) * up
        close = {"rtol": 1e-5, "atol": 1e-4}  # float32 against float64, values of order 10
        torch.testing.assert_close(activations[pair].double(), expected_activation, **close)
        expected = F.linear(activations[pair].double(), w2_e) * routed[pair]
        torch.testing.assert_close(outputs[pair].double(), expected, **close)


# ---- choosing the implementation -------------------------------------------------------


def test_the_implementation_is_checked_and_auto_keeps_cpu_on_torch(monkeypatch):
    moe = make_moe()
    assert moe.impl == "auto" and not moe.uses_triton(torch.zeros(1, 64))
    with pytest.raises(ValueError, match=r"impl='cuda'; expected one of \('auto', 'torch'"):
        moe.impl = "cuda"
    monkeypatch.setenv(IMPL_ENV, "Triton")
    with pytest.raises(ValueError, match=rf"{IMPL_ENV}='Triton'; expected one of"):
        make_moe()
    monkeypatch.setenv(IMPL_ENV, "triton")
    forced = make_moe()
    assert forced.impl == "triton" and forced.uses_triton(torch.zeros(1, 64))
    with pytest.raises(ValueError, match="does not compute in torch.float64"):
        forced.uses_triton(torch.zeros(1, 64, dtype=torch.float64))


CHECK_PRIVATE_COPY = textwrap.dedent(
    """
    import os, warnings
    import torch
    if not torch.cuda.is_available():
        torch.cuda.is_available = lambda: True  # as in a GPU process
    from vlite.models.moe_kernels import grouped_gemm, load_moe_kernels
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels = load_moe_kernels("cpu")
    assert kernels.interpreted and "interpreted copy" in str(caught[0].message)
    assert "TRITON_INTERPRET" not in os.environ  # restored
    assert not grouped_gemm.is_interpreted()  # the process's own kernel stays compiled
    from vlite.models.fused_moe import FusedMoE
    moe = FusedMoE(4, 2, 32, 16, True)
    torch.nn.init.normal_(moe.w13), torch.nn.init.normal_(moe.w2)
    states, logits = torch.randn(5, 32), torch.randn(5, 4)
    with torch.no_grad():
        expected = moe(states, logits)
        moe.impl = "triton"
        torch.testing.assert_close(moe(states, logits), expected, rtol=1e-5, atol=1e-4)
    print("OK")
    """
)


def test_cpu_tensors_in_a_cuda_process_use_a_private_interpreted_copy():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    completed = subprocess.run(
        [sys.executable, "-c", CHECK_PRIVATE_COPY],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.split()[-1] == "OK"


# ---- end to end: a tiny Mixtral through LLM equals transformers ------------------------


def test_a_tiny_mixtral_on_the_triton_experts_matches_transformers(
    tmp_path, monkeypatch, exact_float32_products
):

    from vlite import LLM, SamplingParams
    from vlite.models.moe_kernels import experts
    from vlite.testing.tiny_models import make_tiny_model

    folder = make_tiny_model(
        tmp_path, "MixtralForCausalLM", num_kv_heads=2, tie_word_embeddings=False
    )
    prompts = [[5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 19, 23, 200, 31, 8, 77, 90], [12]]
    num_new_tokens = 8
    from vlite.testing.engine_runs import transformers_greedy

    expected = [c.token_ids for c in transformers_greedy(folder, prompts, num_new_tokens)]

    launches = []
    grouped_experts = experts.grouped_experts

    def counting(*args, **kwargs):
        launches.append(1)
        return grouped_experts(*args, **kwargs)

    monkeypatch.setattr(experts, "grouped_experts", counting)
    monkeypatch.setenv(IMPL_ENV, "triton")
    llm = LLM(model=str(folder), dtype="float32", num_kv_blocks=16)  # CUDA defaults to bf16
    params = SamplingParams(max_tokens=num_new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(out.outputs[0].token_ids) for out in outputs] == expected
    assert launches  # the layers ran the Triton experts


# ---- on a GPU --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [256, 3])
def test_compiled_kernel_on_cuda_at_realistic_sizes(dtype, num_tokens, exact_float32_products):
    # exact_float32_products: the float32 reference computes exactly too.
    moe = make_moe(8, 2, 1024, 2816, dtype=dtype, device="cuda")
    states, logits = make_inputs(num_tokens, 1024, 8, dtype=dtype, device="cuda")
    assert load_moe_kernels("cuda").interpreted is False
    assert_matches(*both_impls(moe, states, logits))
    group = LocalShare(rank=1, world_size=4, process_group=object())
    share = make_moe(8, 2, 1024, 2816, dtype=dtype, group=group, device="cuda")
    assert_matches(*both_impls(share, states, logits))
