"""StructuredOutputManager: the engine core's grammars: compiled off the step loop, cached,
asked for each step's token bitmask, and advanced by the sampled tokens.

The life of a request with ``structured_outputs`` (the scheduler drives it)::

    add_request ──> WAITING_FOR_FSM ──(grammar compiled on the pool)──> WAITING ─> RUNNING
                          └──(compilation failed)──> FINISHED_ERROR, with the reason

    each step: schedule() ─> bitmask rows of the structured requests that sample ─> workers
               update_from_output: matcher.accept_token(token); complete ─> FINISHED_STOPPED

Compilation runs on a small thread pool, so the step loop never waits for it (a loop with
nothing else to do waits for the first grammar, a few milliseconds at a time). Compiled
grammars are cached by ``(backend, kind, spec, after_reasoning)`` (the tokenizer is the
engine's own), the most recent :data:`GRAMMAR_CACHE_SIZE` of them. A grammar that starts
after the reasoning (``after_reasoning``) wraps the backend's in the markers' automaton,
whose tables are built once per markers, on the same threads
(:mod:`vlite.core.reasoning_grammar`). Backends are built on first use, with the
tokenizer loaded then: an engine that never sees a structured request loads neither.
A matcher's state is the request's output so far, which preemption keeps (only the KV cache
is recomputed), so resuming a preempted request needs nothing from here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from vlite.core.outputs import GrammarBitmask
from vlite.core.reasoning_grammar import (
    AfterReasoningGrammar,
    MarkerTables,
    marker_tables,
    token_texts,
)
from vlite.core.reasoning_parser import ReasoningMarkers
from vlite.core.structured_output import (
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputBackend,
    allocate_bitmask,
    check_backend_takes,
)
from vlite.core.structured_output_params import StructuredOutputsError, StructuredOutputsParams

logger = logging.getLogger(__name__)

#: Compiled grammars kept for reuse (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256
#: Threads compiling grammars (compilers release the GIL while they work).
COMPILE_THREADS = 2


class StructuredOutputRequest:
    """One request's grammar: compiling, then its matcher (or why it failed)."""

    def __init__(self, backend: str, compiled: Future[CompiledGrammar]) -> None:
        self.backend = backend
        self.compiled = compiled
        self.matcher: GrammarMatcher | None = None
        self.error: str | None = None
        self.started_at = time.monotonic()

    @property
    def is_compiled(self) -> bool:
        """Whether compilation has ended (with a grammar or an error)."""
        return self.compiled.done()

    def give_up_after(self, timeout_s: float) -> bool:
        """``True`` (with the error set) once compiling has taken over ``timeout_s``."""
        waited = time.monotonic() - self.started_at
        if self.is_compiled or waited <= timeout_s:
            return False
        self.error = (
            f"the {self.backend} grammar did not compile within {timeout_s:g} s "
            "(grammar_compile_timeout_s)"
        )
        return True

    def start_matching(self) -> bool:
        """Once compiled: make the matcher (``True``), or record the error (``False``)."""
        try:
            self.matcher = self.compiled.result().new_matcher()
        except Exception as exc:
            # The request fails, not the engine; the traceback goes to the log, as this may
            # be the backend's fault rather than the grammar's.
            logger.warning("the %s grammar could not be compiled", self.backend, exc_info=True)
            self.error = f"the {self.backend} grammar could not be compiled: {exc}"
            return False
        return True


class StructuredOutputManager:
    """Compiles, caches and queries the grammars of one engine core's requests.

    Args:
        backends: backend name -> class (the registry's ``structured_output_backend`` kind).
        default_backend: the name used when a request names none.
        load_tokenizer: returns the model's Hugging Face tokenizer (called once, lazily).
        vocab_size: the width of the model's logits (the bitmask's bits per row).
        compile_timeout_s: how long a request waits for its grammar before it fails (a
            compiler that never returns keeps its thread; the request does not wait on).
    """

    def __init__(
        self,
        backends: dict[str, type[StructuredOutputBackend]],
        default_backend: str,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        compile_timeout_s: float = 60.0,
    ) -> None:
        self.backend_classes = backends
        self.default_backend = default_backend
        #: Seconds a request waits for its grammar before it fails.
        self.compile_timeout_s = compile_timeout_s
        self.vocab_size = vocab_size
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future[CompiledGrammar]] = OrderedDict()
        self._marker_tables: dict[ReasoningMarkers, MarkerTables] = {}
        self._pool: ThreadPoolExecutor | None = None

    # ---- requests in ---------------------------------------------------------------

    def backend_name(self, params: StructuredOutputsParams) -> str:
        return params.backend or self.default_backend

    def check(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Refuse a request whose backend is unknown or does not handle its kind."""
        name = self.backend_name(params)
        backend_cls = self.backend_classes.get(name)
        if backend_cls is None:
            raise StructuredOutputsError(
                f"request {request_id!r}: structured-output backend {name!r} is not "
                f"registered; available: {', '.join(sorted(self.backend_classes)) or '(none)'}",
                "structured_outputs.backend",
            )
        check_backend_takes(name, backend_cls, params)

    def start(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """Begin (or reuse) the compilation of ``params``'s grammar."""
        name = self.backend_name(params)
        key = (name, *params.key, params.after_reasoning)
        future = self._cache.get(key)
        if future is None:
            future = self._compile_pool().submit(self._compile, name, params)
            self._cache[key] = future
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return StructuredOutputRequest(name, future)

    def _compile_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="vlite-grammar")
        return self._pool

    def _compile(self, name: str, params: StructuredOutputsParams) -> CompiledGrammar:
        grammar = self._backend(name).compile(params)
        if params.after_reasoning is None:
            return grammar
        return AfterReasoningGrammar(grammar, self._tables(params.after_reasoning))

    def _tables(self, markers: ReasoningMarkers) -> MarkerTables:
        """The automaton of ``markers`` over this engine's tokens (built once)."""
        with self._backend_lock:
            tables = self._marker_tables.get(markers)
            if tables is None:
                texts = token_texts(self._loaded_tokenizer(), self.vocab_size)
                tables = marker_tables(markers, texts, self.vocab_size)
                self._marker_tables[markers] = tables
            return tables

    def _loaded_tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _backend(self, name: str) -> StructuredOutputBackend:
        with self._backend_lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = self.backend_classes[name](self._loaded_tokenizer(), self.vocab_size)
                self._backends[name] = backend
            return backend

    @staticmethod
    def wait_for_any(requests: list[StructuredOutputRequest], timeout_s: float) -> None:
        """Block until one of ``requests`` has compiled, or ``timeout_s`` passed."""
        pending = [request.compiled for request in requests if not request.is_compiled]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # ---- each step -----------------------------------------------------------------

    def grammar_bitmask(
        self,
        rows: list[tuple[str, StructuredOutputRequest]],
        drafts: dict[str, list[int]] | None = None,
    ) -> GrammarBitmask | None:
        """The bitmask of the structured requests that sample this step, in the given order
        (``(request_id, its grammar)``); ``None`` for none. A request verifying ``drafts``
        gets one row per draft and one more: row ``i`` after its first ``i`` drafts (the
        grammar walks them and rolls back; the drafts must be ones it accepts)."""
        if not rows:
            return None
        drafts = drafts or {}
        request_ids = [
            request_id for request_id, _ in rows for _ in range(len(drafts.get(request_id, ())) + 1)
        ]
        bitmask = allocate_bitmask(len(request_ids), self.vocab_size)
        row = 0
        for request_id, request in rows:
            matcher = request.matcher
            own = drafts.get(request_id, ())
            matcher.fill_bitmask(bitmask, row)
            for index, token in enumerate(own):
                if not matcher.accept_token(token):
                    raise RuntimeError(
                        f"request {request_id!r}: its grammar refuses draft {token} at position "
                        f"{index} (drafts are cut where the grammar refuses them)"
                    )
                matcher.fill_bitmask(bitmask, row + index + 1)
            matcher.rollback(len(own))
            row += len(own) + 1
        data = np.ascontiguousarray(bitmask.numpy()).tobytes()
        return GrammarBitmask(request_ids, data)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
