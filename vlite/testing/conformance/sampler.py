"""SamplerConformance: greedy, seeds, and the distributions temperature/top-k/top-p allow.

Distribution checks draw :attr:`SamplerConformance.num_draws` tokens (rows of one batch)
from a fixed 8-token distribution with a fixed global seed, and require every token to be
allowed, every allowed token to appear, and the total variation distance between the
observed and the intended distribution to stay under ``max_total_variation``. The
intended order is vLLM's: divide by the temperature, then top-k, then top-p.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch

from vlite.core.sampler import SAMPLER_CAPABILITY_DEFAULTS, SamplingMetadata, SamplingPenalties
from vlite.testing.conformance.base import PluginConformance

#: The test distribution over 8 tokens, placed at shuffled vocabulary positions.
PROBS = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02], dtype=torch.float64)
POSITIONS = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])


@dataclass
class RowPenalties:
    """One row's penalties and token history, for :func:`make_sampling_metadata`."""

    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


def make_sampling_metadata(
    temperature: list[float],
    top_k: list[int] | None = None,
    top_p: list[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    device: str | torch.device = "cpu",
    min_p: list[float] | None = None,
    penalties: list[RowPenalties] | None = None,
    vocab_size: int | None = None,
) -> SamplingMetadata:
    """:class:`SamplingMetadata` for rows with these settings, as the model runner builds it.

    ``min_p`` and ``penalties`` (one entry per row) are left out when not given;
    ``vocab_size`` (the padding id of token histories) is needed with ``penalties``.
    """
    num_rows = len(temperature)
    top_k = top_k if top_k is not None else [0] * num_rows
    top_p = top_p if top_p is not None else [1.0] * num_rows
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        generators=generators or {},
        is_all_greedy=all(t == 0 for t in temperature),
        has_top_k=any(k > 0 for k in top_k),
        has_top_p=any(p < 1.0 for p in top_p),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32, device=device),
        penalties=None if penalties is None else _penalties(penalties, vocab_size, device),
    )


def _penalties(
    rows: list[RowPenalties], vocab_size: int | None, device: str | torch.device
) -> SamplingPenalties:
    if vocab_size is None:
        raise ValueError("make_sampling_metadata(penalties=...) needs vocab_size")

    def padded(histories: list[list[int]]) -> torch.Tensor:
        width = max((len(history) for history in histories), default=0)
        table = torch.full((len(histories), width), vocab_size, dtype=torch.int64)
        for index, history in enumerate(histories):
            table[index, : len(history)] = torch.tensor(history, dtype=torch.int64)
        return table.to(device)

    def values(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r, name) for r in rows], dtype=torch.float32, device=device)

    return SamplingPenalties(
        presence_penalty=values("presence_penalty"),
        frequency_penalty=values("frequency_penalty"),
        repetition_penalty=values("repetition_penalty"),
        prompt_token_ids=padded([r.prompt_token_ids for r in rows]),
        output_token_ids=padded([r.output_token_ids for r in rows]),
    )


def reference_penalized_logits(logits: torch.Tensor, row: RowPenalties) -> torch.Tensor:
    """One row's logits after its penalties, the slow and obvious way (vLLM's meanings).

    Args:
        logits: ``[vocab]``.
        row: the penalties and token history.
    """
    result = logits.clone().double()
    for token_id in set(row.prompt_token_ids) | set(row.output_token_ids):
        value = result[token_id].item()
        penalty = row.repetition_penalty
        result[token_id] = value / penalty if value > 0 else value * penalty
    for token_id in set(row.output_token_ids):
        count = row.output_token_ids.count(token_id)
        result[token_id] -= row.frequency_penalty * count + row.presence_penalty
    return result


def distribution_logits() -> torch.Tensor:
    """``[8]`` float32 logits of :data:`PROBS` at :data:`POSITIONS`."""
    logits = torch.empty(8, dtype=torch.float32)
    logits[POSITIONS] = PROBS.log().float()
    return logits


def intended_distribution(
    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """``[8]`` float64: what sampling :func:`distribution_logits` with these settings gives."""
    probs = PROBS ** (1.0 / temperature)
    probs /= probs.sum()  # sorted descending, as PROBS is
    if min_p:
        probs[probs < min_p * probs[0]] = 0
        probs /= probs.sum()
    if top_k:
        probs[top_k:] = 0
        probs /= probs.sum()
    if top_p < 1.0:
        mass_before = probs.cumsum(0) - probs
        probs[mass_before >= top_p] = 0
        probs /= probs.sum()
    distribution = torch.empty(8, dtype=torch.float64)
    distribution[POSITIONS] = probs
    return distribution


class SamplerConformance(PluginConformance):
    """Conformance suite for ``register_samplers`` plugins.

    Capability flags (class attributes of the sampler): ``is_deterministic`` (seeded rows
    repeat, whatever else is in the batch), ``supports_top_k``, ``supports_top_p`` (unset
    means ``True``), ``supports_min_p`` and ``supports_penalties`` (unset means
    ``False``: a sampler must claim them).

    Attributes:
        num_draws: rows drawn for each distribution check.
        max_total_variation: largest allowed total variation distance.
        device: where logits live.
    """

    plugin_kind = "sampler"
    num_draws: ClassVar[int] = 4000
    max_total_variation: ClassVar[float] = 0.05
    device: ClassVar[str] = "cpu"
    is_deterministic: ClassVar[bool | None] = None
    supports_top_k: ClassVar[bool | None] = None
    supports_top_p: ClassVar[bool | None] = None
    supports_min_p: ClassVar[bool | None] = None
    supports_penalties: ClassVar[bool | None] = None
    capability_defaults: ClassVar[dict[str, bool]] = SAMPLER_CAPABILITY_DEFAULTS

    def check_interface(self, plugin_cls: Any) -> None:
        sampler = plugin_cls()
        assert callable(getattr(sampler, "sample", None)), f"{plugin_cls!r} has no sample()"

    @pytest.fixture
    def sampler(self, plugin_cls) -> Any:
        torch.manual_seed(1234)  # samplers may draw from the global generator
        return plugin_cls()

    def sample(self, sampler: Any, logits: torch.Tensor, **settings: Any) -> torch.Tensor:
        metadata = make_sampling_metadata(device=self.device, **settings)
        tokens = sampler.sample(logits.to(self.device), metadata)
        assert tokens.shape == (logits.shape[0],), f"sample() returned shape {tokens.shape}"
        return tokens.cpu()

    def draw(
        self, sampler: Any, temperature=1.0, top_k=0, top_p=1.0, **settings: Any
    ) -> torch.Tensor:
        """:attr:`num_draws` tokens sampled from :func:`distribution_logits` with these
        settings (``settings``: more :func:`make_sampling_metadata` arguments, per row)."""
        n = self.num_draws
        logits = distribution_logits().expand(n, -1).contiguous()
        return self.sample(
            sampler,
            logits,
            temperature=[temperature] * n,
            top_k=[top_k] * n,
            top_p=[top_p] * n,
            **settings,
        )

    def assert_distribution(self, tokens: torch.Tensor, intended: torch.Tensor) -> None:
        allowed = intended > 0
        observed = torch.bincount(tokens, minlength=8).double() / tokens.numel()
        forbidden = sorted(set(tokens[~allowed[tokens]].tolist()))
        assert not forbidden, f"sampled tokens {forbidden}, which the settings exclude"
        never = sorted(set(allowed.nonzero().flatten().tolist()) - set(tokens.tolist()))
        assert not never, f"never sampled the allowed tokens {never}"
        distance = 0.5 * (observed - intended).abs().sum().item()
        assert distance <= self.max_total_variation, (
            f"observed distribution {observed.tolist()} is {distance:.3f} (total variation) "
            f"from the intended {intended.tolist()}"
        )

    # ---- shapes and greedy -------------------------------------------------------------

    @pytest.mark.parametrize("vocab_size", [50, 32000])
    @pytest.mark.parametrize("rows", ["greedy", "mixed", "random"])
    def test_returns_one_int64_token_per_row(self, sampler, vocab_size, rows) -> None:
        temperature = {"greedy": [0.0] * 6, "mixed": [0.0, 1.0] * 3, "random": [0.7] * 6}[rows]
        logits = torch.randn(6, vocab_size)
        metadata = make_sampling_metadata(temperature, device=self.device)
        tokens = sampler.sample(logits.to(self.device), metadata)
        assert tokens.shape == (6,)
        assert tokens.dtype == torch.int64
        assert tokens.device.type == torch.device(self.device).type
        assert ((tokens >= 0) & (tokens < vocab_size)).all()

    def test_greedy_rows_pick_the_argmax(self, sampler) -> None:
        logits = torch.randn(16, 300)
        tokens = self.sample(sampler, logits, temperature=[0.0] * 16)
        assert torch.equal(tokens, logits.argmax(dim=-1))

    def test_greedy_rows_pick_the_argmax_beside_random_rows(self, sampler) -> None:
        logits = torch.randn(8, 300)
        temperature = [0.0, 1.0, 0.0, 1.5, 0.0, 0.5, 0.0, 1.0]
        # Top-k/top-p settings on greedy rows must not matter.
        top_k = [5, 0, 1, 3, 0, 0, 7, 2]
        top_p = [0.5, 0.9, 1.0, 1.0, 0.1, 1.0, 0.3, 1.0]
        tokens = self.sample(sampler, logits, temperature=temperature, top_k=top_k, top_p=top_p)
        greedy = [i for i, t in enumerate(temperature) if t == 0]
        assert torch.equal(tokens[greedy], logits.argmax(dim=-1)[greedy])

    # ---- distributions -----------------------------------------------------------------

    @pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
    def test_temperature_shapes_the_distribution(self, sampler, temperature) -> None:
        tokens = self.draw(sampler, temperature=temperature)
        self.assert_distribution(tokens, intended_distribution(temperature=temperature))

    @pytest.mark.parametrize("top_k", [1, 3])
    def test_top_k_keeps_only_the_k_most_likely(self, sampler, plugin_cls, top_k) -> None:
        self.require(plugin_cls, "supports_top_k")
        tokens = self.draw(sampler, top_k=top_k)
        self.assert_distribution(tokens, intended_distribution(top_k=top_k))

    @pytest.mark.parametrize("top_p", [0.25, 0.45, 0.75])
    def test_top_p_keeps_only_the_nucleus(self, sampler, plugin_cls, top_p) -> None:
        self.require(plugin_cls, "supports_top_p")
        tokens = self.draw(sampler, top_p=top_p)
        self.assert_distribution(tokens, intended_distribution(top_p=top_p))

    def test_each_row_follows_its_own_settings(self, sampler, plugin_cls) -> None:
        self.require(plugin_cls, "supports_top_k")
        self.require(plugin_cls, "supports_top_p")
        settings = [(1.0, 2, 1.0), (1.0, 0, 0.45), (0.5, 0, 1.0), (2.0, 4, 1.0)]
        n = self.num_draws
        rows = [settings[i % len(settings)] for i in range(n)]
        tokens = self.sample(
            sampler,
            distribution_logits().expand(n, -1).contiguous(),
            temperature=[t for t, _, _ in rows],
            top_k=[k for _, k, _ in rows],
            top_p=[p for _, _, p in rows],
        )
        for index, (temperature, top_k, top_p) in enumerate(settings):
            intended = intended_distribution(temperature, top_k, top_p)
            # Each quarter of the rows has a quarter of the draws: allow for the noise.
            row_tokens = tokens[index :: len(settings)]
            observed = torch.bincount(row_tokens, minlength=8).double() / row_tokens.numel()
            assert ((intended == 0) <= (observed == 0)).all(), (
                f"rows with temperature={temperature}, top_k={top_k}, top_p={top_p} sampled "
                f"excluded tokens: observed {observed.tolist()}"
            )
            distance = 0.5 * (observed - intended).abs().sum().item()
            assert distance <= 2 * self.max_total_variation, (
                f"rows with temperature={temperature}, top_k={top_k}, top_p={top_p}: observed "
                f"{observed.tolist()}, intended {intended.tolist()}"
            )

    # ---- seeds -------------------------------------------------------------------------

    @staticmethod
    def generators(seeds: dict[int, int]) -> dict[int, torch.Generator]:
        return {row: torch.Generator().manual_seed(seed) for row, seed in seeds.items()}

    def test_seeded_rows_repeat(self, sampler, plugin_cls) -> None:
        self.require(plugin_cls, "is_deterministic")
        logits = torch.zeros(8, 1000)  # flat: any token is as likely
        seeds = {row: 100 + row for row in range(8)}
        first = self.sample(
            sampler, logits, temperature=[1.0] * 8, generators=self.generators(seeds)
        )
        torch.manual_seed(999)  # the global generator must not matter
        again = self.sample(
            sampler, logits, temperature=[1.0] * 8, generators=self.generators(seeds)
        )
        assert torch.equal(first, again)
        assert len(set(first.tolist())) > 1, "eight seeds gave one token over 1000 equal ones"

    def test_seeded_row_does_not_depend_on_the_batch(self, sampler, plugin_cls) -> None:
        self.require(plugin_cls, "is_deterministic")
        row_logits = torch.randn(1000)
        alone = self.sample(
            sampler,
            row_logits[None],
            temperature=[1.0],
            generators=self.generators({0: 7}),
        )
        batch_logits = torch.randn(5, 1000)
        batch_logits[3] = row_logits
        in_batch = self.sample(
            sampler,
            batch_logits,
            temperature=[0.0, 1.0, 0.8, 1.0, 1.0],
            top_k=[0, 5, 0, 0, 0],
            generators=self.generators({3: 7, 4: 8}),
        )
        assert in_batch[3] == alone[0], "a seeded row's token changed with its batch"

    # ---- min-p and penalties -----------------------------------------------------------

    @pytest.mark.parametrize(("temperature", "min_p"), [(1.0, 0.35), (1.0, 0.6), (0.7, 0.5)])
    def test_min_p_drops_the_unlikely(self, sampler, plugin_cls, temperature, min_p) -> None:
        self.require(plugin_cls, "supports_min_p")
        tokens = self.draw(sampler, temperature=temperature, min_p=[min_p] * self.num_draws)
        self.assert_distribution(
            tokens, intended_distribution(temperature=temperature, min_p=min_p)
        )

    def test_penalties_change_greedy_rows_as_the_reference(self, sampler, plugin_cls) -> None:
        self.require(plugin_cls, "supports_penalties")
        generator = torch.Generator().manual_seed(5)
        vocab_size, num_rows = 64, 12
        # Small spread: the penalties below move the argmax in most rows.
        logits = torch.randn(num_rows, vocab_size, generator=generator) * 0.5
        rows = []
        for row in range(num_rows):
            history = torch.randint(0, vocab_size, (24,), generator=generator).tolist()
            top = int(logits[row].argmax())
            rows.append(
                RowPenalties(
                    prompt_token_ids=history[:12] + [top],
                    output_token_ids=history[12:] + [top, top],
                    presence_penalty=[0.0, 0.5, -0.5, 1.5][row % 4],
                    frequency_penalty=[0.0, 0.3, 1.0, -0.2][row % 3],
                    repetition_penalty=[1.0, 1.3, 2.0, 0.8][row % 4],
                )
            )
        rows[0] = RowPenalties()  # a row without penalties beside rows with them
        tokens = self.sample(
            sampler,
            logits,
            temperature=[0.0] * num_rows,
            penalties=rows,
            vocab_size=vocab_size,
        )
        expected = [
            int(reference_penalized_logits(logits[i], r).argmax()) for i, r in enumerate(rows)
        ]
        assert tokens.tolist() == expected
        assert expected != logits.argmax(dim=-1).tolist(), "the penalties changed nothing"

    def test_penalties_come_before_the_temperature(self, sampler, plugin_cls) -> None:
        self.require(plugin_cls, "supports_penalties")
        most_likely, second = int(POSITIONS[0]), int(POSITIONS[1])
        row = RowPenalties(
            prompt_token_ids=[second],
            output_token_ids=[most_likely, most_likely, second],
            presence_penalty=0.2,
            frequency_penalty=0.3,
            repetition_penalty=1.5,
        )
        temperature = 0.5
        tokens = self.draw(
            sampler, temperature=temperature, penalties=[row] * self.num_draws, vocab_size=8
        )
        penalized = reference_penalized_logits(distribution_logits(), row)
        self.assert_distribution(tokens, (penalized / temperature).softmax(dim=-1))
