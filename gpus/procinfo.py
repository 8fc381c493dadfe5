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

import contextlib
import logging
import os
from collections.abc import Iterable

import psutil

from gpus.inventory import ProcessInfo

log = logging.getLogger(__name__)

COMMAND_MAX_CHARS = 300
USERNAME_MAX_CHARS = 64
UNKNOWN_USER = "?"
ANCESTRY_DEPTH = 32  # parents read up from a process to find the session it left, at most


def is_process_pid(pid: int) -> bool:
    """False for the pids no GPU process can have: NVML answers pid 0 (and shuffles pids) when its
    process-struct version disagrees with the driver's, and 0 and 1 are "the caller's own group"
    and init to the system calls. Such an entry is dropped where processes are read."""
    return pid > 1


def session_of(pid: int) -> int | None:
    """The process's session id; None when it is gone or its session leader is in another PID namespace.

    getsid() answers 0 for a session whose leader this namespace cannot see (a container started
    inside someone else's session): no job of ours leads such a session, so it attributes to none.
    Never asked for pid <= 1: getsid(0) is the *caller's* session, which would make pid 0 look
    like a process of the worker's own session.
    """
    if not is_process_pid(pid):
        return None
    try:
        return os.getsid(pid) or None
    except (ProcessLookupError, PermissionError, OverflowError, ValueError):
        return None


def describe_process(pid: int, used_memory_mb: int | None) -> ProcessInfo:
    """A GPU process as the backends report it; "?" and "" for what cannot be read."""
    username, command, started = UNKNOWN_USER, "", None
    proc = None
    if is_process_pid(pid):
        # Gone since NVML listed it, or a PID this namespace does not have: None.
        with contextlib.suppress(psutil.Error, OverflowError, ValueError):
            proc = psutil.Process(pid)
    if proc is not None:
        username = _guarded(proc, lambda p: p.username(), UNKNOWN_USER)
        command = _guarded(proc, lambda p: " ".join(p.cmdline()) or p.name(), "")
        started = _started(proc)
    session = session_of(pid)
    return ProcessInfo(
        pid=pid,
        username=_printable(username)[:USERNAME_MAX_CHARS] or UNKNOWN_USER,
        command=_printable(command)[:COMMAND_MAX_CHARS],
        used_memory_mb=used_memory_mb,
        session_id=session,
        started=started,
        parent_session_id=None if proc is None or session is None else parent_session_of(proc, session),
    )


def parent_session_of(proc: psutil.Process, session: int) -> int | None:
    """The session of `proc`'s nearest ancestor outside `session`: for a job's child that called
    setsid, the job's. Each parent up the line must have started no later than its child: a
    parent that died and whose pid went to a younger process breaks the line, so no stranger's
    session is ever named. None where the line breaks, reaches init, or cannot be read (another
    user's process under hidepid). A process cannot choose its parent: only what a run started
    is ever taken for the run's."""
    child = proc
    try:
        for _ in range(ANCESTRY_DEPTH):
            parent_pid = child.ppid()
            if not is_process_pid(parent_pid):
                return None  # init (or a subreaper that is): an orphan's line is broken
            parent = psutil.Process(parent_pid)
            if parent.create_time() > child.create_time():
                return None
            found = session_of(parent_pid)
            if found is None or found != session:
                return found
            child = parent
    except (psutil.Error, OSError, OverflowError, ValueError):  # OSError: an errno psutil lets through
        return None
    return None


def describe_processes(listed: Iterable[tuple[int, int | None]]) -> tuple[ProcessInfo, ...]:
    """(pid, MiB) pairs as the backends list them, described; pid <= 1 dropped (see
    `is_process_pid`), and a pid listed twice (on two MIG instances of one card) is one process
    holding the sum of what each entry says. The caller merges a device's own double entries
    (compute and graphics) first: those are one process's one figure, listed twice."""
    memory: dict[int, int | None] = {}
    for pid, used_mb in listed:
        if not is_process_pid(pid):
            log.debug("Dropped GPU process entry with pid %s", pid)
            continue
        if pid in memory and memory[pid] is not None and used_mb is not None:
            memory[pid] = memory[pid] + used_mb  # type: ignore[operator]
        elif pid not in memory or used_mb is not None:
            memory[pid] = used_mb
    return tuple(describe_process(pid, used_mb) for pid, used_mb in memory.items())


def _started(proc: psutil.Process) -> float | None:
    """create_time: what tells this process from a later one with its pid (portal.pids)."""
    try:
        return proc.create_time()
    except (psutil.Error, OSError, OverflowError, ValueError):
        return None


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
