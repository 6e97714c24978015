"""LogitsProcessorConformance: untouched rows, batch invariance, state that follows the
batch, and logits that keep their shape, dtype and device without gaining a NaN.

Every check compares a row's edit with its *reference*: what a fresh processor, which has
never seen another request, does to that row alone in a batch of one, given the same
tokens. A processor whose edit of a row depends on anything but that row's logits and
request (other rows, the row's position, requests gone, a stale copy of the tokens) fails
one of them. The requests come from :attr:`LogitsProcessorConformance.active_params`
(requests that use the processor) and ``inactive_params`` (requests that do not); each
request's tokens are ``prompt_token_ids`` followed by the first few ``output_token_ids``.

A processor that claims ``follows_drafts`` is checked on steps that verify drafts: each row
after drafts must get the edit of its request with those drafts appended. The cost
contract is checked too: a step in which no row uses the processor must run no
tensor operation at all (:class:`TensorWorkRecorder` watches for them) and hand the logits
back as they came.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vlite.core.config import VliteConfig
from vlite.core.logits_processor import AddedRequest, BatchUpdate
from vlite.core.sampling_params import SamplingParams
from vlite.testing.conformance.base import PluginConformance


def describe(params: SamplingParams) -> str:
    """``SamplingParams(...)`` with only the fields that differ from the defaults."""
    default = SamplingParams()
    changed = [
        f"{field.name}={getattr(params, field.name)!r}"
        for field in dataclasses.fields(params)
        if getattr(params, field.name) != getattr(default, field.name)
    ]
    return f"SamplingParams({', '.join(changed)})"


class TensorWorkRecorder(TorchDispatchMode):
    """Records every tensor operation (ATen op: a tensor built, copied, indexed or computed
    on) run inside ``with TensorWorkRecorder() as recorder:``, in :attr:`ops`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@dataclass
class RequestCase:
    """A request the suite feeds a processor.

    Attributes:
        request_id: its id.
        params: its sampling parameters.
        token_ids: prompt then output: the live list the processor is given (the suite
            appends output tokens to it).
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        logits: ``[vocab_size]`` float32: its row's logits, in whatever batch and row.
    """

    request_id: str
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    logits: torch.Tensor

    def added(self, eos_token_id: int | None) -> AddedRequest:
        return AddedRequest(
            self.request_id, self.params, self.token_ids, self.num_prompt_tokens, eos_token_id
        )


class LogitsProcessorConformance(PluginConformance):
    """Conformance suite for ``register_logits_processors`` plugins.

    Attributes:
        active_params: requests that use the processor (each must change its row in some
            step; the suite checks that). Default: the processor class's own
            ``active_params`` attribute (vlite's built-ins set one); a processor that reads
            its key of ``extra_args`` would list e.g.
            ``[SamplingParams(extra_args={"my-key": 2})]``.
        inactive_params: requests that do not use it (their rows must stay untouched).
        vocab_size: the width of the logits.
        device: where the logits live.
        eos_token_id: the requests' end-of-sequence token.
        prompt_token_ids: every request's prompt.
        output_token_ids: the output tokens a request accumulates, in order, one a step.
        atol: how far a row's edit may stray from its reference (0: bit-identical).
    """

    plugin_kind = "logits_processor"
    active_params: ClassVar[Sequence[SamplingParams] | None] = None
    inactive_params: ClassVar[Sequence[SamplingParams]] = (
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=5, max_tokens=8, stop_token_ids=[3]),
        SamplingParams(temperature=0.0, ignore_eos=True, extra_args={"unrelated-key": 1}),
    )
    vocab_size: ClassVar[int] = 64
    device: ClassVar[str] = "cpu"
    eos_token_id: ClassVar[int | None] = 2
    prompt_token_ids: ClassVar[tuple[int, ...]] = (1, 2, 3, 4)
    output_token_ids: ClassVar[tuple[int, ...]] = (4, 9, 3, 4, 5, 1, 7, 4, 9)
    atol: ClassVar[float] = 0.0

    def check_interface(self, plugin_cls: Any) -> None:
        processor = plugin_cls(VliteConfig(), torch.device(self.device), self.vocab_size)
        for method in ("update_state", "apply"):
            assert callable(getattr(processor, method, None)), f"{plugin_cls!r} has no {method}()"

    @pytest.fixture(scope="class")
    @classmethod
    def processor_config(cls) -> VliteConfig:
        return VliteConfig()

    @pytest.fixture(scope="class")
    @classmethod
    def examples(cls, plugin_cls) -> list[SamplingParams]:
        """The requests that use the processor: :attr:`active_params`, else the class's."""
        params = cls.active_params
        if params is None:
            params = getattr(plugin_cls, "active_params", None)
        if not params:
            raise pytest.UsageError(
                f"{cls.__name__} must set active_params to SamplingParams that use the "
                f"logits processor under test (or its class must have an active_params list)"
            )
        return list(params)

    @pytest.fixture
    def new_processor(self, plugin_cls, processor_config):
        """``new_processor()``: a fresh instance, as a worker builds it."""

        def new() -> Any:
            return plugin_cls(processor_config, torch.device(self.device), self.vocab_size)

        return new

    # ---- the requests and steps ----------------------------------------------------------

    def request(self, request_id: str, params: SamplingParams, num_output: int = 0) -> RequestCase:
        """A request with the first ``num_output`` of :attr:`output_token_ids`, and random
        logits of its own (the same for the same id)."""
        generator = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
        logits = torch.randn(self.vocab_size, generator=generator) * 4
        tokens = [*self.prompt_token_ids, *self.output_token_ids[:num_output]]
        return RequestCase(request_id, params, tokens, len(self.prompt_token_ids), logits)

    def mixed_requests(self, examples: list[SamplingParams]) -> list[RequestCase]:
        """Every example twice (with different outputs so far) and every inactive request,
        interleaved."""
        active = [
            self.request(f"active-{i}-{copy}", params, num_output=3 * copy + i)
            for copy in range(2)
            for i, params in enumerate(examples)
        ]
        inactive = [
            self.request(f"inactive-{i}", params) for i, params in enumerate(self.inactive_params)
        ]
        mixed = []
        for index in range(max(len(active), len(inactive))):
            mixed += active[index : index + 1] + inactive[index : index + 1]
        return mixed

    def step(
        self,
        processor: Any,
        rows: Sequence[RequestCase],
        added: Sequence[RequestCase] = (),
        removed: Sequence[str] = (),
        drafts_before: Sequence[list[int]] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: ``update_state`` with the changes, ``rows`` and the drafts each row
        follows, then ``apply`` to the rows' logits. Returns ``(returned, given)``: what
        ``apply`` returned, and the logits it was handed (the same tensor object, if edited
        in place)."""
        processor.update_state(
            BatchUpdate(
                added=[case.added(self.eos_token_id) for case in added],
                removed=list(removed),
                rows=[case.request_id for case in rows],
                drafts_before=list(drafts_before),
            )
        )
        logits = torch.stack([case.logits for case in rows]).to(self.device)
        returned = processor.apply(logits)
        self.check_logits(returned, len(rows))
        return returned, logits

    def check_logits(self, returned: Any, num_rows: int) -> None:
        """``apply`` returned ``[num_rows, vocab_size]`` float32 on the device, NaN-free."""
        assert isinstance(returned, torch.Tensor), f"apply() returned {type(returned)}"
        assert returned.shape == (num_rows, self.vocab_size)
        assert returned.dtype == torch.float32
        assert returned.device.type == torch.device(self.device).type
        assert not returned.isnan().any(), "apply() introduced NaN"

    def reference(self, new_processor, case: RequestCase) -> torch.Tensor:
        """``[vocab_size]``: the edit of ``case``'s row by a fresh processor, alone."""
        alone = RequestCase(
            case.request_id, case.params, list(case.token_ids), case.num_prompt_tokens, case.logits
        )
        returned, _ = self.step(new_processor(), [alone], added=[alone])
        return returned[0].cpu()

    def assert_rows_match_references(
        self, new_processor, rows: Sequence[RequestCase], returned: torch.Tensor, where: str
    ) -> None:
        for row, case in enumerate(rows):
            actual, expected = returned[row].cpu(), self.reference(new_processor, case)
            close = (actual == expected) | ((actual - expected).abs() <= self.atol)
            columns = (~close).nonzero().flatten()[:6]
            assert not len(columns), (
                f"{where}: row {row} ({case.request_id}, {describe(case.params)}, tokens "
                f"{case.token_ids}) differs from the same request's edit alone at token ids "
                f"{columns.tolist()}: {actual[columns].tolist()} instead of "
                f"{expected[columns].tolist()}"
            )

    def assert_untouched(
        self, returned: torch.Tensor, rows: Sequence[RequestCase], where: str = ""
    ) -> None:
        """Every row of ``rows`` (requests that do not use the processor) is unchanged."""
        for row, case in enumerate(rows):
            self.assert_row_untouched(returned, row, case, where)

    def assert_row_untouched(
        self, returned: torch.Tensor, row: int, case: RequestCase, where: str = ""
    ) -> None:
        assert torch.equal(returned[row].cpu(), case.logits), (
            f"{where}row {row} ({case.request_id}, {describe(case.params)}) does not use the "
            f"processor, but apply() changed it"
        )

    # ---- the examples --------------------------------------------------------------------

    def test_active_params_change_their_rows(self, new_processor, examples) -> None:
        """Each example edits its row in some step (else the other checks prove nothing)."""
        for index, params in enumerate(examples):
            changed = False
            for num_output in range(len(self.output_token_ids) + 1):
                case = self.request(f"example-{index}", params, num_output)
                changed |= not torch.equal(self.reference(new_processor, case), case.logits)
            assert changed, (
                f"active_params[{index}] ({describe(params)}) never changed its row: list "
                f"SamplingParams that use the processor in active_params"
            )

    # ---- rows of requests that do not use it ---------------------------------------------

    def test_rows_of_other_requests_are_untouched(self, new_processor, examples) -> None:
        processor = new_processor()
        rows = self.mixed_requests(examples)
        for step in range(3):
            returned, _ = self.step(processor, rows, added=rows if step == 0 else ())
            for row, case in enumerate(rows):
                if case.request_id.startswith("inactive"):
                    self.assert_row_untouched(returned, row, case, f"step {step}: ")
            for case in rows:
                case.token_ids.append(self.output_token_ids[step])

    def test_a_step_without_its_requests_does_no_tensor_work(self, new_processor, examples):
        """The cost contract: no tensor operation in ``update_state`` or ``apply`` when no
        row uses the processor, and the logits are handed back as they came."""
        processor = new_processor()
        inactive = [self.request(f"plain-{i}", p) for i, p in enumerate(self.inactive_params)]
        self.assert_no_tensor_work(processor, inactive, added=inactive, when="no request uses it")
        earlier = self.request("sampled-earlier", examples[0])
        self.step(processor, [*inactive, earlier], added=[earlier])
        self.assert_no_tensor_work(
            processor, inactive, when="its only request has no row this step"
        )

    def assert_no_tensor_work(
        self,
        processor: Any,
        rows: list[RequestCase],
        added: Sequence[RequestCase] = (),
        removed: Sequence[str] = (),
        when: str = "",
    ) -> None:
        logits = torch.stack([case.logits for case in rows]).to(self.device)
        update = BatchUpdate(
            added=[case.added(self.eos_token_id) for case in added],
            removed=list(removed),
            rows=[case.request_id for case in rows],
        )
        with TensorWorkRecorder() as recorder:
            processor.update_state(update)
            returned = processor.apply(logits)
        assert not recorder.ops, (
            f"{when}, yet update_state()/apply() ran tensor operations {recorder.ops[:8]}: "
            f"a step that uses no processor must cost nothing"
        )
        assert returned is logits, f"{when}, yet apply() returned another tensor"
        self.assert_untouched(returned, rows)

    # ---- batch invariance ----------------------------------------------------------------

    @pytest.mark.parametrize("order", ["as-listed", "reversed", "rotated"])
    def test_a_row_gets_the_same_edit_alone_and_in_any_batch(
        self, new_processor, examples, order
    ) -> None:
        rows = self.mixed_requests(examples)
        if order == "reversed":
            rows.reverse()
        elif order == "rotated":
            rows = rows[3:] + rows[:3]
        returned, _ = self.step(new_processor(), rows, added=rows)
        self.assert_rows_match_references(new_processor, rows, returned, f"{order} batch")

    def test_rows_follow_the_batch_from_step_to_step(self, new_processor, examples) -> None:
        """Requests change rows, and skip steps (a prefill chunk samples nothing)."""
        processor = new_processor()
        everyone = self.mixed_requests(examples)
        self.step(processor, everyone, added=everyone)
        active = [case for case in everyone if case.request_id.startswith("active")]
        steps = {
            "reversed": everyone[::-1],
            "every other row": everyone[1::2],
            "one request of each use": [active[-1], everyone[1]],
            "rotated": everyone[2:] + everyone[:2],
        }
        for name, rows in steps.items():
            returned, _ = self.step(processor, rows)
            self.assert_rows_match_references(new_processor, rows, returned, f"step {name!r}")
        processor.update_state(BatchUpdate(rows=[]))  # a step that samples no row
        returned, _ = self.step(processor, everyone)
        self.assert_rows_match_references(new_processor, everyone, returned, "after a gap")

    def test_rows_after_drafts_get_the_edit_of_their_context(
        self, plugin_cls, new_processor, examples
    ) -> None:
        """A processor that claims ``follows_drafts``: in a step where every other request
        verifies drafts (``k + 1`` consecutive rows), its ``i``-th row gets the edit the
        request gets alone with its first ``i`` drafts appended to its tokens."""
        if not getattr(plugin_cls, "follows_drafts", False):
            pytest.skip("the processor does not claim follows_drafts")
        processor = new_processor()
        requests = self.mixed_requests(examples)
        self.step(processor, requests, added=requests)
        drafts = list(self.output_token_ids[:3])
        rows, contexts, drafts_before = [], [], []
        for index, case in enumerate(requests):
            own = drafts if index % 2 == 0 else []
            for position in range(len(own) + 1):
                logits = self.request(f"{case.request_id}#{position}", case.params).logits
                row = dataclasses.replace(case, logits=logits)
                rows.append(row)
                contexts.append(dataclasses.replace(row, token_ids=row.token_ids + own[:position]))
                drafts_before.append(own[:position])
        returned, _ = self.step(processor, rows, drafts_before=drafts_before)
        self.assert_rows_match_references(new_processor, contexts, returned, "rows after drafts")

    # ---- state that follows the batch ----------------------------------------------------

    def test_a_removed_request_leaves_no_trace(self, new_processor, examples) -> None:
        processor = new_processor()
        gone = [self.request(f"gone-{i}", params) for i, params in enumerate(examples)]
        plain = self.request("plain", self.inactive_params[0])
        self.step(processor, [*gone, plain], added=[*gone, plain])
        ids = [case.request_id for case in gone]
        self.assert_no_tensor_work(
            processor, [plain], removed=ids, when="every request that used it was removed"
        )
        # New requests that do not use the processor take the removed ids.
        reused = [self.request(case.request_id, self.inactive_params[0]) for case in gone]
        returned, _ = self.step(processor, [plain, *reused], added=reused)
        self.assert_untouched(returned, [plain, *reused])

    @pytest.mark.parametrize("when", ["later-update", "same-update"])
    def test_a_removed_id_can_come_back_as_a_new_request(
        self, new_processor, examples, when
    ) -> None:
        processor = new_processor()
        first = [self.request(f"id-{i}", params) for i, params in enumerate(examples)]
        plain = self.request("plain", self.inactive_params[0])
        self.step(processor, [plain, *first], added=[plain, *first])
        ids = [case.request_id for case in first]
        # The same ids, each with another example's params and some output already.
        again = [
            self.request(request_id, examples[(i + 1) % len(examples)], num_output=3)
            for i, request_id in enumerate(ids)
        ]
        if when == "later-update":
            processor.update_state(BatchUpdate(removed=ids, rows=[]))  # a step without rows
            returned, _ = self.step(processor, [*again, plain], added=again)
        else:
            returned, _ = self.step(processor, [*again, plain], added=again, removed=ids)
        where = f"ids reused ({when})"
        self.assert_rows_match_references(new_processor, [*again, plain], returned, where)

    def test_output_tokens_appended_to_the_live_list_are_seen(
        self, new_processor, examples
    ) -> None:
        processor = new_processor()
        growing = [self.request(f"growing-{i}", params) for i, params in enumerate(examples)]
        plain = self.request("plain", self.inactive_params[0])
        rows = [plain, *growing]
        for step, token_id in enumerate((*self.output_token_ids, None)):
            returned, _ = self.step(processor, rows, added=rows if step == 0 else ())
            where = f"after {step} output tokens"
            self.assert_rows_match_references(new_processor, rows, returned, where)
            if token_id is not None:
                for case in growing:
                    case.token_ids.append(token_id)  # what the model runner does

    # ---- the logits ----------------------------------------------------------------------

    def test_keeps_shape_dtype_and_device_and_adds_no_nan(self, new_processor, examples) -> None:
        processor = new_processor()
        rows = self.mixed_requests(examples)
        for case in rows:  # extreme logits: huge, tiny, and ties
            case.logits[:4] = torch.tensor([3e38, -3e38, 0.0, 0.0])
        for step in range(3):
            returned, given = self.step(processor, rows, added=rows if step == 0 else ())
            assert returned.shape == given.shape and returned.dtype == given.dtype
            assert returned.device == given.device
            for case in rows:
                case.token_ids.append(self.output_token_ids[step])

    def test_an_argmax_invariance_claim_holds(self, new_processor, examples) -> None:
        processor = new_processor()
        claims = getattr(processor, "is_argmax_invariant", lambda: False)()
        if not claims:
            pytest.skip("the processor does not claim is_argmax_invariant()")
        rows = self.mixed_requests(examples)
        returned, _ = self.step(processor, rows, added=rows)
        before = torch.stack([case.logits for case in rows]).argmax(dim=-1)
        assert torch.equal(returned.cpu().argmax(dim=-1), before), (
            "is_argmax_invariant() is True, yet apply() changed a row's argmax"
        )
