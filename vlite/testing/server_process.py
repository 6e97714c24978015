"""``vlite serve`` in a child process, for tests and benchmarks that need the real thing:
signals, killed processes, leftover files.

:class:`ServerProcess` starts the server on a free port in its own session (so a test can
signal it alone), waits until it is ready, records the engine cores' pids and the IPC
directories the server created, and keeps everything the server wrote to stderr.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: How long a server gets to load a tiny model and start.
READY_TIMEOUT_S = 120.0


def ipc_dirs() -> set[Path]:
    """Every front end's IPC directory in the temporary directory."""
    return set(Path(tempfile.gettempdir()).glob("vlite-ipc-*"))


def pid_is_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, exited but not yet reaped by its new
    parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def wait_until_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    """The pids still running after ``timeout_s`` (polling: they need not be our children)."""
    deadline = time.monotonic() + timeout_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if pid_is_alive(pid)]
        time.sleep(0.05)
    return alive


class ServerProcess:
    """A ``vlite serve`` child process, ready to take requests.

    Args:
        model: the model folder (``None``: vlite's default model).
        args: more ``vlite serve`` flags.
        env: extra environment variables.

    Attributes:
        address: ``http://127.0.0.1:PORT``.
        core_pids: the engine-core processes, in core order (several with
            ``--data-parallel-size``).
        core_pid: the first of them.
        ipc_dirs: the IPC directories this server created (one per core).
        ipc_dir: the only one of them (``None`` unless there is exactly one).
        log: the lines the server wrote to stderr so far.
    """

    def __init__(self, model: str | None, *args: str, env: dict[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "vlite", "serve"]
        if model is not None:
            command += ["--model", str(model)]
        command += ["--port", "0", "--log-level", "warning", *args]
        before = ipc_dirs()
        self.process = subprocess.Popen(
            command,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.log: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.core_pids: list[int] = []
        try:
            self.address = self._read_announcement()
        except BaseException:
            self.kill()
            raise
        self.core_pid = self.core_pids[0]
        self.ipc_dirs = ipc_dirs() - before
        self.ipc_dir = next(iter(self.ipc_dirs)) if len(self.ipc_dirs) == 1 else None

    def _read_announcement(self) -> str:
        """Record the pid of each ``engine core[ i]: pid N`` line; return the address
        named after them."""
        pattern = r"engine core(?: \d+)?: pid (?P<pid>\d+)| at (?P<address>http://[\d.]+:\d+)"
        while True:
            match = self.wait_for_line(pattern)
            if match["pid"] is not None:
                self.core_pids.append(int(match["pid"]))
            elif self.core_pids:
                return match["address"]

    def _read_stderr(self) -> None:
        for line in self.process.stderr:
            self._lines.put(line)
        self._lines.put(None)

    def wait_for_line(self, pattern: str, timeout_s: float = READY_TIMEOUT_S) -> re.Match:
        """The first new stderr line matching ``pattern`` (the server exiting first fails)."""
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no line matching {pattern!r}:\n{self.log_text}") from None
            if line is None:
                raise RuntimeError(f"vlite serve exited before {pattern!r}:\n{self.log_text}")
            self.log.append(line)
            if match := re.search(pattern, line):
                return match

    @property
    def log_text(self) -> str:
        while True:  # take in what arrived since
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                break
            if line is None:
                self._lines.put(None)
                break
            self.log.append(line)
        return "".join(self.log)

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout_s: float = 60.0) -> int:
        """The server's exit status, once it has exited."""
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        """End the server and everything it started, whatever state they are in."""
        for pid in (self.process.pid, *getattr(self, "core_pids", ())):
            if not pid_is_alive(pid):
                continue
            try:
                group = os.getpgid(pid)
                if group != os.getpgid(0):  # never the caller's own group
                    os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
