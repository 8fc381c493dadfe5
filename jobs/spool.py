"""What a GPU host's worker could not write to the database yet: on its own disk, in order.

The database is the record of a job's log and its end, and it may be away for a minute (a
restart, a failover) while jobs print and end. The worker never drops what it could not write:

- `LogSpool`: the log bytes not stored yet, appended to `<JOB_SPOOL_DIR>/job-<id>-<token>.log`
  and written to the database, in order and once, as soon as it answers. Bounded by
  JOB_LOG_MAX_MB: past that, output is counted and a marker line says how much was dropped.
- an end record, `job-<id>-<token>.end`: the job's final status, written before the database is
  tried and removed once the status is stored. A worker that could not store it in time (or
  died meanwhile) leaves the record; its host's spool thread (`spool_replay`) stores the log and
  then the end, exactly once (a conditional UPDATE on an unfinished status).

`token` is the job's creation time in microseconds: job ids start again with a new database, and
a spool must never be replayed into another database's job of the same id. The folder is the
worker's alone (mode 0700, made here, never a job's: JOB_FOLDERS' rule, jobs/folders.py), and
every file is opened O_NOFOLLOW. The supervisor holds an exclusive lock on its spool while its
job runs, so the replay never touches a live job's files. A lock is only as good as the file
it is on: one taken on a spool that was unlinked meanwhile (the replay finished it) is let go and
taken again on the file that now has the name; and a process forked from the holder (a prefork
pool child) closes its copies at once, or it would keep the lock after the holder let it go.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import weakref
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import psutil
from django.conf import settings

log = logging.getLogger(__name__)

_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC


def spool_dir() -> Path:
    path = Path(settings.JOB_SPOOL_DIR)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def spool_name(job_id: int, created_at: datetime) -> str:
    return f"job-{job_id}-{int(created_at.timestamp() * 1_000_000)}"


@dataclass(frozen=True)
class EndRecord:
    status: str
    exit_code: int | None
    message: str
    finished_at: str  # ISO 8601: when the worker saw the end, not when the database took it

    def write(self, name: str) -> None:
        """Atomically: a replay reads the whole record or none."""
        folder = spool_dir()
        temporary = folder / f".{name}.end.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as file:
            json.dump(asdict(self), file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, folder / f"{name}.end")

    @classmethod
    def read(cls, name: str) -> EndRecord | None:
        try:
            return cls(**json.loads((spool_dir() / f"{name}.end").read_text()))
        except FileNotFoundError:
            return None

    @staticmethod
    def remove(name: str) -> None:
        (spool_dir() / f"{name}.end").unlink(missing_ok=True)


# Every open spool of this process: a forked child closes them (`_close_in_child`).
_open_spools: weakref.WeakSet[LogSpool] = weakref.WeakSet()


class LogSpool:
    """One job's log bytes that wait for the database, on disk, in order, under an exclusive lock."""

    def __init__(self, name: str, *, cap_bytes: int, wait: bool = True) -> None:
        """Blocks until the lock is free; with `wait=False` raises BlockingIOError instead."""
        self.name = name
        self.cap_bytes = cap_bytes
        self.path = spool_dir() / f"{name}.log"
        self.fd = self._open_locked(wait)
        _open_spools.add(self)
        self.size = os.fstat(self.fd).st_size
        self.dropped = 0  # bytes refused since the spool was last emptied (full)

    def _open_locked(self, wait: bool) -> int:
        """Open and lock the file that has the spool's name when the lock is got: while this
        waited, the holder may have finished the spool and unlinked it (and a new one may have
        been made), and a lock on an unlinked file guards nothing."""
        while True:
            fd = os.open(self.path, _OPEN_FLAGS, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino:
                    return fd
            except FileNotFoundError:
                pass  # unlinked while this waited: open the name again
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    @classmethod
    def locked_by_nobody(cls, name: str, *, cap_bytes: int) -> LogSpool | None:
        """For the replay: the spool if no supervisor holds it, else None."""
        try:
            return cls(name, cap_bytes=cap_bytes, wait=False)
        except BlockingIOError:
            return None

    def append(self, data: bytes) -> None:
        room = self.cap_bytes - self.size
        if room < len(data):
            self.dropped += len(data) - max(room, 0)
            data = data[: max(room, 0)]
        if data:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
            self.size += len(data)

    def read(self) -> bytes:
        return os.pread(self.fd, self.size, 0)

    def clear(self) -> None:
        os.ftruncate(self.fd, 0)
        self.size = 0
        self.dropped = 0

    def close(self, *, remove: bool = False) -> None:
        if self.fd < 0:
            return
        if remove and not self.size:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        os.close(self.fd)  # the lock goes with it
        self.fd = -1
        _open_spools.discard(self)

    def forget(self) -> None:
        """In a forked child: close this copy of the descriptor. The lock stays the parent's."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def _close_in_child() -> None:
    for spool in list(_open_spools):
        spool.forget()
    _open_spools.clear()


os.register_at_fork(after_in_child=_close_in_child)


def spooled_names() -> list[str]:
    """The spools and end records on this host, by name, oldest job first."""
    names = {p.name.rsplit(".", 1)[0] for p in spool_dir().glob("job-*-*.log")}
    names |= {p.name.rsplit(".", 1)[0] for p in spool_dir().glob("job-*-*.end")}
    return sorted(names, key=lambda n: int(n.split("-")[1]))


def stop_flag(pid: int) -> Path | None:
    """The file by which the worker process `pid` tells its supervisors to stop their jobs when it
    shuts down: no database needed, so a shutdown during an outage stops them too. Named with
    the process's start time, so a later process with the same pid never finds an old one.
    None when there is no such process."""
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        return None
    return spool_dir() / f"worker-{pid}-{int(started * 1000)}.stopping"


def worker_stopping() -> bool:
    """This worker is shutting down (its flag: prefork's parent's, or solo's own)."""
    return any(flag is not None and flag.exists() for flag in map(stop_flag, {os.getpid(), os.getppid()}))


def job_spool(job_id: int, created_at: datetime) -> LogSpool | None:
    """The job's spool on this host, capped like its log; None (logged) when this host has none."""
    try:
        return LogSpool(spool_name(job_id, created_at), cap_bytes=settings.JOB_LOG_MAX_MB * 1024 * 1024)
    except OSError:
        log.exception("Job %s: no spool on this host (JOB_SPOOL_DIR); its log waits in memory only", job_id)
        return None
