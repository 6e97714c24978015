"""Shared helpers for the core tests: a scheduler driven by a fake model.

``make_engine`` builds a :class:`vlite.testing.scheduler_driver.SchedulerDriver` (the
driver plugin authors use, which checks the limits, the worker-side state and the block
accounting every step) whose fake model emits 1000, 1001, ... for each request, so tests
can state the exact tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vlite.core.request import Request
from vlite.plugins.schedulers.fcfs import FcfsPolicy
from vlite.testing.scheduler_driver import SchedulerDriver

#: Fake "sampled" tokens start here, far from any EOS or prompt token used in the tests.
FIRST_FAKE_TOKEN = 1000


def next_fake_token(request: Request) -> int:
    """The core tests' fake model: emits 1000, 1001, ... for each request."""
    return FIRST_FAKE_TOKEN + request.num_output_tokens


@pytest.fixture
def make_engine() -> Callable[..., SchedulerDriver]:
    """Factory: ``make_engine(num_blocks=.., block_size=.., max_num_seqs=.., ...)`` (the
    keywords of ``SchedulerDriver.create``; ``scheduler_cls`` defaults to FCFS)."""

    def factory(
        scheduler_cls: type = FcfsPolicy,
        next_token: Callable[[Request], int] = next_fake_token,
        **settings,
    ) -> SchedulerDriver:
        return SchedulerDriver.create(scheduler_cls, next_token=next_token, **settings)

    return factory
