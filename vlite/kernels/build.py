"""Building the C kernels: each source compiled once per machine into a cache of libraries.

A library is named by a key over everything its machine code depends on: the source and
the headers beside it, the compiler (its path and ``--version``), the flags, and the
CPU's feature flags (``-march=native`` code runs only where they match). The build takes,
in order:

1. **the cache directory**: ``$VLITE_CACHE_DIR/kernels``, else ``$XDG_CACHE_HOME`` or
   ``~/.cache`` + ``vlite/kernels``. Where it cannot be created or written, a private
   directory under the system's temporary directory takes its place (a warning names
   both on stderr): a read-only home costs a compile per machine boot, not the kernels.
2. **a lock** (``flock`` on ``NAME-KEY.lock``): processes building the same library
   (every tensor-parallel worker on a cold cache) compile it once; the others wait for
   it and load the result.
3. **the compiler**, writing to a private name that is renamed into place when complete,
   so nothing ever loads half a library.

Each step that fails raises :class:`NativeKernelsUnavailable` saying which step, on which
path, and why.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

#: The compiler flags of every kernel library (tests swap ``-march=native`` for others).
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
#: The longest a compile may take.
COMPILE_TIMEOUT_S = 300


class NativeKernelsUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (the message says why)."""


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docstring)."""
    root = os.environ.get("VLITE_CACHE_DIR")
    if root:
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "vlite" / "kernels"


def fallback_cache_dir() -> Path:
    """The private directory used when :func:`cache_dir` cannot be written."""
    return Path(tempfile.gettempdir()) / f"vlite-kernels-{os.getuid()}"


def cpu_flags() -> str:
    """The CPU's feature flags: ``-march=native`` code is only valid where they match."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    return platform.processor() or platform.machine()


def compiler() -> str:
    """``$CC``, else ``cc`` or ``gcc`` on the ``PATH``."""
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise NativeKernelsUnavailable("no C compiler found (install gcc, or set CC)")
    return found


@functools.cache
def compiler_identity(path: str) -> str:
    """The compiler's path and the first line of its ``--version``, for the key."""
    try:
        result = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NativeKernelsUnavailable(f"the C compiler {path} could not run: {error}") from error
    lines = (result.stdout or result.stderr).strip().splitlines()
    return f"{path} {lines[0] if lines else ''}"


def library_key(source: Path, flags: tuple[str, ...], compiler_path: str) -> str:
    """16 hex digits over the source, its headers, the compiler, the flags and the CPU."""
    headers = b"".join(path.read_bytes() for path in sorted(source.parent.glob("*.h")))
    parts = [compiler_identity(compiler_path), " ".join(flags), cpu_flags()]
    return hashlib.sha256(source.read_bytes() + headers + "\n".join(parts).encode()).hexdigest()[
        :16
    ]


def build_library(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile ``source`` into the cache (once per key, under a lock); return its path.

    Raises:
        NativeKernelsUnavailable: no compiler, no writable directory, or a failed compile
            (the message names the step).
    """
    compiler_path = compiler()
    name = f"{source.stem}-{library_key(source, flags, compiler_path)}.so"
    directory = writable_cache_dir()
    target = directory / name
    if target.exists():
        return target
    with _locked(directory / f"{target.stem}.lock"):
        if not target.exists():  # another process may have built it while we waited
            _compile(compiler_path, flags, source, target)
    return target


def rebuild_library(source: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """Remove ``source``'s cached library (one that would not load) and build it again."""
    stale = build_library(source, flags)
    with _locked(stale.with_suffix(".lock")):
        stale.unlink(missing_ok=True)
    return build_library(source, flags)


def writable_cache_dir() -> Path:
    """:func:`cache_dir`, created if needed, or :func:`fallback_cache_dir` (with a
    warning) where that cannot be created or written."""
    preferred = cache_dir()
    try:
        return _ensure_writable(preferred)
    except OSError as error:
        fallback = fallback_cache_dir()
        try:
            directory = _ensure_writable(fallback)
        except OSError as fallback_error:
            raise NativeKernelsUnavailable(
                f"neither the kernel cache {preferred} ({error}) nor {fallback} "
                f"({fallback_error}) can be written"
            ) from fallback_error
        _warn_fallback(str(preferred), str(error), str(fallback))
        return directory


def _ensure_writable(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(f"no write permission on {directory}")
    return directory


@functools.cache
def _warn_fallback(preferred: str, error: str, fallback: str) -> None:
    print(
        f"kernels: the cache {preferred} cannot be written ({error}); building in "
        f"{fallback} instead (set VLITE_CACHE_DIR to keep them across reboots)",
        file=sys.stderr,
        flush=True,
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing)."""
    import fcntl  # POSIX only, as the kernels are

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise NativeKernelsUnavailable(f"locking {path} failed: {error}") from error
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _compile(compiler_path: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    """Compile to a private name in the target's directory, then rename it into place."""
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = [compiler_path, *flags, "-o", partial, str(source)]
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        os.unlink(partial)
        raise NativeKernelsUnavailable(
            f"compiling {source.name}: the C compiler {compiler_path} could not run: {error}"
        ) from error
    if result.returncode != 0:
        os.unlink(partial)
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        tail = (errors or result.stderr.strip().splitlines())[-3:]
        raise NativeKernelsUnavailable(
            f"compiling {source.name} with {compiler_path} {' '.join(flags)} failed: "
            f"{' | '.join(line.strip() for line in tail)}"
        )
    os.replace(partial, target)
