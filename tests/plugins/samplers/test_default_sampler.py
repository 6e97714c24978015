"""DefaultSampler: greedy, seeded, top-k, top-p, temperature and mixed batches."""

from __future__ import annotations

import math

import pytest
import torch

from vlite.core.sampler import SamplingMetadata
from vlite.plugins.samplers.default import DefaultSampler

NUM_DRAWS = 4000


def make_metadata(
    temperature: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
) -> SamplingMetadata:
    n = len(temperature)
    top_k = top_k if top_k is not None else [0] * n
    top_p = top_p if top_p is not None else [1.0] * n
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor(top_k, dtype=torch.int64),
        top_p=torch.tensor(top_p, dtype=torch.float32),
        generators=generators or {},
        is_all_greedy=all(t == 0 for t in temperature),
        has_top_k=any(k > 0 for k in top_k),
        has_top_p=any(p < 1.0 for p in top_p),
    )


def draw_many(logits_row: torch.Tensor, num_draws: int = NUM_DRAWS, **row_settings) -> torch.Tensor:
    """Sample ``num_draws`` independent rows with the same logits and settings."""
    logits = logits_row.expand(num_draws, -1).contiguous()
    metadata = make_metadata(
        temperature=[row_settings.get("temperature", 1.0)] * num_draws,
        top_k=[row_settings.get("top_k", 0)] * num_draws,
        top_p=[row_settings.get("top_p", 1.0)] * num_draws,
    )
    return DefaultSampler().sample(logits, metadata)


def frequencies(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab_size).float() / tokens.numel()


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(1234)


@pytest.mark.parametrize("temperature", [[0.0] * 8, [0.0, 1.0] * 4])
def test_output_is_one_int64_token_per_row(temperature):
    logits = torch.randn(8, 50)

    tokens = DefaultSampler().sample(logits, make_metadata(temperature))

    assert tokens.shape == (8,)
    assert tokens.dtype == torch.int64
    assert ((tokens >= 0) & (tokens < 50)).all()


def test_greedy_rows_pick_the_argmax():
    logits = torch.randn(16, 300)

    tokens = DefaultSampler().sample(logits, make_metadata([0.0] * 16))

    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_greedy_rows_pick_the_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 40)
    logits[1] = 0.0  # random rows over a flat distribution: their tokens vary
    logits[4] = 0.0
    temperature = [0.0, 1.0, 0.0, 0.0, 2.0, 0.0]
    # Settings on greedy rows must not matter, whatever other rows use.
    metadata = make_metadata(temperature, top_k=[1, 0, 5, 0, 0, 2], top_p=[0.1, 1, 1, 0.5, 1, 1])

    draws = torch.stack([DefaultSampler().sample(logits, metadata) for _ in range(50)])

    expected = logits.argmax(dim=-1)
    for row in (0, 2, 3, 5):
        assert (draws[:, row] == expected[row]).all()
    for row in (1, 4):
        assert len(draws[:, row].unique()) > 10


def test_seeded_row_gives_the_same_tokens_twice():
    logits = torch.zeros(1, 1000)

    def sequence(seed: int, global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)  # the global RNG must not matter to a seeded row
        generator = torch.Generator().manual_seed(seed)
        metadata = make_metadata([1.0], generators={0: generator})
        return [DefaultSampler().sample(logits, metadata).item() for _ in range(20)]

    first = sequence(seed=7, global_seed=0)

    assert sequence(seed=7, global_seed=99) == first
    assert sequence(seed=8, global_seed=0) != first
    assert len(set(first)) > 10


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch():
    logits = torch.randn(4, 200)

    def seeded_row_tokens(batch_rows: int) -> list[int]:
        generator = torch.Generator().manual_seed(3)
        metadata = make_metadata([0.8] * batch_rows, generators={0: generator})
        return [DefaultSampler().sample(logits[:batch_rows], metadata)[0].item() for _ in range(20)]

    assert seeded_row_tokens(1) == seeded_row_tokens(4)


def test_top_k_only_yields_the_k_most_likely_tokens():
    logits = torch.randn(100)
    top3 = set(logits.topk(3).indices.tolist())

    tokens = draw_many(logits, top_k=3, temperature=1.5)

    assert set(tokens.unique().tolist()) == top3


def test_top_k_zero_row_is_unrestricted_next_to_a_top_k_row():
    logits = 0.01 * torch.randn(2, 100)  # nearly flat, no ties
    metadata = make_metadata([1.0, 1.0], top_k=[3, 0])

    draws = torch.stack([DefaultSampler().sample(logits, metadata) for _ in range(300)])

    assert set(draws[:, 0].tolist()) == set(logits[0].topk(3).indices.tolist())
    assert len(draws[:, 1].unique()) > 50


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.7, [0, 1]), (0.9, [0, 1, 2]), (0.4, [0])])
def test_top_p_keeps_only_the_nucleus(top_p, nucleus):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])

    tokens = draw_many(probs.log(), top_p=top_p)

    freq = frequencies(tokens, 4)
    assert set(tokens.unique().tolist()) == set(nucleus)
    # Within the nucleus, the renormalized probabilities.
    expected = torch.zeros(4)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    assert torch.allclose(freq, expected, atol=0.03)


def test_random_draws_follow_the_softmax_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    expected = logits.softmax(dim=-1)

    freq = frequencies(draw_many(logits, num_draws=20000), 5)

    # ~4 standard errors of a proportion estimated from 20000 draws.
    assert torch.allclose(freq, expected, atol=4 * math.sqrt(0.25 / 20000))


def test_temperature_sharpens_or_flattens_the_distribution():
    logits = torch.arange(10, dtype=torch.float32) * 0.5

    cold = frequencies(draw_many(logits, temperature=0.05), 10)
    warm = frequencies(draw_many(logits, temperature=1.0), 10)
    hot = frequencies(draw_many(logits, temperature=5.0), 10)

    assert cold[9] > 0.99
    assert 0.3 < warm[9] < 0.5  # softmax gives 0.40
    assert hot[9] < 0.2
    assert (hot > 0.03).all()  # every token is drawn regularly
    entropy = [-(f[f > 0] * f[f > 0].log()).sum().item() for f in (cold, warm, hot)]
    assert entropy[0] < entropy[1] < entropy[2]
