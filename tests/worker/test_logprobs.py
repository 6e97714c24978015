"""LogprobsRequest: raw logprobs of sampled tokens and the top alternatives, by rank."""

from __future__ import annotations

import torch

from vlite.worker.logprobs import LogprobsRequest


def test_no_row_asking_computes_nothing():
    assert LogprobsRequest.capture(torch.randn(3, 10), [None, None, None]) is None


def test_values_and_ranks_match_log_softmax():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 40, generator=generator)
    num_top = [2, None, 0, 5, None]
    request = LogprobsRequest.capture(logits, num_top)
    sampled = torch.tensor([7, 1, 3, 39, 0])

    entries = request.gather(sampled)

    assert request.rows == [0, 2, 3]
    expected_all = torch.log_softmax(logits, dim=-1)
    for entry, row in zip(entries, request.rows):
        expected = expected_all[row]
        k = num_top[row]
        assert len(entry.token_ids) == len(entry.logprobs) == len(entry.ranks) == k + 1
        token = int(sampled[row])
        assert entry.token_ids[0] == token
        assert abs(entry.logprobs[0] - expected[token].item()) < 1e-6
        assert entry.ranks[0] == int((expected > expected[token]).sum()) + 1
        top = expected.topk(k) if k else None
        if top is not None:
            assert entry.token_ids[1:] == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(entry.logprobs[1:]), top.values)
            assert entry.ranks[1:] == list(range(1, k + 1))


def test_raw_logprobs_ignore_later_changes_to_the_logits():
    logits = torch.randn(2, 8)
    expected = torch.log_softmax(logits, dim=-1)
    request = LogprobsRequest.capture(logits, [1, 1])
    logits[:, 0] = float("-inf")  # e.g. the min_tokens mask, applied after capture

    entries = request.gather(torch.tensor([0, 0]))

    assert [e.logprobs[0] for e in entries] == expected[:, 0].tolist()
