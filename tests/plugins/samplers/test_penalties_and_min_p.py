"""DefaultSampler's penalties and min-p against slow per-row references, in mixed batches."""

from __future__ import annotations

import pytest
import torch

from vlite.plugins.samplers.default import DefaultSampler, apply_min_p
from vlite.plugins.samplers.penalties import apply_penalties, token_counts
from vlite.testing.conformance.sampler import (
    RowPenalties,
    make_sampling_metadata,
    reference_penalized_logits,
)
from vlite.worker.sampling_inputs import build_penalties

VOCAB = 50


def random_rows(num_rows: int, generator: torch.Generator) -> list[RowPenalties]:
    """Random histories (with repeats) and penalties; every third row has none."""
    rows = []
    for row in range(num_rows):
        prompt_len, output_len = torch.randint(1, 30, (2,), generator=generator).tolist()
        if row % 5 == 4:
            output_len = 0  # no output yet: only the repetition penalty can apply
        values = (torch.rand(3, generator=generator) * 4 - 2).tolist()
        rows.append(
            RowPenalties(
                prompt_token_ids=torch.randint(
                    0, VOCAB, (prompt_len,), generator=generator
                ).tolist(),
                output_token_ids=torch.randint(
                    0, VOCAB // 3, (output_len,), generator=generator
                ).tolist(),
                presence_penalty=values[0],
                frequency_penalty=values[1],
                repetition_penalty=0.5 + abs(values[2]),
            )
            if row % 3
            else RowPenalties()
        )
    return rows


def test_token_counts_count_each_id_and_drop_the_padding():
    ids = torch.tensor([[3, 3, 1, VOCAB, VOCAB], [VOCAB] * 5])
    counts = token_counts(ids, VOCAB)
    assert counts.shape == (2, VOCAB)
    assert counts[0, 3] == 2 and counts[0, 1] == 1 and counts[0].sum() == 3
    assert counts[1].sum() == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_equal_the_per_row_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    rows = random_rows(12, generator)
    logits = torch.randn(12, VOCAB, generator=generator) * 3
    metadata = make_sampling_metadata([0.0] * 12, penalties=rows, vocab_size=VOCAB)

    penalized = apply_penalties(logits, metadata.penalties)

    for index, row in enumerate(rows):
        expected = reference_penalized_logits(logits[index], row).float()
        torch.testing.assert_close(penalized[index], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(penalized[0], logits[0])  # the row without penalties is untouched


def test_greedy_rows_take_the_argmax_after_the_penalties():
    logits = torch.tensor([[2.0, 1.9, 0.0], [2.0, 1.9, 0.0]])
    rows = [
        RowPenalties(output_token_ids=[0]),
        RowPenalties(output_token_ids=[0], presence_penalty=0.5),
    ]
    metadata = make_sampling_metadata([0.0, 0.0], penalties=rows, vocab_size=3)

    assert DefaultSampler().sample(logits, metadata).tolist() == [0, 1]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0]])
    row = RowPenalties(prompt_token_ids=[0], output_token_ids=[1], repetition_penalty=2.0)
    metadata = make_sampling_metadata([0.0], penalties=[row], vocab_size=4)

    assert apply_penalties(logits, metadata.penalties).tolist() == [[1.0, -4.0, 1.0, -1.0]]


def test_build_penalties_splits_prompt_and_output_and_leaves_other_rows_empty():
    from vlite.core.sampling_params import SamplingParams
    from vlite.worker.input_batch import CachedRequestState

    with_penalty = SamplingParams(frequency_penalty=0.5)
    states = [
        CachedRequestState("a", [1, 2, 3, 7, 7], with_penalty, [], 0, num_prompt_tokens=3),
        CachedRequestState("b", [4, 5, 6, 8], SamplingParams(), [], 0, num_prompt_tokens=2),
    ]
    penalties = build_penalties(states, torch.device("cpu"), vocab_size=9)

    assert penalties.prompt_token_ids.tolist() == [[1, 2, 3], [9, 9, 9]]
    assert penalties.output_token_ids.tolist() == [[7, 7], [9, 9]]
    assert penalties.frequency_penalty.tolist() == [0.5, 0.0]
    assert penalties.repetition_penalty.tolist() == [1.0, 1.0]


def reference_min_p(logits_row: torch.Tensor, min_p: float) -> torch.Tensor:
    """``[vocab]`` bool: the tokens min-p keeps, from probabilities."""
    probs = logits_row.double().softmax(dim=-1)
    return probs >= min_p * probs.max()


def test_min_p_keeps_the_tokens_the_reference_keeps():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 200, generator=generator) * 2
    min_p = torch.tensor([0.0, 0.01, 0.1, 0.3, 0.9, 1.0])

    kept = apply_min_p(logits, min_p) > float("-inf")

    for row in range(6):
        assert torch.equal(kept[row], reference_min_p(logits[row], min_p[row].item()))
    assert kept[0].all()  # min_p = 0 keeps everything
    assert kept[5].sum() == 1  # min_p = 1 keeps only the most likely


def test_min_p_rows_never_sample_a_dropped_token_beside_rows_without_it():
    torch.manual_seed(0)
    logits = torch.randn(1, 100).expand(400, -1).contiguous()
    min_p = [0.5 if row % 2 else 0.0 for row in range(400)]
    metadata = make_sampling_metadata([1.0] * 400, min_p=min_p)

    tokens = DefaultSampler().sample(logits, metadata)

    allowed = reference_min_p(logits[0], 0.5)
    assert allowed[tokens[1::2]].all()
    assert not allowed[tokens[0::2]].all(), "rows without min-p were restricted too"


def test_seeded_rows_with_penalties_and_min_p_repeat():
    generator = torch.Generator().manual_seed(4)
    rows = random_rows(6, generator)
    logits = torch.randn(6, VOCAB, generator=generator)

    def sample() -> list[int]:
        generators = {row: torch.Generator().manual_seed(10 + row) for row in range(6)}
        metadata = make_sampling_metadata(
            [1.0] * 6,
            generators=generators,
            min_p=[0.05] * 6,
            penalties=rows,
            vocab_size=VOCAB,
        )
        return DefaultSampler().sample(logits, metadata).tolist()

    first = sample()
    torch.manual_seed(123)  # the global generator must not matter
    assert sample() == first
