"""StructuredOutputRequest: a grammar that fails to compile fails its request, logged."""

from __future__ import annotations

import logging
from concurrent.futures import Future

from vlite.core.structured_output_manager import StructuredOutputRequest


def test_a_compile_failure_fails_the_request_and_logs_its_traceback(caplog):
    compiled: Future = Future()
    compiled.set_exception(RuntimeError("the backend broke"))
    request = StructuredOutputRequest("demo", compiled)

    with caplog.at_level(logging.WARNING, logger="vlite.core.structured_output_manager"):
        assert request.start_matching() is False

    assert request.error == "the demo grammar could not be compiled: the backend broke"
    [record] = caplog.records
    assert "demo grammar could not be compiled" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
