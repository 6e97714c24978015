"""PendingStep: the future of a step the ranks are computing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from vlite.core.outputs import ModelRunnerOutput


class PendingStep(Future):
    """A step in flight; its output is collected when it is first asked for.

    :meth:`result` and :meth:`exception` wait for every rank's reply (so a failure on any
    rank surfaces there, as the executor's error) and then behave as a completed future's.
    No thread completes it in the background: wait on it with those two, not with
    ``concurrent.futures.wait``, whose waits it would never wake. Steps complete in
    submission order (each rank's actor runs its calls in order).

    Args:
        collect: waits for the replies and returns the step's output (or raises).
    """

    def __init__(self, collect: Callable[[], ModelRunnerOutput]) -> None:
        super().__init__()
        self._collect = collect
        self._collect_lock = threading.Lock()

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self._complete()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._complete()
        return super().exception(timeout)

    def _complete(self) -> None:
        with self._collect_lock:
            if self.done():
                return
            try:
                output = self._collect()
            except BaseException as exc:
                self.set_exception(exc)
            else:
                self.set_result(output)
