"""Replaying recorded C kernel calls in one call from Python (see ``call_replay.c``).

:func:`compile_replay` turns the :class:`~vlite.kernels.native.RecordedCall` list of a
recorded forward into a ``replay(threads)`` callable that walks the list in C: one ctypes
call per step instead of one per kernel (each of which converts its arguments again). It
falls back to calling the list from Python where the C path does not apply: another
platform than x86-64 Linux, a kernel argument of another type than a pointer, an integer
or a float, too many arguments, or a self-test of the calling convention that fails.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import struct
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from vlite.kernels import native

SOURCE = Path(__file__).with_name("call_replay.c")
#: Integer-class and float arguments one replayed call may take (``call_replay.c``).
MAX_INTS, MAX_FLOATS = 32, 8
_INT_TYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int)
_RESULT_TYPES = (ctypes.c_int64, ctypes.c_int32, ctypes.c_int)


class _Call(ctypes.Structure):
    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("threads_at", ctypes.c_int32),
        ("checks_result", ctypes.c_int32),
        ("ints", ctypes.c_int64 * MAX_INTS),
        ("floats", ctypes.c_double * MAX_FLOATS),
    ]


class Unreplayable(Exception):
    """A recorded call the C replay cannot make (the Python loop makes it instead)."""


def compile_replay(calls: Sequence[native.RecordedCall]) -> Callable[[int], None]:
    """``replay(threads)``: make ``calls`` again, in order, with ``threads`` for
    :data:`~vlite.kernels.native.THREADS`; raises ``RuntimeError`` naming a kernel that
    returns a failure (as the Python loop does)."""
    library = _library()
    if library is not None:
        try:
            table = _call_table(calls)
        except Unreplayable:
            table = None
        if table is not None:
            run, count = library.vl_replay, len(calls)

            def replay_in_c(threads: int) -> None:
                failed = run(table, count, threads)
                if failed:
                    name = calls[failed - 1].function.__name__
                    raise RuntimeError(f"{name} failed on replay")

            replay_in_c.calls_in_c = True
            return replay_in_c

    def replay_in_python(threads: int) -> None:
        for call in calls:
            call(threads)

    replay_in_python.calls_in_c = False
    return replay_in_python


def _call_table(calls: Sequence[native.RecordedCall]) -> ctypes.Array:
    """The calls as ``vl_call`` structures (raises :class:`Unreplayable`)."""
    table = (_Call * len(calls))()
    for entry, call in zip(table, calls):
        argtypes = getattr(call.function, "argtypes", None)
        if argtypes is None or len(argtypes) != len(call.args):
            raise Unreplayable(f"{call.function.__name__}: no argument types")
        ints, floats, threads_at = [], [], -1
        for index, (kind, value) in enumerate(zip(argtypes, call.args)):
            if kind is ctypes.c_float:
                floats.append(_float_bits_as_double(value))
            elif kind in _INT_TYPES:
                if index == call.threads_at:
                    threads_at = len(ints)
                    value = 0
                ints.append(0 if value is None else int(value))
            else:
                raise Unreplayable(f"{call.function.__name__}: argument type {kind}")
        if len(ints) > MAX_INTS or len(floats) > MAX_FLOATS:
            raise Unreplayable(f"{call.function.__name__}: too many arguments")
        entry.fn = ctypes.cast(call.function, ctypes.c_void_p).value
        entry.threads_at = threads_at
        entry.checks_result = call.function.restype in _RESULT_TYPES
        entry.ints[: len(ints)] = ints
        entry.floats[: len(floats)] = floats
    return table


def _float_bits_as_double(value: float) -> float:
    """The double whose low 32 bits are ``value`` as a float (and the rest zero): a float
    argument travels in the low half of a floating-point register."""
    return struct.unpack("<d", struct.pack("<f", value) + bytes(4))[0]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The replay library, or ``None`` where its calling convention cannot be used."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return None
    try:
        library = ctypes.CDLL(str(native.build_library(SOURCE)))
    except (native.NativeKernelsUnavailable, OSError):
        return None
    library.vl_replay.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    library.vl_replay.restype = ctypes.c_int64
    probe = library.vl_replay_probe
    probe.argtypes = [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int32]
    probe.restype = ctypes.c_int32
    recorded = native.RecordedCall(probe, (*range(1, 10), 2.5, -7), None)
    try:
        table = _call_table([recorded])
    except Unreplayable:
        return None
    if probe(*recorded.args) != 0 or library.vl_replay(table, 1, 1) != 0:
        return None  # the convention does not hold here: keep the Python loop
    return library
