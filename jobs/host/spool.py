"""What a GPU host's worker could not write to the database yet: on its own disk, in order.

The database is the record of a job's log and its end, and it may be away for a minute (a
restart, a failover) while jobs print and end. The worker never drops what it could not write:

- `LogSpool`: the log bytes not stored yet, appended to `<JOB_SPOOL_DIR>/job-<id>-<token>.log`
  and written to the database, in order and once, as soon as it answers. Bounded by
  JOB_LOG_MAX_MB: past that, output is counted and a marker line says how much was dropped.
  A disk that refuses the write (full: ENOSPC; a file size limit: EFBIG; EIO) is taken as the
  cap is: what it refused and what follows is counted as dropped until the spool is emptied,
  the marker says why, and the job runs on (a training is never killed for its log).
- an end record, `job-<id>-<token>.end`: the job's final status, written before the database is
  tried and removed once the status is stored. A worker that could not store it in time (or
  died meanwhile) leaves the record; its host's spool thread (`spool_replay`) stores the log and
  then the end, exactly once (a conditional UPDATE on an unfinished status).

`token` is the job's creation time in microseconds: job ids start again with a new database, and
a spool must never be replayed into another database's job of the same id. The folder is the
worker's alone (mode 0700, made here, never a job's): it and every folder above it must be root's
or the worker's and writable by nobody else, JOB_FOLDERS' rule (jobs.host.folders.worker_folder_open),
which the host worker checks as it starts. Every file is opened O_NOFOLLOW through a descriptor
of the folder and used only if it is a regular file of the worker's (jobs.host.folders.own_file_open):
an end record or a log someone else planted, or a symlink, is refused and said in the log, never
stored as a job's end or its lines. The supervisor holds an exclusive lock on its spool while its
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
import stat
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import psutil
from django.conf import settings

from jobs.host.folders import FolderError, own_file_open, own_file_read, own_file_replace, worker_folder_open

log = logging.getLogger(__name__)

_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_APPEND


@contextlib.contextmanager
def _folder() -> Iterator[int]:
    """A descriptor of JOB_SPOOL_DIR, checked (and made, mode 0700) each time."""
    fd = worker_folder_open(Path(settings.JOB_SPOOL_DIR), "JOB_SPOOL_DIR", mode=0o700)
    try:
        yield fd
    finally:
        os.close(fd)


def spool_dir() -> Path:
    """JOB_SPOOL_DIR, checked and made on first use (FolderError, an OSError, if it is unsafe)."""
    with _folder():
        return Path(settings.JOB_SPOOL_DIR)


def spool_check() -> None:
    """For the host worker's start: JOB_SPOOL_DIR is safe (`spool_dir`) and the worker may make
    files in it; else FolderError, naming the setting and the fix."""
    path = Path(settings.JOB_SPOOL_DIR)
    probe = f".probe-{os.getpid()}"
    with _folder() as dir_fd:
        try:
            os.close(own_file_open(dir_fd, probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            os.unlink(probe, dir_fd=dir_fd)
        except OSError as exc:
            raise FolderError(
                f"JOB_SPOOL_DIR ({path}) cannot be written: {exc.strerror or exc}. Fix: give JOB_SPOOL_DIR"
                " a folder on a local, writable disk that only the worker's account (or root) may write"
            ) from None


def spool_name(job_id: int, created_at: datetime) -> str:
    return f"job-{job_id}-{int(created_at.timestamp() * 1_000_000)}"


@dataclass(frozen=True)
class EndRecord:
    status: str
    exit_code: int | None
    message: str
    finished_at: str  # ISO 8601: when the worker saw the end, not when the database took it
    # Which run ended: its dispatch (Job.dispatched_at, ISO 8601). A preempted job runs again under
    # the same spool name; a record of its earlier run, stored twice (a retry whose answer was
    # lost, a replay after a crash), must not end the next one. "": a record from before it.
    run: str = ""

    def write(self, name: str) -> None:
        """Atomically: a replay reads the whole record or none."""
        with _folder() as dir_fd:
            own_file_replace(dir_fd, f"{name}.end", json.dumps(asdict(self)).encode(), mode=0o600, sync=True)

    @classmethod
    def read(cls, name: str) -> EndRecord | None:
        """None when there is none; FolderError (an OSError) for one the worker did not write."""
        with _folder() as dir_fd:
            data = own_file_read(dir_fd, f"{name}.end")
        return None if data is None else cls(**json.loads(data))

    @staticmethod
    def remove(name: str) -> None:
        with _folder() as dir_fd, contextlib.suppress(FileNotFoundError):
            os.unlink(f"{name}.end", dir_fd=dir_fd)  # the name itself: a link is never followed


# Every open spool of this process: a forked child closes them (`_close_in_child`).
_open_spools: weakref.WeakSet[LogSpool] = weakref.WeakSet()


class LogSpool:
    """One job's log bytes that wait for the database, on disk, in order, under an exclusive lock."""

    def __init__(self, name: str, *, cap_bytes: int, wait: bool = True) -> None:
        """Blocks until the lock is free; with `wait=False` raises BlockingIOError instead."""
        self.name = name
        self.cap_bytes = cap_bytes
        self.path = Path(settings.JOB_SPOOL_DIR) / f"{name}.log"
        self.fd = self._open_locked(wait)
        _open_spools.add(self)
        self.size = os.fstat(self.fd).st_size
        self.dropped = 0  # bytes refused since the spool was last emptied (full)
        self.refused_by = ""  # why the disk refused them (its error), "" for the cap
        self.dropped_total = 0  # every byte ever refused, and the last reason: for the job's end
        self.dropped_why = ""

    def _open_locked(self, wait: bool) -> int:
        """Open and lock the file that has the spool's name when the lock is got: while this
        waited, the holder may have finished the spool and unlinked it (and a new one may have
        been made), and a lock on an unlinked file guards nothing. Only a file of the worker's:
        lines someone else planted never reach a job's log (FolderError)."""
        with _folder() as dir_fd:
            while True:
                fd = own_file_open(dir_fd, f"{self.name}.log", _OPEN_FLAGS)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
                    named = os.stat(f"{self.name}.log", dir_fd=dir_fd, follow_symlinks=False)
                    if os.fstat(fd).st_ino == named.st_ino:
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
        """Add `data` after what waits; never raises for the disk. Past the cap, or once the disk
        refused a write, the rest is counted as dropped until `clear`: one gap, where the marker
        line goes (jobs.logs.store.spool_dropped_marker), and every line kept is in order."""
        room = self.cap_bytes - self.size
        if self.refused_by:
            room = 0
        if room < len(data):
            self._drop(len(data) - max(room, 0), self.refused_by)
            data = data[: max(room, 0)]
        if data:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self.fd, view) :]
            except OSError as exc:
                # A part of `data` may be on disk: cut back to whole appends, so no half line is kept.
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, self.size)
                self.refused_by = f"could not be written: {exc.strerror or exc} ({self.path.parent})"
                self._drop(len(data), self.refused_by)
                log.error(
                    "Spool %s %s; the job's output is counted as dropped until the database is back",
                    self.name,
                    self.refused_by,
                )
                return
            self.size += len(data)

    def _drop(self, count: int, refused_by: str) -> None:
        self.dropped += count
        self.dropped_total += count
        self.dropped_why = refused_by or f"was full (JOB_LOG_MAX_MB={settings.JOB_LOG_MAX_MB})"

    @property
    def dropped_note(self) -> str:
        """For the job's end message: how much of its output its log lacks, and why; "" if none."""
        if not self.dropped_total:
            return ""
        return (
            f"{self.dropped_total:,} bytes of its output were dropped while the database was away:"
            f" this host's spool for the job {self.dropped_why}."
        )

    def read(self) -> bytes:
        return os.pread(self.fd, self.size, 0)

    def ends_open(self) -> bool:
        """Whether what waits ends inside a line (a progress bar being drawn): what comes next
        continues it."""
        return bool(self.size) and os.pread(self.fd, 1, self.size - 1) != b"\n"

    def clear(self) -> None:
        os.ftruncate(self.fd, 0)
        self.size = 0
        self.dropped = 0
        self.refused_by = ""  # room again: the disk is tried again

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
    folder = spool_dir()
    names = {p.name.rsplit(".", 1)[0] for p in folder.glob("job-*-*.log")}
    names |= {p.name.rsplit(".", 1)[0] for p in folder.glob("job-*-*.end")}
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
    return Path(settings.JOB_SPOOL_DIR) / f"worker-{pid}-{int(started * 1000)}.stopping"


def stop_flag_raise(flag: Path) -> None:
    """Make the flag (`stop_flag`) through the checked folder, never through a planted link."""
    with _folder() as dir_fd:
        os.close(own_file_open(dir_fd, flag.name, os.O_WRONLY | os.O_CREAT))


def stop_flag_lower(flag: Path) -> None:
    """The worker's shutdown is over, its jobs stopped: its flag goes. Through the checked
    folder; only the name itself is unlinked, never what a link points to."""
    with _folder() as dir_fd, contextlib.suppress(FileNotFoundError):
        os.unlink(flag.name, dir_fd=dir_fd)


def worker_stopping() -> bool:
    """This worker is shutting down (its flag: prefork's parent's, or solo's own)."""
    return any(_raised(flag) for flag in map(stop_flag, {os.getpid(), os.getppid()}))


def _raised(flag: Path | None) -> bool:
    """A flag counts only as the worker made it: its own regular file, not a link or a plant."""
    if flag is None:
        return False
    try:
        st = os.stat(flag, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def job_spool(job_id: int, created_at: datetime) -> LogSpool | None:
    """The job's spool on this host, capped like its log; None (logged) when this host has none."""
    try:
        return LogSpool(spool_name(job_id, created_at), cap_bytes=settings.JOB_LOG_MAX_MB * 1024 * 1024)
    except OSError as exc:  # one line: the job's own log says it too (jobs.host.runner)
        log.error(
            "Job %s: no spool on this host (JOB_SPOOL_DIR: %s); its log waits in memory only", job_id, exc
        )
        return None
