"""Processes declared with `manage.py simulate_gpu_process`: real processes of this machine that
a simulated card shows as its own, so the watchdog can be tried end to end without a GPU.

The declarations are a small JSON file, edited under a lock and replaced whole (a reader sees the
old list or the new one); a host's worker reads it every snapshot through `DeclarationsFile`,
parsing it again only when it changed. A declaration names its process by pid *and* start time,
so a later process that reuses the pid is never taken for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from gpus.simulated.inventory import (
    InventoryError,
    checked_field,
    checked_mapping,
    is_positive_int,
    is_positive_number,
    is_text,
)

log = logging.getLogger(__name__)


# A live process whose start differs from the declared one by more than this is another process
# that reuses the pid (after a reboot, pids count from 1 again): it was never declared, and the
# watchdog must not stop it. The slack absorbs clock adjustments, which move the start times
# psutil derives from the boot time.
START_TIME_SLACK_SECONDS = 1.0


class DeclarationsError(ValueError):
    """The declarations file is malformed; the message names the file and the bad field."""


@dataclass(frozen=True)
class DeclaredProcess:
    gpu: str  # the simulated card's UUID
    pid: int
    started: float  # psutil's create_time: tells the process from a later one with its pid
    memory_mb: int

    def is_running(self) -> bool:
        started = process_started(self.pid)
        return started is not None and abs(started - self.started) <= START_TIME_SLACK_SECONDS


def process_started(pid: int) -> float | None:
    """When live process `pid` of this machine started; None when there is none."""
    if pid <= 0:
        return None  # not a process: to os.kill, 0 and -1 mean whole groups of them
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None  # exited, not reaped yet: it holds no memory and cannot be stopped
        return proc.create_time()
    except (psutil.Error, OverflowError, ValueError):
        return None


def declared_processes(path: Path) -> list[DeclaredProcess]:
    """Every declaration in `path`, exited processes included; none when there is no file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    try:
        data = checked_mapping(json.loads(text), "", {"processes"})
        raw = checked_field(data, "processes", "", lambda v: isinstance(v, list), "a list")
        return [_declared(entry, f"processes[{i}]") for i, entry in enumerate(raw)]
    except json.JSONDecodeError as exc:
        raise DeclarationsError(f"{path}: not valid JSON: {exc}") from None
    except InventoryError as exc:
        raise DeclarationsError(f"{path}: {exc}") from None


def _declared(data: object, where: str) -> DeclaredProcess:
    data = checked_mapping(data, where, {"gpu", "pid", "started", "memory_mb"})
    return DeclaredProcess(
        gpu=checked_field(data, "gpu", where, is_text, "a card UUID"),
        pid=checked_field(data, "pid", where, is_positive_int, "a positive integer"),
        started=float(checked_field(data, "started", where, is_positive_number, "a start time")),
        memory_mb=checked_field(data, "memory_mb", where, is_positive_int, "a positive integer"),
    )


def simulated_process_declare(*, path: Path, gpu: str, pid: int, memory_mb: int) -> DeclaredProcess | None:
    """Declare that live process `pid` uses `memory_mb` on simulated card `gpu`.

    Returns the declaration this one replaces (the same pid on the same card), or None.
    Raises ProcessLookupError when `pid` is no live process of this machine.
    """
    started = process_started(pid)
    if started is None:
        raise ProcessLookupError(pid)
    new = DeclaredProcess(gpu=gpu, pid=pid, started=started, memory_mb=memory_mb)
    with _declarations_edit(path) as declared:
        previous = next((d for d in declared if (d.gpu, d.pid) == (gpu, pid)), None)
        if previous is None:
            declared.append(new)
        else:
            declared[declared.index(previous)] = new
    return previous


def simulated_process_remove(*, path: Path, pid: int, gpu: str | None = None) -> list[DeclaredProcess]:
    """Take back `pid`'s declarations (on card `gpu` only, when given); returns those removed."""
    with _declarations_edit(path) as declared:
        removed = [d for d in declared if d.pid == pid and gpu in (None, d.gpu)]
        declared[:] = [d for d in declared if d not in removed]
    return removed


@contextlib.contextmanager
def _declarations_edit(path: Path) -> Iterator[list[DeclaredProcess]]:
    """The declarations of running processes, to change in place; written back on exit.

    Read, change and write happen under one exclusive lock, so two commands at once never lose
    each other's entries. The lock is a file of its own: every write replaces the data file
    with a new inode, and a lock on the old one would guard nothing.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        declared = [d for d in declared_processes(path) if d.is_running()]
        yield declared
        _declarations_write(path, declared)


def _declarations_write(path: Path, declared: list[DeclaredProcess]) -> None:
    # A temporary file renamed over the old one: a worker reads the old list or the new one,
    # never half of one.
    text = json.dumps({"processes": [asdict(d) for d in declared]}, indent=2) + "\n"
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


class DeclarationsFile:
    """The declarations file as a worker reads it, every snapshot: parsed again only when it
    changed. No file means no declarations; a malformed one counts as empty, logged once per
    version of it, so a typo never costs the server its telemetry."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._version: tuple[int, int, int] | None = None
        self._declared: list[DeclaredProcess] = []

    def running(self) -> list[DeclaredProcess]:
        if self.path is None:
            return []
        try:
            stat = self.path.stat()
            # Every write is a new inode (os.replace), so an edit that keeps the size within
            # the clock's granularity still reads as a change.
            version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except OSError:
            version = None  # no file yet
        if version != self._version:
            self._version = version
            self._declared = self._read(self.path) if version else []
        return [d for d in self._declared if d.is_running()]

    @staticmethod
    def _read(path: Path) -> list[DeclaredProcess]:
        try:
            return declared_processes(path)
        except (DeclarationsError, OSError) as exc:
            log.warning("Ignoring the simulated GPU processes until the file changes: %s", exc)
            return []
