"""Structured outputs in the core scheduler, with a toy grammar backend: the
``WAITING_FOR_FSM`` state while a grammar compiles, the bitmask rows of the requests that
sample, termination by the grammar, compile failures, forbidden tokens, and preemption."""

from __future__ import annotations

import threading
import time

import pytest

from vlite.core.request import RequestStatus
from vlite.core.structured_output import allowed_tokens
from vlite.core.structured_output_manager import StructuredOutputManager
from vlite.core.structured_output_params import StructuredOutputsParams
from vlite.plugins.schedulers.fcfs import FcfsPolicy
from vlite.testing.scheduler_driver import SchedulerDriver

VOCAB = 64
EOS = 2


class SequenceMatcher:
    """Accepts exactly one of some token sequences; terminated once one is complete."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences
        self.accepted: list[int] = []

    def _next_tokens(self) -> set[int]:
        n = len(self.accepted)
        return {s[n] for s in self.sequences if s[:n] == self.accepted and len(s) > n}

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self._next_tokens():
            return False
        self.accepted.append(token_id)
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:
        bitmask[row] = 0
        for token in self._next_tokens():
            bitmask[row, token // 32] |= 1 << (token % 32)

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def is_terminated(self) -> bool:
        return self.accepted in self.sequences and not self._next_tokens()


class SequenceBackend:
    """``choice=["5 6 7", "5 8"]``: the outputs are those token sequences."""

    compiled_specs: list[str] = []
    gate = threading.Event()

    def __init__(self, tokenizer, vocab_size: int) -> None:
        assert tokenizer == "tokenizer" and vocab_size == VOCAB

    @classmethod
    def validate(cls, params) -> None:
        pass

    def compile(self, params):
        assert self.gate.wait(10), "the test never opened the gate"
        self.compiled_specs.append(params.spec)
        if params.kind != "choice":
            raise ValueError(f"the sequence backend takes choices, not {params.kind}")
        sequences = [[int(t) for t in choice.split()] for choice in params.choice]

        class Compiled:
            def new_matcher(self):
                return SequenceMatcher(sequences)

        return Compiled()


@pytest.fixture(autouse=True)
def open_gate():
    SequenceBackend.gate.set()
    SequenceBackend.compiled_specs = []
    yield
    SequenceBackend.gate.set()


def grammar_follower(request) -> int:
    """A fake model that samples the lowest token the request's grammar allows (EOS
    without a grammar or when nothing is allowed)."""
    from vlite.core.structured_output import allocate_bitmask

    grammar = request.structured_output
    if grammar is None:
        return 40 + request.num_output_tokens
    bitmask = allocate_bitmask(1, VOCAB)
    grammar.matcher.fill_bitmask(bitmask, 0)
    allowed = allowed_tokens(bitmask[0], VOCAB).nonzero().flatten().tolist()
    return allowed[0] if allowed else EOS


def make_driver(next_token=grammar_follower, **settings) -> SchedulerDriver:
    manager = StructuredOutputManager(
        {"sequence": SequenceBackend}, "sequence", lambda: "tokenizer", VOCAB
    )
    return SchedulerDriver.create(
        FcfsPolicy, next_token=next_token, structured_outputs=manager, **settings
    )


def choice(*sequences: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=list(sequences))


def wait_compiled(driver: SchedulerDriver) -> None:
    for request in driver.scheduler.waiting_for_fsm:
        request.structured_output.compiled.exception(timeout=10)


def test_a_request_waits_for_its_grammar_while_others_run():
    driver = make_driver()
    SequenceBackend.gate.clear()
    structured = driver.add("s", [1, 3, 4], max_tokens=8, structured_outputs=choice("5 6 7"))
    driver.add("plain", [1, 3], max_tokens=2)

    first = driver.step()

    assert set(first.scheduler_output.num_scheduled_tokens) == {"plain"}
    assert structured.status is RequestStatus.WAITING_FOR_FSM
    assert first.scheduler_output.grammar_bitmask is None  # no structured row yet
    SequenceBackend.gate.set()
    wait_compiled(driver)
    second = driver.step()
    assert "s" in second.scheduler_output.num_scheduled_tokens
    assert structured.status is RequestStatus.RUNNING


def test_the_grammar_ends_the_request_with_stop_before_max_tokens():
    driver = make_driver()
    driver.add("s", [1, 3, 4], max_tokens=10, structured_outputs=choice("5 6 7"))
    wait_compiled(driver)

    driver.run()

    assert driver.outputs["s"] == [5, 6, 7]
    assert driver.finish_reasons["s"] == "stop"


def test_bitmask_rows_are_the_structured_requests_that_sample_this_step():
    driver = make_driver(
        max_num_batched_tokens=4, enable_chunked_prefill=True, enable_prefix_caching=False
    )
    driver.add("s", list(range(10, 20)), max_tokens=4, structured_outputs=choice("5 8", "5 6"))
    driver.add("plain", [1, 3], max_tokens=4)
    wait_compiled(driver)

    rows = []
    for step in driver.run():
        bitmask = step.scheduler_output.grammar_bitmask
        rows.append(None if bitmask is None else bitmask.request_ids)

    # prompt chunks of 4, 4, then the last 2 (which samples), then decodes until "5 6"
    assert rows[:2] == [None, None]
    assert rows[2] == ["s"]
    assert driver.outputs["s"] == [5, 6] and driver.finish_reasons["s"] == "stop"
    assert all(row in (None, ["s"]) for row in rows)  # "plain" never gets a row


def test_the_bitmask_row_holds_the_grammar_s_next_tokens():
    driver = make_driver()
    driver.add("s", [1, 3, 4], max_tokens=8, structured_outputs=choice("5 6", "5 9", "7"))
    wait_compiled(driver)
    import numpy as np

    steps = [driver.step(), driver.step()]

    def allowed(step) -> list[int]:
        data = np.frombuffer(step.scheduler_output.grammar_bitmask.data, dtype=np.int32)
        import torch

        return allowed_tokens(torch.from_numpy(data.copy()), VOCAB).nonzero().flatten().tolist()

    assert allowed(steps[0]) == [5, 7]
    assert allowed(steps[1]) == [6, 9]  # after 5


def test_equal_constraints_compile_once():
    driver = make_driver()
    for index in range(3):
        driver.add(f"s{index}", [1, 3], max_tokens=4, structured_outputs=choice("5 6"))
    wait_compiled(driver)

    driver.run()

    assert SequenceBackend.compiled_specs == ['["5 6"]']
    assert [driver.outputs[f"s{i}"] for i in range(3)] == [[5, 6]] * 3


def test_a_grammar_that_fails_to_compile_fails_its_request_alone():
    driver = make_driver()
    driver.add("bad", [1, 3], max_tokens=4, structured_outputs={"regex": "[0-9]+"})
    driver.add("plain", [1, 3], max_tokens=2)
    wait_compiled(driver)

    so = driver.scheduler.schedule()
    failures = driver.scheduler.take_failures()

    assert [(f.request_id, f.is_invalid_request) for f in failures] == [("bad", True)]
    assert "the sequence backend takes choices, not regex" in failures[0].message
    assert "bad" not in driver.scheduler.requests and "bad" in so.finished_request_ids
    assert driver.kv_cache.block_ids_of("bad") == []


def test_a_token_the_grammar_forbids_fails_the_request_as_an_engine_error():
    driver = make_driver(next_token=lambda request: 9)  # ignores every mask
    driver.add("s", [1, 3], max_tokens=4, structured_outputs=choice("5 6"))
    wait_compiled(driver)
    so = driver.scheduler.schedule()
    from vlite.core.outputs import ModelRunnerOutput

    outputs = driver.scheduler.update_from_output(so, ModelRunnerOutput({"s": [9]}))

    assert outputs.outputs == []
    (failure,) = outputs.failures
    assert failure.request_id == "s" and not failure.is_invalid_request
    assert "token 9 was sampled, but the request's grammar does not allow it" in failure.message
    assert "s" not in driver.scheduler.requests
    assert driver.kv_cache.num_free_blocks == driver.kv_cache.num_blocks


def test_aborting_a_request_whose_grammar_compiles_removes_it():
    driver = make_driver()
    SequenceBackend.gate.clear()
    driver.add("s", [1, 3], max_tokens=4, structured_outputs=choice("5 6"))

    driver.abort(["s"])

    assert driver.scheduler.waiting_for_fsm == [] and driver.scheduler.requests == {}
    SequenceBackend.gate.set()


def test_preempted_structured_requests_resume_where_their_grammar_was():
    # 6 blocks of 4 tokens: the requests cannot all hold their blocks, so some are preempted
    driver = make_driver(num_blocks=6, block_size=4)
    for index in range(4):
        driver.add(
            f"s{index}",
            [1, 3, 4, 10 + index, 11, 12, 13],
            max_tokens=12,
            structured_outputs=choice("5 6 7 8 9 10 11 12 13 14"),
        )
    wait_compiled(driver)

    driver.run()

    assert driver.preempted_ids, "the test must preempt"
    for index in range(4):
        assert driver.outputs[f"s{index}"] == list(range(5, 15))
        assert driver.finish_reasons[f"s{index}"] == "stop"


def test_requests_waiting_for_their_grammar_count_as_waiting():
    driver = make_driver()
    SequenceBackend.gate.clear()
    driver.add("s", [1, 3], max_tokens=4, structured_outputs=choice("5 6"))
    driver.add("plain", [1, 3], max_tokens=2)

    first = driver.step()

    assert driver.scheduler.num_waiting_requests == 1
    assert driver.scheduler.last_step_stats.num_waiting_requests == 1
    assert set(first.scheduler_output.num_scheduled_tokens) == {"plain"}
    SequenceBackend.gate.set()


def test_a_grammar_that_takes_too_long_fails_its_request():
    driver = make_driver()
    driver.scheduler.structured_outputs.compile_timeout_s = 0.05
    SequenceBackend.gate.clear()  # the compiler hangs
    driver.add("slow", [1, 3], max_tokens=4, structured_outputs=choice("5 6"))
    driver.add("plain", [1, 3], max_tokens=2)
    time.sleep(0.1)

    so = driver.scheduler.schedule()
    failures = driver.scheduler.take_failures()

    assert [(f.request_id, f.is_invalid_request) for f in failures] == [("slow", True)]
    assert "did not compile within 0.05 s (grammar_compile_timeout_s)" in failures[0].message
    assert set(so.num_scheduled_tokens) == {"plain"} and "slow" not in driver.scheduler.requests
    SequenceBackend.gate.set()
