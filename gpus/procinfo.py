"""What a GPU backend may learn about a process on this host, without privileges.

Both backends (NVML and the simulation) describe the processes they report through
:func:`describe_process`, so attribution works the same way on both: by session id
(``os.getsid``), which any user may read for any process and which a job cannot forge
(it is the pid of the session leader the worker started). The job id is resolved from it at
ingest, against the pids the workers recorded; nothing is read from the process's
environment, which the job controls and which, under JOB_USER, belongs to another user.

Everything here is best effort, one field at a time: a process that exits between NVML's
listing and this look, hides behind ``hidepid``, or belongs to another user costs only the
detail that could not be read, never the telemetry round.
"""

from __future__ import annotations

import logging
import os

import psutil

from gpus.inventory import ProcessInfo

log = logging.getLogger(__name__)

COMMAND_MAX_CHARS = 300
USERNAME_MAX_CHARS = 64
UNKNOWN_USER = "?"


def session_of(pid: int) -> int | None:
    """The process's session id; None when it is gone or its session leader is in another PID namespace.

    getsid() answers 0 for a session whose leader this namespace cannot see (a container started
    inside someone else's session): no job of ours leads such a session, so it attributes to none.
    """
    try:
        return os.getsid(pid) or None
    except (ProcessLookupError, PermissionError, OverflowError, ValueError):
        return None


def describe_process(pid: int, used_memory_mb: int | None) -> ProcessInfo:
    """A GPU process as the backends report it; "?" and "" for what cannot be read."""
    username, command = UNKNOWN_USER, ""
    try:
        proc = psutil.Process(pid)
    except (psutil.Error, OverflowError, ValueError):
        proc = None  # gone since NVML listed it, or a PID this namespace does not have
    if proc is not None:
        username = _guarded(proc, lambda p: p.username(), UNKNOWN_USER)
        command = _guarded(proc, lambda p: " ".join(p.cmdline()) or p.name(), "")
    return ProcessInfo(
        pid=pid,
        username=_printable(username)[:USERNAME_MAX_CHARS] or UNKNOWN_USER,
        command=_printable(command)[:COMMAND_MAX_CHARS],
        used_memory_mb=used_memory_mb,
        session_id=session_of(pid),
    )


def _guarded(proc: psutil.Process, read, default: str) -> str:  # type: ignore[no-untyped-def]
    try:
        value = read(proc)
    except psutil.Error:
        return default  # exited meanwhile, or another user's process under hidepid
    except Exception:  # a /proc entry the parser did not expect: this detail only
        log.debug("Could not read a detail of pid %s", proc.pid, exc_info=True)
        return default
    return value if isinstance(value, str) else default


def _printable(text: str) -> str:
    # A command line is the process's to choose: no NULs or control characters reach the
    # database (PostgreSQL refuses NUL in text) or the dashboard.
    return "".join(ch if ch.isprintable() else " " for ch in text)
